"""Training on several nodes, each with its own NVMe: ZeRO-3 with parameters and optimizer state in
each node's swap files gives single-process plain PyTorch's losses and weights (fp32, 1e-5
relative: tests/engine/reference.py's oracle, every rank's batches taken in one process), and no
rank opens a file outside its own node's nvme_path folder for its rank.

The harness (harness.py) gives each node a private directory at the same nvme_path, so a rank that
reached for another node's files would not find them; the checks here also read which files each
rank had open mid-run, which swap folders each node holds and the host-memory budget each rank
planned within (the node's memory shared by its ranks).
"""

from pathlib import Path
from unittest import mock

import pytest
import torch

from tests.engine import reference
from tests.multinode.harness import run_nodes, skip_unless_namespaces
from tests.multinode.models import MODELS
from tests.multinode.train_worker import GAS, STEPS

WORKER = Path(__file__).with_name("train_worker.py")


pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(autouse=True)
def _namespaces():
    skip_unless_namespaces()


def _oracle(name: str, world_size: int):
    with mock.patch.dict(reference.MODELS, MODELS):
        losses, weights = reference.reference_run(name, steps=STEPS, gas=GAS, world_size=world_size)
    return {",".join(map(str, k)): v for k, v in losses.items()}, weights


@pytest.mark.parametrize(
    "nnodes,nproc,models", [(2, 1, ["gpt"]), (2, 2, ["gpt", "llama"])], ids=["2x1", "2x2"]
)
def test_training_on_each_nodes_nvme_equals_plain_pytorch(nvme_dir, nnodes, nproc, models):
    world = nnodes * nproc
    run = run_nodes(WORKER, nnodes, nproc, workdir=nvme_dir, args=models, timeout=400).check()
    nvme = run.node_paths[0]
    assert len(run.reports) == world * len(models)
    for name in models:
        ref_losses, ref_weights = _oracle(name, world)
        reports = {r["rank"]: r for r in run.reports if r["model"] == name}
        assert sorted(reports) == list(range(world))
        losses = {k: v for r in reports.values() for k, v in r["losses"].items()}
        assert losses.keys() == ref_losses.keys()
        for key, ref in ref_losses.items():
            assert losses[key] == pytest.approx(ref, rel=1e-5), f"{name}: loss at {key}"
        for pname, ref in ref_weights.items():
            got = torch.tensor(reports[0]["weights"][pname]).view_as(ref)
            err = (got - ref).abs().max().item() / ref.abs().max().item()
            assert err < 1e-5, f"{name}: {pname} differs by {err:.2e} relative"
        for rank, r in reports.items():
            mates = sorted(q for q, o in reports.items() if o["node"] == r["node"])
            assert r["local_world_size"] == nproc and len(mates) == nproc
            # Every file this rank had open mid-run is its own, in its node's nvme_path.
            own = nvme / f"rank{rank}"
            assert r["open_files"], "the swap files were open mid-run"
            assert all(Path(f).parent.parent == own for f in r["open_files"]), r["open_files"]
            # The node holds the swap folders of its own ranks, and only those.
            assert r["swap_dirs"] == [f"rank{q}" for q in mates]
            # The node's memory is shared by its ranks: the budget is planned per rank.
            assert r["ranks_per_node"] == nproc
            if nproc > 1:
                assert f"per rank ({nproc} on this node)" in r["budget_source"]
    # After the run, each node's storage held its own ranks' folders (emptied at close).
    for k in range(nnodes):
        on_k = sorted(r["rank"] for r in run.reports if r["node"] == k and r["model"] == models[0])
        held = sorted(p.name for p in run.node_dir(k, nvme).iterdir())
        assert held == [f"rank{q}" for q in on_k]
        assert all(not any(d.iterdir()) for d in run.node_dir(k, nvme).iterdir())
