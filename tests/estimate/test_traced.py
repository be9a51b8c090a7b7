"""Activations of any model counted in one forward on fake tensors, against what torch's saved-tensor hooks see."""

from __future__ import annotations

import dataclasses
import logging
import warnings

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

from infinity.estimate import ZeroSetting, estimate_memory, gpt_activations
from infinity.estimate.traced import HEAP_MARGIN_QUARTERS, count_saved, traced_activations
from infinity.models import GPT, GPTConfig

transformers = pytest.importorskip("transformers")

B, T = 2, 32


def _gpt2(checkpointing: str | None = None) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=3,
        n_embd=64,
        n_head=4,
        vocab_size=128,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(cfg)
    if checkpointing is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"}
            )
    return model.train()


class Stack(nn.Module):
    """A plain model no rule knows: MLP blocks in a ModuleList, each optionally under torch's checkpoint."""

    def __init__(self, width: int = 48, depth: int = 4, checkpointing: str | None = None):
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(width),
                nn.Linear(width, 4 * width),
                nn.GELU(),
                nn.Linear(4 * width, width),
            )
            for _ in range(depth)
        )
        self.head = nn.Linear(width, 3)
        self.checkpointing = checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            if self.checkpointing is None:
                h = h + block(h)
            else:
                h = h + torch.utils.checkpoint.checkpoint(
                    block, h, use_reentrant=self.checkpointing == "reentrant"
                )
        return self.head(h).float().logsumexp(-1).mean()


def _stack_inputs(b: int, t: int):
    return (torch.zeros(b, t, 8),), {}


def _hooked_nbytes(model: nn.Module, args, kwargs) -> int:
    """Bytes torch's saved-tensor hooks see saved in a real forward (a storage once, parameters left out)."""
    params = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}
    alive = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        alive.append(t)  # a freed storage would hand its address to a later one
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen.setdefault(s.data_ptr(), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*args, **kwargs)
    return sum(seen.values())


def _lm_inputs():
    ids = torch.randint(0, 128, (B, T), generator=torch.Generator().manual_seed(0))
    return (), {"input_ids": ids, "labels": ids}


@pytest.fixture(autouse=True)
def _quiet_transformers():
    logging.getLogger("transformers").setLevel(logging.ERROR)


def test_a_transformers_lm_is_counted_as_torch_sees_it():
    model = _gpt2()
    count = count_saved(model, micro_batch=B, seq=T, dtype=torch.float32)
    assert count.saved == _hooked_nbytes(model, *_lm_inputs())
    assert not count.checkpoints and count.kept == count.saved
    assert len(count.layers) == 3 and min(count.layers) > 0
    assert count.outside_layers + sum(count.layers) == count.saved


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_a_checkpointed_transformers_lm_keeps_what_torch_keeps(mode):
    plain = count_saved(_gpt2(), micro_batch=B, seq=T, dtype=torch.float32)
    model = _gpt2(mode)
    count = count_saved(model, micro_batch=B, seq=T, dtype=torch.float32)
    assert count.checkpoints
    # The reentrant checkpoint saves its inputs where hooks see them: what a run keeps to backward.
    kept = _hooked_nbytes(_gpt2("reentrant"), *_lm_inputs())
    assert count.kept == pytest.approx(kept, rel=0.02)
    assert count.kept < plain.saved / 5
    assert count.largest_region == pytest.approx(max(plain.layers), rel=0.05)


@pytest.mark.parametrize("mode", [None, "reentrant", "non_reentrant"])
def test_a_plain_module_with_given_inputs_is_counted_as_torch_sees_it(mode):
    torch.manual_seed(0)
    model = Stack(checkpointing=mode)
    count = count_saved(model, micro_batch=B, seq=T, dtype=torch.float32, inputs=_stack_inputs)
    args, kwargs = _stack_inputs(B, T)
    args = (torch.randn_like(args[0]),)
    if mode is None:
        assert count.saved == _hooked_nbytes(model, args, kwargs)
        assert not count.checkpoints
        return
    assert count.checkpoints
    reentrant = Stack(checkpointing="reentrant")
    reentrant.load_state_dict(model.state_dict())
    assert count.kept == _hooked_nbytes(reentrant, args, kwargs)
    assert count.largest_region == max(count.layers)


def test_a_model_whose_inputs_are_not_known_is_not_counted():
    assert count_saved(Stack(), micro_batch=B, seq=T, dtype=torch.float32) is None
    est = estimate_memory(
        Stack(),
        micro_batch=B,
        seq=T,
        device="cpu",
        machine=False,
        baseline_nbytes=0,
        settings=[ZeroSetting(0, "none", "none")],
    )
    assert est.activations is None


def test_the_training_dtype_is_counted_as_a_model_in_it_saves():
    count = count_saved(_gpt2(), micro_batch=B, seq=T, dtype=torch.bfloat16)
    assert count.saved == _hooked_nbytes(_gpt2().to(torch.bfloat16), *_lm_inputs())
    assert count.saved < count_saved(_gpt2(), micro_batch=B, seq=T, dtype=torch.float32).saved * 0.7


