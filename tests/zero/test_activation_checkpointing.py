"""Activation checkpointing under stage 3 with parameters and optimizer state on NVMe equals plain PyTorch.

GPT-2 and Llama (transformers, built from a config, ``gradient_checkpointing_enable``)
and infinity.models.GPT (blocks called through a checkpoint function), in
both of torch's modes, fp32 and bf16, against plain PyTorch with the same
checkpointing (tests/zero/checkpointed.py): the same losses and weights
(fp32 within 1e-5 relative; bf16 the oracle's weights rounded to bf16). The
recomputation fetches the parameters again inside backward, and the prefetch
trace takes it as part of the step: every step after the first replays the
first one's trace, with no divergence and no wasted read.
"""

import pytest
import torch

from tests.zero.checkpointed import MODES, engine_run, oracle_run, stage3_nvme_config

STEPS = 3
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def assert_same_training(losses, weights, ref_losses, ref_weights, dtype: str):
    if dtype == "fp32":
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        for name, ref in ref_weights.items():
            err = (weights[name] - ref).abs().max().item() / ref.abs().max().item()
            assert err < 1e-5, f"{name}: relative difference {err:.2e}"
    else:
        assert losses == pytest.approx(ref_losses, rel=1e-4)
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
    losses, weights, stats = engine_run(model, mode, stage3_nvme_config(nvme_dir, dtype=dtype), steps=STEPS)
    assert_same_training(losses, weights, ref_losses, ref_weights, dtype)
    assert_trace_replayed(stats, STEPS)
