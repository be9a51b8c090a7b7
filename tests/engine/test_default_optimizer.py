"""No optimizer section, none passed, lr= given: the HF Trainer's default AdamW.

Oracles from transformers 5.23 itself: ``Trainer.get_decay_parameter_names``
for which parameters decay, and torch's AdamW over the Trainer's two param
groups (decay / no decay) for the training.
"""

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import (
    BertConfig,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
    Trainer,
)

import infinity
from infinity.engine.optimizers import decay_parameter_names
from infinity.zero.gathered import GatheredParameters
from tests.engine.models import batch, tiny_gpt
from tests.engine.reference import BETAS, CLIP, EPS, LR, WD, engine_config

STEPS = 4


class Nested(nn.Module):
    """Names the patterns must catch or spare: a top-level bias, a LayerNorm under another name,
    "norm" inside a longer word, a parameter of a LayerNorm's parent."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(3))
        self.scale = nn.Parameter(torch.ones(3))
        self.block = nn.ModuleDict({"pre": nn.LayerNorm(3), "normalizer": nn.Linear(3, 3)})
        self.final_norm = nn.Linear(3, 3)
        self.norm = nn.Linear(3, 3)


def _hf_models():
    yield GPT2LMHeadModel(
        GPT2Config(
            n_embd=16,
            n_layer=1,
            n_head=2,
            vocab_size=64,
            n_positions=16,
            bos_token_id=0,
            eos_token_id=0,
        )
    )
    yield LlamaForCausalLM(
        LlamaConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            vocab_size=64,
        )
    )
    yield BertModel(
        BertConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            vocab_size=64,
        )
    )
    yield T5ForConditionalGeneration(
        T5Config(d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, vocab_size=64)
    )
    yield tiny_gpt()
    yield Nested()


def test_decay_parameter_names_are_hf_trainers():
    for model in _hf_models():
        ours = decay_parameter_names(model)
        assert ours == Trainer.get_decay_parameter_names(None, model), type(model).__name__
        assert 0 < len(ours) < len(list(model.named_parameters())), type(model).__name__


def _hf_trainer_adamw(model):
    """What Trainer.create_optimizer builds for AdamW (foreach off, as the fp32 oracles here)."""
    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": WD},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, foreach=False)


def _train_plain():
    torch.manual_seed(0)
    model = tiny_gpt()
    opt = _hf_trainer_adamw(model)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, 0, 0)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "stage,offload_param,offload_optimizer", [(0, "none", "none"), (3, "nvme", "nvme")]
)
def test_lr_without_optimizer_trains_as_the_hf_trainers_default_adamw(
    stage, offload_param, offload_optimizer, nvme_dir
):
    ref_losses, ref_weights = _train_plain()
    cfg = engine_config(stage, offload_param, offload_optimizer, nvme_dir, gas=1)
    del cfg["optimizer"]
    torch.manual_seed(0)
    model = tiny_gpt()
    # HF's names; warmup_steps and num_training_steps fill nothing here (no scheduler): ignored
    engine = infinity.initialize(
        model,
        cfg,
        learning_rate=LR,
        adam_beta1=BETAS[0],
        adam_beta2=BETAS[1],
        adam_epsilon=EPS,
        weight_decay=WD,
        max_grad_norm=CLIP,
        warmup_steps=10,
        num_training_steps=100,
    )
    losses = []
    try:
        assert engine.config.optimizer.hf_trainer_default
        assert [g["weight_decay"] for g in engine.optimizer.param_groups] == [WD, 0.0]
        for step in range(STEPS):
            x, y = batch(step, 0, 0)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        with GatheredParameters(engine):
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        engine.close()
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for n, ref in ref_weights.items():
        assert (weights[n] - ref).abs().max() <= 1e-5 * ref.abs().max(), n


def test_without_lr_or_optimizer_the_refusal_names_the_ways_out(nvme_dir):
    cfg = engine_config(0, "none", "none", nvme_dir, gas=1)
    del cfg["optimizer"]
    with pytest.raises(
        ValueError,
        match=r"or pass lr= \(and betas=, eps=, weight_decay=\) for the HF Trainer's default AdamW; "
        r"a model that does not train needs none .*for inference from NVMe call infinity\.initialize "
        r"at zero_optimization\.stage 3\)$",
    ):
        infinity.initialize(tiny_gpt(), cfg, weight_decay=0.1)


def test_initialize_reads_the_hidden_size_from_the_models_config(nvme_dir):
    cfg = engine_config(3, "cpu", "cpu", nvme_dir, gas=1)
    cfg["zero_optimization"].update(
        reduce_bucket_size="auto",
        stage3_prefetch_bucket_size="auto",
        stage3_param_persistence_threshold="auto",
    )
    model = tiny_gpt()
    model.config = SimpleNamespace(hidden_size=32)  # what an HF model carries
    engine = infinity.initialize(model, cfg)
    try:
        z = engine.config.zero_optimization
        assert (
            z.reduce_bucket_size,
            z.stage3_prefetch_bucket_size,
            z.stage3_param_persistence_threshold,
        ) == (1024, 921, 320)
        assert dict(engine.config.auto_filled)["zero_optimization.reduce_bucket_size"] == (
            "model.config.hidden_size=32"
        )
    finally:
        engine.close()
