"""Node-local checkpoints (gloo, one host): each simulated node keeps its own checkpoint directory.

A "node" is what torchrun's GROUP_RANK says; each node's ranks save into and load from that node's
own directory only (``node<k>/ckpt``), as on machines with no shared file system. Four ranks as two
nodes of two train and save node-local; the same state is saved to one shared directory too (the
checkpoint every other test covers). Then:
- 2 x 2 -> 2 x 2, in the same processes: a fresh engine loads the node-local checkpoint and trains on
  with the losses and weights of the uninterrupted run, bit for bit.
- 2 x 2 -> 3 x 1 (the third node has nothing and fetches what it needs from the others) and
  2 x 2 -> 1 x 3 (one node holding both nodes' files): every rank trains on with the losses and
  weights of the same three ranks loading the shared-directory copy, bit for bit; the loaded weights
  are the saved ones.
- A later save published on one node only (its `latest` moved there) is passed over for the newest
  checkpoint complete on every node.
- Export under the process group (as `infinity export` under torchrun): rank 0 gathers the weights
  from the node-local checkpoint, equal to the export of the shared copy.
- Bad input, refused with an error naming the node, rank and file, with every engine unchanged: a
  part no rank holds; two nodes holding copies of two different saves under one tag.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from infinity.engine.checkpoint import (
    CheckpointIncompleteError,
    CheckpointMismatchError,
    export_checkpoint,
)
from tests.checkpoint.helpers import (
    assert_same,
    config,
    make_engine,
    snapshot,
    train,
    weights,
)
from tests.distributed import run_distributed

pytestmark = pytest.mark.distributed

TAG = "step1"
N_STEPS, M_STEPS = 1, 2  # one accumulation step each: processes on a 2-core machine are dear


def _engine(base: Path, rank: int, seed: int):
    swap = base / f"swap-rank{rank}"
    swap.mkdir(parents=True, exist_ok=True)
    engine, _ = make_engine("gpt", config(3, "nvme", "nvme", swap, gas=1), seed=seed)
    return engine


def _node_dir(base: Path, node: int) -> Path:
    return base / f"node{node}" / "ckpt"


def _save_2x2(rank: int, base: str):
    base = Path(base)
    node = rank // 2
    os.environ["GROUP_RANK"] = str(node)
    engine = _engine(base, rank, seed=0)
    try:
        train(engine, 0, N_STEPS, rank=rank, gas=1)
        engine.save_checkpoint(_node_dir(base, node), tag=TAG, node_local=True)
        engine.save_checkpoint(base / "shared", tag=TAG)
        at_save = weights(engine)
        cont = train(engine, N_STEPS, M_STEPS, rank=rank, gas=1)
        cont_weights = weights(engine)
        # Another save under the same tag, for the test of mixed saves.
        engine.save_checkpoint(base / "other" / f"node{node}", tag=TAG, node_local=True)
    finally:
        engine.close()
    engine = _engine(base, rank, seed=1)
    try:
        engine.load_checkpoint(_node_dir(base, node))
        same = train(engine, N_STEPS, M_STEPS, rank=rank, gas=1)
        assert same == cont
        assert_same(weights(engine), cont_weights, f"rank {rank} after 2 x 2 -> 2 x 2")
    finally:
        engine.close()
    return {"at_save": at_save, "losses": cont}


def _resume_3(rank: int, base: str):
    base = Path(base)
    out = {}

    def run(layout: str, root: Path):
        engine = _engine(base, rank, seed=1)
        try:
            engine.load_checkpoint(root)
            assert engine.global_steps == N_STEPS
            w = weights(engine)
            losses = train(engine, N_STEPS, M_STEPS, rank=rank, gas=1)
            return {"weights": w, "losses": losses, "after": weights(engine)}
        finally:
            engine.close()

    os.environ["GROUP_RANK"] = str(rank)  # 3 x 1: node 2 is a new machine with nothing on it
    # `infinity export` under torchrun: rank 0 gathers the weights onto its node.
    export_checkpoint(
        _node_dir(base, rank), base / "export-3x1.safetensors", progress=False, gather_nodes=True
    )
    out["3x1"] = run("3x1", _node_dir(base, rank))
    # A later save that node 0 published (and moved its `latest` to) but node 1 did not: the
    # newest checkpoint complete on every node is loaded, on every rank.
    engine = _engine(base, rank, seed=1)
    try:
        engine.load_checkpoint(base / "half" / f"node{rank}")
        assert engine.global_steps == N_STEPS
    finally:
        engine.close()
    assert not any(p.name.startswith(".") for p in _node_dir(base, 2).iterdir()), (
        "the copies fetched from other nodes are removed after the load"
    )
    os.environ["GROUP_RANK"] = "0"  # 1 x 3: one machine holding both nodes' files
    out["1x3"] = run("1x3", base / "merged" / TAG)
    out["shared"] = run("shared", base / "shared")

    # Bad input: refused on every rank before anything changes.
    os.environ["GROUP_RANK"] = str(rank)
    engine = _engine(base, rank, seed=2)
    try:
        before = snapshot(engine)
        with pytest.raises(CheckpointIncompleteError) as e:
            engine.load_checkpoint(base / "lost" / f"node{rank}", tag=TAG)
        msg = str(e.value)
        assert "'part-00003-of-00004.safetensors' (saved by rank 3 on node 1)" in msg, msg
        assert "'rank-00002.safetensors' (saved by rank 2 on node 1)" in msg, msg
        with pytest.raises(CheckpointMismatchError, match="two different saves") as e:
            engine.load_checkpoint(base / "mixed" / f"node{rank}", tag=TAG)
        assert "node 1 (rank 1)" in str(e.value) and "node 0 (rank 0)" in str(e.value)
        assert_same(before, snapshot(engine), f"rank {rank} after refused loads")
    finally:
        engine.close()
    return out


@pytest.fixture(scope="module")
def base():
    root = Path(os.environ.get("INFINITY_TEST_NVME", Path.home() / ".cache" / "infinity-tests"))
    path = root / f"{os.getpid()}-node-local"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _files(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()}


@pytest.mark.timeout(1200)  # seven processes (4 ranks, then 3), each building engines: not seconds
def test_node_local_save_loads_on_any_topology(base):
    saved = run_distributed(_save_2x2, str(base), world_size=4)
    n0, n1 = _node_dir(base, 0) / TAG, _node_dir(base, 1) / TAG
    # Each node holds its own ranks' files, the manifest and its node manifest; `latest` on both.
    assert _files(n0) == {
        "manifest.json",
        "node-00000.json",
        "part-00000-of-00004.safetensors",
        "part-00001-of-00004.safetensors",
        "rank-00000.safetensors",
        "rank-00001.safetensors",
    }
    assert _files(n1) == {
        "manifest.json",
        "node-00001.json",
        "part-00002-of-00004.safetensors",
        "part-00003-of-00004.safetensors",
        "rank-00002.safetensors",
        "rank-00003.safetensors",
    }
    for node in (0, 1):
        assert (_node_dir(base, node) / "latest").read_text() == f"{TAG}\n"
    assert (n0 / "manifest.json").read_bytes() == (n1 / "manifest.json").read_bytes()
    # 1 x 3: both nodes' files on one machine.
    merged = base / "merged" / TAG
    shutil.copytree(n0, merged)
    for p in n1.iterdir():
        if not (merged / p.name).exists():
            shutil.copy2(p, merged / p.name)
    _node_dir(base, 2).mkdir(parents=True)
    # A part no peer holds: node 1's files are lost, and nodes 1 and 2 are new machines.
    shutil.copytree(n0, base / "lost" / "node0" / TAG)
    # Node 0 from one save, node 1 from a later save under the same tag.
    shutil.copytree(n0, base / "mixed" / "node0" / TAG)
    shutil.copytree(base / "other" / "node1" / TAG, base / "mixed" / "node1" / TAG)
    # Half-published: node 0 has a later save as `latest`, node 1 only its hidden directory.
    half = base / "half"
    for node, n in ((0, n0), (1, n1)):
        shutil.copytree(n, half / f"node{node}" / TAG)
        (half / f"node{node}" / "latest").write_text(f"{TAG}\n")
    shutil.copytree(base / "other" / "node0" / TAG, half / "node0" / "step3")
    (half / "node0" / "latest").write_text("step3\n")
    shutil.copytree(base / "other" / "node1" / TAG, half / "node1" / ".step3.partial-0123")
    resumed = run_distributed(_resume_3, str(base), world_size=3)
    # The export gathered on rank 0 is the single-process export of the shared copy.
    export_checkpoint(base / "shared", base / "export-shared.safetensors", progress=False)
    gathered = load_file(str(base / "export-3x1.safetensors"))
    single = load_file(str(base / "export-shared.safetensors"))
    assert gathered.keys() == single.keys()
    for name, t in single.items():
        assert torch.equal(gathered[name], t), name
    at_save = saved[0]["at_save"]
    for rank, runs in enumerate(resumed):
        for layout in ("3x1", "1x3", "shared"):
            for name, w in runs[layout]["weights"].items():
                assert torch.equal(torch.as_tensor(w), torch.as_tensor(at_save[name])), (
                    rank,
                    layout,
                    name,
                )
        for layout in ("3x1", "1x3"):
            assert runs[layout]["losses"] == runs["shared"]["losses"], (rank, layout)
            for name, w in runs[layout]["after"].items():
                assert torch.equal(
                    torch.as_tensor(w), torch.as_tensor(runs["shared"]["after"][name])
                )