def test_the_estimate_counts_as_the_model_checkpoints():
    """activation_checkpointing=None follows the module; True/False override it; checkpointing costs less."""
    kw = dict(
        micro_batch=B,
        seq=T,
        device="cpu",
        machine=False,
        baseline_nbytes=0,
        settings=[ZeroSetting(0, "none", "none")],
    )
    plain = estimate_memory(_gpt2(), **kw)
    ckpt = estimate_memory(_gpt2("non_reentrant"), **kw)
    assert not plain.checkpointing and ckpt.checkpointing
    assert "counted in one forward of GPT2LMHeadModel" in plain.activations.source
    assert ckpt.activations.peak(checkpointing=True) < plain.activations.peak(checkpointing=False)
    assert estimate_memory(_gpt2(), activation_checkpointing=True, **kw).checkpointing
    assert not estimate_memory(
        _gpt2("reentrant"), activation_checkpointing=False, **kw
    ).checkpointing

    def item(est):
        return next(
            i.nbytes
            for i in est.settings[0].breakdown.items
            if i.name == "activations saved for backward"
        )

    assert (
        item(ckpt) == ckpt.activations.saved_checkpointed < item(plain) == plain.activations.saved
    )


def test_the_figures_hold_what_is_saved_with_room_for_the_allocator():
    model = _gpt2()
    count = count_saved(model, micro_batch=B, seq=T, dtype=torch.float32)
    acts, checkpoints = traced_activations(model, micro_batch=B, seq=T, dtype=torch.float32)
    assert not checkpoints
    assert acts.saved == count.saved + HEAP_MARGIN_QUARTERS * sum(count.layers) // 4
    # Without checkpointing in the model, the checkpointed figure assumes every layer checkpointed.
    assert acts.saved_checkpointed < acts.saved
    assert acts.saved_checkpointed >= count.outside_layers + count.layer_inputs + 2 * max(
        count.layers
    )


def test_infinity_gpt_keeps_its_measured_coefficients():
    cfg = GPTConfig(vocab_size=128, seq_len=32, n_layer=2, n_head=4, d_model=64)
    torch.manual_seed(0)
    kw = dict(
        micro_batch=B,
        seq=T,
        precision="fp32",
        device="cpu",
        machine=False,
        baseline_nbytes=0,
        settings=[ZeroSetting(0, "none", "none")],
    )
    for model in (GPT(cfg), cfg):
        est = estimate_memory(model, **kw)
        assert est.activations == gpt_activations(cfg, micro_batch=B, seq=T, itemsize=4)
        assert "measured coefficients" in est.activations.source
        assert not est.checkpointing
    checkpointed = GPT(
        dataclasses.replace(cfg, n_layer=8)
    )  # deep enough that checkpointing saves memory
    checkpointed.gradient_checkpointing_enable()
    est = estimate_memory(checkpointed, **kw)
    assert est.checkpointing
    assert est.activations.peak(checkpointing=True) < est.activations.peak(checkpointing=False)


def test_a_model_built_under_zero_init_is_counted_at_its_true_shapes():
    import infinity

    kw = dict(
        micro_batch=B,
        seq=T,
        precision="fp32",
        device="cpu",
        machine=False,
        baseline_nbytes=0,
        settings=[ZeroSetting(3, "cpu", "cpu")],
    )
    plain = estimate_memory(_gpt2(), **kw)
    with infinity.zero.Init(
        config={"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    ):
        placeholders = _gpt2()
    assert any(p.numel() == 0 for p in placeholders.parameters())
    assert estimate_memory(placeholders, **kw).activations == plain.activations


def _moe(arch: str) -> nn.Module:
    """A tiny mixture-of-experts LM as transformers builds it (4 experts, top 2)."""
    torch.manual_seed(0)
    shared = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    if arch == "mixtral":
        cfg = transformers.MixtralConfig(num_local_experts=4, **shared)
    else:
        cfg = transformers.Qwen2MoeConfig(
            num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=32, **shared
        )
    return transformers.AutoModelForCausalLM.from_config(cfg).train()


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_a_mixture_of_experts_is_counted_as_torch_sees_it(arch):
    """[Note: mixture of experts]: the routed tokens' saves do not depend on the routing, so the
    count on fake tensors equals what a real forward (real routing) saves."""
    model = _moe(arch)
    count = count_saved(model, micro_batch=B, seq=T, dtype=torch.float32)
    assert count is not None and not count.experts_switched
    assert count.saved == _hooked_nbytes(model, *_lm_inputs())


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_an_eager_experts_loop_is_counted_through_grouped_mm_and_says_so(arch):
    model = _moe(arch)
    grouped = count_saved(model, micro_batch=B, seq=T, dtype=torch.float32)
    model.set_experts_implementation("eager")
    count = count_saved(model, micro_batch=B, seq=T, dtype=torch.float32)
    assert count.experts_switched and count.saved == grouped.saved
    assert model.config._experts_implementation == "eager"  # put back
    eager = _hooked_nbytes(model, *_lm_inputs())
    assert (
        grouped.saved <= eager <= 1.1 * grouped.saved
    )  # the loop's extra copies, within the note's range
    acts, _ = traced_activations(model, micro_batch=B, seq=T, dtype=torch.float32)
    assert "grouped_mm" in acts.source and acts.saved >= eager


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_initialize_on_a_mixture_of_experts_prints_nothing_and_counts_its_activations(
    arch, capfd, caplog, tmp_path
):
    import infinity

    model = _moe(arch)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    with caplog.at_level(logging.INFO):
        engine = infinity.initialize(model, cfg)
    captured = capfd.readouterr()
    assert "Traceback" not in captured.err + captured.out
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records
    assert not [r for r in caplog.records if r.name.startswith("torch")]
    assert engine is not None
    est = estimate_memory(
        model,
        config=cfg,
        micro_batch=2,
        seq=64,
        device="cpu",
        machine=False,
        settings=[ZeroSetting(2, "none", "none")],
    )
    assert est.activations is not None and est.activations.saved > 0
    assert f"counted in one forward of {type(model).__name__}" in est.activations.source
