"""transformers' models trained under stage 3 with parameters and optimizer state on NVMe give
plain PyTorch's losses: fp32 against torch's AdamW, bf16 against mixed precision written by hand.

Every model is built under zero.Init and called with keyword batches, ``labels=`` included
(``engine(**batch)``); each training step is followed by an eval forward in ``eval()`` mode under
``torch.no_grad()``, a prefetch-trace step of its own.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import infinity
from infinity.zero.gathered import GatheredParameters
from tests.hf.models import ARCHS, batch, build_under_init, ds_config
from tests.hf.reference import eval_loss, mixed_run, plain_run

STEPS = 3


def engine_run(
    arch: str,
    cfg: dict,
    *,
    steps: int,
    checkpointing: str | None = None,
    init_dtype: torch.dtype | None = None,
):
    model = build_under_init(arch, cfg, dtype=init_dtype)
    if (
        checkpointing is not None
    ):  # as users turn it on; transformers checkpoints each layer in training only
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers 5's rename of the method
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"}
            )
    engine = infinity.initialize(model, cfg)
    losses = {}
    try:
        for step in range(steps):
            loss = engine(**batch(arch, step)).loss
            engine.backward(loss)
            engine.step()
            losses[step] = loss.item()
            engine.eval()
            losses[(step, "eval")] = eval_loss(engine, arch, step)
            engine.train()
        with GatheredParameters(engine):
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        stats = engine.prefetch_stats()
        units = len(engine.checkpoint_parts().units)
        persistent = sum(u.persistent for u in engine.checkpoint_parts().units)
    finally:
        engine.close()
    return losses, weights, stats, (units, persistent)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_fp32_losses_match_plain_pytorch(arch, nvme_dir):
    ref = plain_run(arch, steps=STEPS)
    losses, _, stats, (units, persistent) = engine_run(arch, ds_config(nvme_dir), steps=STEPS)
    assert losses[0] == ref[0]  # the same weights: the same first loss, to the bit
    for k, v in ref.items():
        assert losses[k] == pytest.approx(v, rel=1e-5), k
    assert persistent < units / 2, "most units must stream from NVMe"
    # The first training step records the trace; each eval forward is a step of its own that follows
    # it and ends early ("short"), leaving the trace to the next training step, which replays it.
    assert [s.kind for s in stats.history] == ["recorded", "short"] + ["replayed", "short"] * (
        STEPS - 1
    )
    assert stats.total.prefetch_hits > 0  # later steps read ahead on the recorded trace


@pytest.mark.parametrize("arch", list(ARCHS))
def test_bf16_matches_hand_written_mixed_precision(arch, nvme_dir):
    """Built under zero.Init with a bf16 config, the model is partitioned in bf16 ([Note: zero.Init's
    dtype] in infinity/zero/init.py): the masters start from its bf16 values, widened."""
    ref, masters = mixed_run(arch, torch.bfloat16, steps=STEPS, rounded_start=True)
    losses, weights, _, _ = engine_run(arch, ds_config(nvme_dir, precision="bf16"), steps=STEPS)
    for k, v in ref.items():
        assert losses[k] == pytest.approx(v, rel=1e-4), k
    for name, master in masters.items():
        assert weights[name].dtype == torch.bfloat16
        torch.testing.assert_close(weights[name], master.to(torch.bfloat16), msg=name)


@pytest.mark.parametrize("precision,mode", [("fp32", "reentrant"), ("bf16", "non_reentrant")])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_activation_checkpointing_changes_no_number(arch, precision, mode, nvme_dir):
    """gradient_checkpointing_enable under stage 3 on NVMe: the recomputation fetches each layer's
    parameters again and replays the forward's RNG, so the oracle is the same plain run as without it
    (fp32: torch AdamW; bf16: the hand-written mixed-precision loop)."""
    if precision == "fp32":
        ref = plain_run(arch, steps=STEPS)
        rel = 1e-5
    else:
        ref, _ = mixed_run(arch, torch.bfloat16, steps=STEPS, rounded_start=True)
        rel = 1e-4
    losses, _, stats, _ = engine_run(
        arch, ds_config(nvme_dir, precision=precision), steps=STEPS, checkpointing=mode
    )
    for k, v in ref.items():
        assert losses[k] == pytest.approx(v, rel=rel), k
    # The recomputation is part of the recorded trace: later training steps replay it, reading nothing on demand.
    assert [s.kind for s in stats.history] == ["recorded", "short"] + ["replayed", "short"] * (
        STEPS - 1
    )
    assert all(s.on_demand == 0 for s in stats.history[2::2])
