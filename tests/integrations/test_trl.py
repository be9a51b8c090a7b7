"""TRL's SFTTrainer on the engine: ``infinity_trainer(trl.SFTTrainer)`` ([Note: Trainer subclasses on
the engine] in infinity/integrations/transformers.py), a tiny Llama with PEFT LoRA, stage 3 on NVMe.

Oracles: SFTTrainer's own loss (its fused LM head, ``trl.trainer.utils.add_fused_lm_head``) on a plain
PEFT model trained by torch's AdamW over the batches SFTTrainer's collator made, and plain
SFTTrainer's losses.

SFTConfig defaults to ``bf16=True``: plain SFTTrainer then runs its forward under bf16 autocast (on the
CPU too: Accelerate's mixed precision), which put its step-0 loss 3.4e-6 relative off the fp32 loss,
and more after a step. The engine's precision follows ``bf16=`` too (an "auto" filled, a missing
section added enabled: [Note: the Trainer's precision] in infinity/integrations/transformers.py); the
config here trains in fp32, so the arguments say ``bf16=False`` and plain SFTTrainer then gives the
hand-written losses exactly.
SFTConfig's default ``gradient_checkpointing=True`` is not the cause: the Trainer turns on the model's
own activation checkpointing (``activation_checkpointing_enable``) before the engine exists, and it
recomputes each layer under the engine as in plain PyTorch (checked below: on, and equal losses).
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

import trl  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

from infinity.integrations.transformers import infinity_trainer  # noqa: E402
from infinity.zero.gathered import GatheredParameters  # noqa: E402
from tests.hf.lora import lora  # noqa: E402
from tests.hf.models import SEQ, VOCAB, build, build_under_init, ds_config  # noqa: E402

LR = 1e-3
STEPS = 3


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1")


def dataset(samples: int = 2 * STEPS):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, VOCAB, (samples, SEQ), generator=g)
    return datasets.Dataset.from_dict({"input_ids": ids.tolist()})


def arguments(out, **overrides) -> trl.SFTConfig:
    with warnings.catch_warnings():  # SFTConfig sets TrainingArguments' deprecated name itself
        warnings.filterwarnings("ignore", "`gradient_checkpointing` is deprecated", FutureWarning)
        return _arguments(out, **overrides)


def _arguments(out, **overrides) -> trl.SFTConfig:
    values: dict = dict(
        output_dir=str(out),
        max_steps=STEPS,
        per_device_train_batch_size=2,
        learning_rate=LR,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        bf16=False,  # SFTConfig's default True autocasts plain SFTTrainer (see the docstring)
    )
    values.update(overrides)
    return trl.SFTConfig(**values)


def losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def infinity_config(nvme_dir) -> dict:
    cfg = ds_config(nvme_dir)
    del cfg["optimizer"]  # the Trainer's AdamW, mapped onto the engine's (as InfinityTrainer does)
    for key in (
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "gradient_clipping",
    ):
        cfg[key] = "auto"
    return cfg


def test_sft_trainer_on_the_engine_trains_with_sft_losses(nvme_dir, tmp_path):
    cls = infinity_trainer(trl.SFTTrainer)
    assert issubclass(cls, trl.SFTTrainer) and cls.__name__ == "InfinitySFTTrainer"
    cfg = infinity_config(nvme_dir)
    batches = []
    trainer = cls(
        model=lora(build_under_init("llama", cfg, seed=0)),
        args=arguments(tmp_path / "run"),
        train_dataset=dataset(),
        processing_class=tokenizer(),
        infinity_config=cfg,
    )
    compute_loss = trainer.compute_loss

    def recorded(model, inputs, *args, **kwargs):
        batches.append({k: v.clone() for k, v in inputs.items() if torch.is_tensor(v)})
        return compute_loss(model, inputs, *args, **kwargs)

    trainer.compute_loss = recorded
    trainer.train()
    got = losses(trainer)
    assert trainer.engine is not None and trainer.engine.global_steps == STEPS
    trainer.engine.close()

    # SFTTrainer's loss (the fused head's mean token NLL) on plain PEFT with torch's AdamW
    model = lora(build("llama", seed=0))
    add_fused_lm_head(model.get_base_model())
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0, foreach=False
    )
    want = []
    for b in batches:
        out = model(**b, use_cache=False, fused_lm_head=True)
        loss = -out.log_probs.sum() / out.label_mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        want.append(loss.item())
    assert len(batches) == STEPS
    assert got == pytest.approx(want, rel=1e-5)

    # plain SFTTrainer, with the same arguments (activation checkpointing on: SFTConfig's default)
    plain = trl.SFTTrainer(
        model=lora(build("llama", seed=0)),
        args=arguments(tmp_path / "plain"),
        train_dataset=dataset(),
        processing_class=tokenizer(),
    )
    plain.train()
    assert plain.model.get_base_model().is_activation_checkpointing
    assert trainer.model.get_base_model().is_activation_checkpointing  # the same under the engine
    assert got == pytest.approx(losses(plain), rel=1e-5)


GAS, EPS = 4, 1e-4


def _sft_window_run(tmp_path, nvme_dir, *, layer_major):
    """InfinitySFTTrainer on the LoRA Llama, gradient_accumulation_steps=4 (2 steps): the logged
    losses, the adapters' weights, and each compute_loss call's batch, num_items_in_batch and thread."""
    cls = infinity_trainer(trl.SFTTrainer)
    cfg = infinity_config(nvme_dir)
    trainer = cls(
        model=lora(build_under_init("llama", cfg, seed=0)),
        args=arguments(tmp_path, gradient_accumulation_steps=GAS, max_steps=2, adam_epsilon=EPS),
        train_dataset=dataset(2 * GAS * 2),
        processing_class=tokenizer(),
        infinity_config=cfg,
        layer_major=layer_major,
    )
    calls = []
    compute_loss = trainer.compute_loss

    def recorded(model, inputs, *args, num_items_in_batch=None, **kwargs):
        batch = {k: v.clone() for k, v in inputs.items() if torch.is_tensor(v)}
        calls.append((batch, num_items_in_batch, threading.current_thread().name))
        return compute_loss(model, inputs, *args, num_items_in_batch=num_items_in_batch, **kwargs)

    trainer.compute_loss = recorded
    trainer.train()
    assert trainer.engine.global_steps == 2
    with GatheredParameters(trainer.engine):
        weights = {
            n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad
        }
    trainer.engine.close()
    return losses(trainer), weights, calls


def test_sft_trainer_accumulates_layer_major_with_sft_losses(nvme_dir, tmp_path):
    """gradient_accumulation_steps=4: each window through engine.train_batch, SFTTrainer's
    compute_loss in the micro-batch threads. Oracles: the same run micro-batch-major
    (layer_major=False), and SFTTrainer's loss (the fused head's token NLL over the window's
    num_items_in_batch, or each micro-batch's mean over the window's 4) summed over each window on
    plain PEFT with torch's AdamW. Tolerances as test_sft_trainer_on_the_engine_trains_with_sft_losses
    (1e-5 on the losses); the adapters' weights against micro-batch-major 1e-6 of their largest
    element: the same engine, the gradient the same 4-term sum in another order, which Adam
    amplifies by |terms| / eps for an element whose terms cancel, so eps = 1e-4 as in
    tests/engine/test_train_batch.py."""
    (nvme_dir / "lm").mkdir()
    (nvme_dir / "mbm").mkdir()
    got, lm_weights, calls = _sft_window_run(tmp_path / "lm", nvme_dir / "lm", layer_major=True)
    mbm, mbm_weights, mbm_calls = _sft_window_run(
        tmp_path / "mbm", nvme_dir / "mbm", layer_major=False
    )
    assert [t for *_, t in calls] == [f"infinity-microbatch-{i}" for i in range(GAS)] * 2
    assert not any("microbatch" in t for *_, t in mbm_calls)
    assert got == pytest.approx(mbm, rel=1e-6)
    for name, ref in mbm_weights.items():
        err = (lm_weights[name] - ref).abs().max().item() / ref.abs().max().item()
        assert err <= 1e-6, (name, err)

    model = lora(build("llama", seed=0))
    add_fused_lm_head(model.get_base_model())
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=LR,
        eps=EPS,
        weight_decay=0.0,
        foreach=False,
    )
    want = []
    for start in range(0, len(calls), GAS):
        step_loss = 0.0
        for batch, num_items, _ in calls[start : start + GAS]:
            out = model(**batch, use_cache=False, fused_lm_head=True)
            if num_items is None:
                loss = -out.log_probs.sum() / out.label_mask.sum() / GAS
            else:
                loss = -out.log_probs.sum() / num_items
            loss.backward()
            step_loss += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        want.append(step_loss)
    assert got == pytest.approx(want, rel=1e-5)


def test_infinity_trainer_refuses_what_is_not_a_trainer():
    with pytest.raises(TypeError, match="takes a transformers.Trainer subclass"):
        infinity_trainer(torch.nn.Module)
