"""The engine's model saves its real weights at world size 2 (gloo) under stage 3, and as torch
does at the stages that keep parameters whole ([Note: saving a partitioned model] in
infinity/engine/saving.py).

Oracle: the weights the engine holds, read through GatheredParameters on each rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.checkpoint.helpers import config, make_engine, train, weights
from tests.distributed import run_distributed


def _save_on_each_rank(rank: int, swap: str, root: str) -> dict:
    engine, model = make_engine("gpt", config(3, "nvme", "nvme", swap), seed=0)
    try:
        train(engine, 0, 2, rank=rank)  # each rank its own batches: the ranks' gradients differ
        held = weights(engine)
        state = model.state_dict()
        first = next(iter(held))
        part = engine.gathered_state_dict([first])
        engine.save_pretrained(Path(root) / "out")  # a plain torch module: out/model.safetensors
    finally:
        engine.close()
    return {"held": held, "state": state, "part": part, "first": first}


@pytest.mark.distributed
def test_state_dict_and_save_pretrained_at_world_size_2(nvme_dir, tmp_path):
    results = run_distributed(_save_on_each_rank, str(nvme_dir), str(tmp_path))
    saved = load_file(tmp_path / "out" / "model.safetensors")
    for r in results:
        held = {k: torch.from_numpy(v) for k, v in r["held"].items()}
        assert all(torch.equal(held[k], torch.from_numpy(v)) for k, v in results[0]["held"].items())
        state = {k: torch.from_numpy(v) for k, v in r["state"].items()}
        for k, v in held.items():
            assert torch.equal(state[k], v) and torch.equal(saved[k], v), k
        assert list(r["part"]) == [r["first"]] and torch.equal(
            torch.from_numpy(r["part"][r["first"]]), held[r["first"]]
        )


@pytest.mark.parametrize("stage", [0, 2])
def test_stages_that_keep_parameters_whole_save_as_torch_does(stage, nvme_dir, tmp_path):
    engine, model = make_engine(
        "gpt", config(stage, "none", "cpu" if stage else "none", nvme_dir), seed=0
    )
    try:
        train(engine, 0, 2)
        want = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}
        assert all(torch.equal(v, want[k]) for k, v in engine.gathered_state_dict().items())
        engine.save_pretrained(tmp_path / "out")
    finally:
        engine.close()
    saved = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(saved) == sorted(want) and all(torch.equal(saved[k], v) for k, v in want.items())
