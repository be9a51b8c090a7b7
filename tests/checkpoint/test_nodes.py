"""Node-local checkpoints in one process: the node manifests, which checkpoint counts as complete over
the nodes (a property test against a plain model of holdings), and a node-local save at world size 1.
The multi-process behaviour is test_node_local.py's (gloo) and test_node_kills.py's (torchrun)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infinity.engine.checkpoint import (
    CheckpointCorruptError,
    CheckpointIncompleteError,
    CheckpointMismatchError,
)
from infinity.engine.checkpoint.nodes import (
    Topology,
    _verdict,
    node_index,
    node_manifest_bytes,
    read_node_manifest,
)
from tests.checkpoint.helpers import assert_same, config, flip_byte, make_engine, snapshot, train

FILES = ["part-00000-of-00002.safetensors", "part-00001-of-00002.safetensors"]


def test_node_manifest_round_trip_and_corruption(tmp_path):
    files = {FILES[0]: {"nbytes": 4096}, "rank-00000.safetensors": {"nbytes": 10, "crc32c": 7}}
    p = tmp_path / "node-00001.json"
    p.write_bytes(node_manifest_bytes(save_id="ab", tag="t", node=1, ranks=[2, 3], files=files))
    doc = read_node_manifest(p)
    assert (doc["save_id"], doc["node"], doc["ranks"], doc["files"]) == ("ab", 1, [2, 3], files)
    flip_byte(p, p.read_bytes().index(b'"ab"') + 1)
    with pytest.raises(CheckpointCorruptError, match="node-00001.json"):
        read_node_manifest(p)


def test_node_index_is_torchruns_group_rank(monkeypatch):
    monkeypatch.delenv("GROUP_RANK", raising=False)
    assert node_index() == 0
    monkeypatch.setenv("GROUP_RANK", "3")
    assert node_index() == 3
    monkeypatch.setenv("GROUP_RANK", "x")
    with pytest.raises(ValueError, match="GROUP_RANK='x'"):
        node_index()


def _info(save_id: str, held: list[str]) -> dict:
    return {
        "save_id": save_id,
        "steps": 1,
        "created": 0.0,
        "files": {f: 4096 for f in FILES},
        "saved_nodes": {"0": [0], "1": [1]},
        "held": ["manifest.json", *held],
        "problems": [],
    }


rank_views = st.lists(
    st.one_of(
        st.none(),
        st.tuples(st.sampled_from(["a", "b"]), st.lists(st.sampled_from(FILES), unique=True)),
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=200, deadline=None)
@given(rank_views)
def test_a_checkpoint_counts_only_when_complete_over_the_nodes_and_of_one_save(views):
    """Oracle: per file, the set of ranks whose view lists it; complete iff some rank has the
    directory, every file has a holder, and every copy is of one save."""
    infos = [None if v is None else _info(v[0], v[1]) for v in views]
    topo = Topology(tuple(range(len(views))))
    problem, holders = _verdict("t", infos, topo, Path("/ckpt"))
    present = [v for v in views if v is not None]
    if not present:
        assert problem is not None and "on no node" in str(problem)
        return
    if len({v[0] for v in present}) > 1:
        assert isinstance(problem, CheckpointMismatchError) and "two different saves" in str(
            problem
        )
        return
    want = {f: [r for r, v in enumerate(views) if v is not None and f in v[1]] for f in FILES}
    if any(not rs for rs in want.values()):
        assert isinstance(problem, CheckpointIncompleteError)
        for f, rs in want.items():
            assert (f"'{f}'" in str(problem)) == (not rs)
        assert "saved by rank" in str(problem)
        return
    assert problem is None
    assert {f: holders[f] for f in FILES} == want


def test_node_local_save_at_world_size_1(nvme_dir, tmp_path):
    engine, _ = make_engine("gpt", config(3, "nvme", "nvme", nvme_dir, gas=1), seed=0)
    try:
        train(engine, 0, 1, gas=1)
        d = engine.save_checkpoint(tmp_path / "ckpt", tag="t", node_local=True)
        node = read_node_manifest(d / "node-00000.json")
        manifest = json.loads((d / "manifest.json").read_text())
        assert node["save_id"] == manifest["save_id"] and manifest["nodes"] == {"0": [0]}
        assert set(node["files"]) == set(manifest["files"])
        before = snapshot(engine)
        engine.load_checkpoint(tmp_path / "ckpt")
        assert_same(before, snapshot(engine), "after loading what was just saved")
        # A node manifest of another save in the directory: refused, naming it, nothing changed.
        other = engine.save_checkpoint(tmp_path / "other", tag="t", node_local=True)
        (d / "node-00000.json").write_bytes((other / "node-00000.json").read_bytes())
        with pytest.raises(CheckpointMismatchError, match="node-00000.json.*two different saves"):
            engine.load_checkpoint(tmp_path / "ckpt")
        assert_same(before, snapshot(engine), "after a refused load")
    finally:
        engine.close()
