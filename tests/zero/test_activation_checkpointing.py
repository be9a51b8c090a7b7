"""Activation checkpointing under stage 3 with parameters and optimizer state on NVMe equals plain PyTorch.

GPT-2 and Llama (transformers, built from a config, ``gradient_checkpointing_enable``)
and infinity.models.GPT (blocks called through a checkpoint function), in
both of torch's modes, fp32 and bf16, against plain PyTorch with the same
checkpointing (tests/zero/checkpointed.py): the same losses and weights
(fp32 within 1e-5 relative; bf16 the oracle's weights rounded to bf16). The
recomputation fetches the parameters again inside backward, and the prefetch
trace takes it as part of the step: every step after the first replays the
first one's trace, with no divergence and no wasted read. At world size 2
(gloo) the recomputation's all-gathers line up on both ranks.
"""

import pytest
import torch

from tests.distributed import run_distributed
from tests.zero.checkpointed import MODES, engine_run, oracle_run, stage3_nvme_config

STEPS = 3
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def assert_same_training(losses, weights, ref_losses, ref_weights, dtype: str):
    assert losses.keys() <= ref_losses.keys()
    if dtype == "fp32":
        for k, loss in losses.items():
            assert loss == pytest.approx(ref_losses[k], rel=1e-5), f"loss at {k}"
        for name, ref in ref_weights.items():
            err = (weights[name] - ref).abs().max().item() / ref.abs().max().item()
            assert err < 1e-5, f"{name}: relative difference {err:.2e}"
    else:
        for k, loss in losses.items():
            assert loss == pytest.approx(ref_losses[k], rel=1e-4), f"loss at {k}"
        for name, master in ref_weights.items():
            assert weights[name].dtype == torch.bfloat16
            torch.testing.assert_close(weights[name], master.to(torch.bfloat16), msg=name)


def assert_trace_replayed(stats, steps: int):
    """Step 0 records the trace (recomputation included); every later step replays it to its end."""
    history = stats.history
    assert [s.kind for s in history] == ["recorded"] + ["replayed"] * (steps - 1)
    assert all(s.divergence_pos is None and s.trace_switches == 0 for s in history)
    assert all(s.duplicate_reads == 0 for s in history)
    assert len({s.uses for s in history}) == 1  # the same fetches every step
    assert stats.traces == 1


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("model", ["gpt2", "llama", "gpt"])
def test_checkpointed_training_matches_plain_pytorch(model, mode, dtype, nvme_dir):
    ref_losses, ref_weights = oracle_run(model, mode, steps=STEPS, dtype=DTYPES[dtype])
    losses, weights, stats = engine_run(
        model, mode, stage3_nvme_config(nvme_dir, dtype=dtype), steps=STEPS
    )
    assert_same_training(losses, weights, ref_losses, ref_weights, dtype)
    assert_trace_replayed(stats, STEPS)


@pytest.mark.parametrize("mode", ["deepspeed", "deepspeed_non_reentrant"])
def test_infinity_checkpointing_matches_plain_pytorch(mode, nvme_dir):
    """Code written for deepspeed.checkpointing.checkpoint(self.block, x), with infinity.checkpointing."""
    ref_losses, ref_weights = oracle_run("gpt", mode, steps=STEPS)
    losses, weights, stats = engine_run("gpt", mode, stage3_nvme_config(nvme_dir), steps=STEPS)
    assert_same_training(losses, weights, ref_losses, ref_weights, "fp32")
    assert_trace_replayed(stats, STEPS)


def test_gpt_gradient_checkpointing_enable_matches_plain_pytorch(nvme_dir):
    """infinity.models.GPT's own switch: under stage 3 as in plain PyTorch, and the same numbers as
    without checkpointing (torch recomputes each block on CPU with the same kernels)."""
    ref_losses, ref_weights = oracle_run("gpt", "builtin", steps=STEPS)
    plain_losses, plain_weights = oracle_run("gpt", None, steps=STEPS)
    assert ref_losses == plain_losses
    assert all(torch.equal(ref_weights[n], plain_weights[n]) for n in plain_weights)
    losses, weights, stats = engine_run("gpt", "builtin", stage3_nvme_config(nvme_dir), steps=STEPS)
    assert_same_training(losses, weights, ref_losses, ref_weights, "fp32")
    assert_trace_replayed(stats, STEPS)


W2_CASES = [("gpt2", "non_reentrant"), ("llama", "reentrant"), ("gpt", "deepspeed")]


def _ranks(rank, cases, nvme_dir):
    out = []
    for model, mode in cases:
        losses, weights, stats = engine_run(
            model, mode, stage3_nvme_config(nvme_dir), steps=STEPS, rank=rank
        )
        out.append((losses, weights, [s.kind for s in stats.history]))
    return out


@pytest.mark.distributed
def test_world_size_2_matches_plain_pytorch(nvme_dir):
    """Two gloo ranks, each with its own batches: the recomputation all-gathers the units again inside
    backward, in the same order on both ranks; the oracle averages both ranks' gradients."""
    per_rank = run_distributed(_ranks, W2_CASES, str(nvme_dir), world_size=2)
    for i, (model, mode) in enumerate(W2_CASES):
        ref_losses, ref_weights = oracle_run(model, mode, steps=STEPS, world_size=2)
        losses = {**per_rank[0][i][0], **per_rank[1][i][0]}
        assert losses.keys() == ref_losses.keys()
        weights = {n: torch.as_tensor(w) for n, w in per_rank[0][i][1].items()}
        for name in ref_weights:  # every rank ends with the same full weights
            assert (per_rank[0][i][1][name] == per_rank[1][i][1][name]).all(), (model, mode, name)
        assert_same_training(losses, weights, ref_losses, ref_weights, "fp32")
        for r in range(2):
            assert per_rank[r][i][2] == ["recorded"] + ["replayed"] * (STEPS - 1), (model, mode, r)
