"""What lands on disk: only JSON and safetensors files (no pickle), shards 4 KiB-aligned so the aio
engine moves them with O_DIRECT, a manifest that describes the run, checksums that match, and a
progress bar with the rate for large saves. Also: stage 0 with a torch optimizer of the user's."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import infinity
from infinity.aio import crc32c
from infinity.engine.checkpoint import export_checkpoint
from infinity.weights.header import read_header
from tests.checkpoint.helpers import MODELS, N_STEPS, config, make_engine, snapshot, train


@pytest.fixture
def saved(nvme_dir):
    engine, _ = make_engine("tied", config(3, "nvme", "nvme", nvme_dir), seed=0)
    train(engine, 0, N_STEPS)
    ckpt = engine.save_checkpoint(nvme_dir / "ckpt", client_state={"note": "x"})
    yield engine, ckpt
    engine.close()


def test_files_manifest_and_checksums(saved):
    engine, ckpt = saved
    assert sorted(p.name for p in ckpt.parent.iterdir()) == [
        ".infinity-save.lock",
        "global_step3",
        "latest",
    ]
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "manifest.json",
        "part-00000-of-00001.safetensors",
        "rank-00000.safetensors",
    ]
    raw = (ckpt / "manifest.json").read_bytes()
    m = json.loads(raw)
    assert (m["format"], m["version"], m["world_size"], m["stage"], m["partitions"]) == (
        "infinity.checkpoint",
        3,
        1,
        3,
        1,
    )
    # The last field is the CRC32C of every byte before it.
    field = raw.rindex(b',\n "manifest_crc32c": ')
    assert list(m)[-1] == "manifest_crc32c" and crc32c(raw[:field]) == m["manifest_crc32c"]
    assert (m["global_steps"], m["micro_steps"], m["train_dtype"]) == (
        N_STEPS,
        2 * N_STEPS,
        "float32",
    )
    assert m["config"]["zero_optimization"]["offload_param"]["device"] == "nvme"
    slots = {s["name"]: s for u in m["units"] for s in u["slots"]}
    assert slots["emb.weight"]["shape"] == [64, 32] and slots["emb.weight"]["aliases"] == [
        "emb.weight",
        "head.weight",
    ]
    assert set(m["buffers"]) == {
        "norm.running_mean",
        "norm.running_var",
        "norm.num_batches_tracked",
    }
    for name, f in m["files"].items():
        data = (ckpt / name).read_bytes()
        assert len(data) == f["nbytes"]
        if "crc32c" in f:
            assert crc32c(data) == f["crc32c"]


def test_shards_are_aligned_safetensors_holding_the_store_contents(saved):
    engine, ckpt = saved
    part = ckpt / "part-00000-of-00001.safetensors"
    header = read_header(str(part))
    assert header.data_start % 4096 == 0
    assert all(e.begin % 4096 == 0 and e.nbytes % 4096 == 0 for e in header.entries.values())
    rank = load_file(str(ckpt / "rank-00000.safetensors"))
    with safe_open(str(ckpt / "rank-00000.safetensors"), "pt") as f:
        state = json.loads(f.metadata()["state"])
    crcs = state["part"]["crc32c"]
    assert (
        crc32c(part.read_bytes()[: header.data_start]) == state["part"]["header_crc32c"]
    )  # the whole header
    shards = snapshot(engine)["shards"]
    with safe_open(str(part), "pt") as f:  # readable by the safetensors package itself
        assert f.metadata()["kind"] == "part"
        assert set(f.keys()) == {f"u{i}.{r}" for i, r in shards}
        for (i, role), t in shards.items():
            saved_t = f.get_tensor(f"u{i}.{role}")
            assert torch.equal(saved_t, t), (i, role)
            assert crc32c(saved_t) == crcs[f"u{i}.{role}"]
    assert torch.equal(rank["buffer.norm.running_mean"], engine.module.norm.running_mean)
    assert state["client_state"] == {"note": "x"}


def test_progress_bar_shows_the_rate(saved, tmp_path, capsys):
    engine, _ = saved
    engine.save_checkpoint(tmp_path / "ckpt", progress=True)
    err = capsys.readouterr().err
    assert "save global_step3" in err and "B/s" in err
    engine.load_checkpoint(tmp_path / "ckpt", progress=True)
    assert "load global_step3" in capsys.readouterr().err


def test_stage0_with_a_torch_optimizer(nvme_dir, tmp_path):
    """Stage 0 without offload steps the user's optimizer (here SGD with momentum) on whole parameters:
    its state_dict is saved too (tensors in the part file, the rest as JSON) and resume equals continue."""

    def run(seed, load):
        torch.manual_seed(seed)
        model = MODELS["tied"]()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        cfg = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 2,
            "zero_optimization": {"stage": 0},
        }
        engine = infinity.initialize(model, cfg, optimizer=opt)
        try:
            if load:
                engine.load_checkpoint(tmp_path / "ckpt")
            else:
                train(engine, 0, N_STEPS)
                engine.save_checkpoint(tmp_path / "ckpt")
            losses = train(engine, N_STEPS, 2)
            return losses, {n: p.detach().clone() for n, p in model.named_parameters()}
        finally:
            engine.close()

    cont, resumed = run(0, False), run(1, True)
    assert cont[0] == resumed[0]
    for n, w in cont[1].items():
        assert torch.equal(w, resumed[1][n]), n
    exported = load_file(str(export_checkpoint(tmp_path / "ckpt", tmp_path / "m.safetensors")))
    assert set(exported) == set(MODELS["tied"]().state_dict())


def test_client_state_round_trip_without_pickle(saved, tmp_path):
    engine, _ = saved
    import math

    state = {
        "epoch": 3,
        "pos": (1, 2.5, "a"),
        "ids": [None, True, -7],
        "by_step": {10: "x", (1, 2): [3]},
        "marker": {"__tensor__": "not a tensor"},
        "inf": math.inf,
        "t": torch.arange(6).view(2, 3),
        "half": torch.ones(3, dtype=torch.bfloat16),
        "np": __import__("numpy").arange(3),
    }
    engine.save_checkpoint(tmp_path / "ckpt", client_state=state)
    back = engine.load_checkpoint(tmp_path / "ckpt")
    assert back["epoch"] == 3 and back["pos"] == (1, 2.5, "a") and back["ids"] == [None, True, -7]
    assert back["by_step"] == {10: "x", (1, 2): [3]} and back["marker"] == {
        "__tensor__": "not a tensor"
    }
    assert back["inf"] == math.inf
    assert torch.equal(back["t"], state["t"]) and torch.equal(back["half"], state["half"])
    assert torch.equal(back["np"], torch.arange(3))


def test_files_are_private_to_their_owner(saved, nvme_dir, monkeypatch):
    """A checkpoint holds weights, moments, RNG and client state: like the swap files, its files are
    0600 and its directories 0700 (the hidden directory it is written in, the manifest, ``latest`` and
    the directories the save creates), whatever the umask."""
    import os
    import stat

    from infinity.engine.checkpoint import atomic

    engine, _ = saved
    modes = {}

    def record(p):
        st = p.stat()
        modes[p] = (stat.S_IMODE(st.st_mode), 0o700 if stat.S_ISDIR(st.st_mode) else 0o600)

    publish = atomic.publish

    def spy(
        tmp, final, nonce
    ):  # the hidden directory, complete, just before it is renamed into place
        for p in [tmp, *tmp.iterdir()]:
            record(p)
        return publish(tmp, final, nonce)

    monkeypatch.setattr(atomic, "publish", spy)
    root = nvme_dir / "new" / "ckpt"
    old = os.umask(0o022)
    try:
        engine.save_checkpoint(root, tag="a")
        engine.save_checkpoint(root, tag="a")  # replacing a checkpoint too
    finally:
        os.umask(old)
    for p in [nvme_dir / "new", root, *root.rglob("*")]:
        record(p)
    assert any(atomic.PARTIAL in p.name for p in modes) and root / "latest" in modes
    assert root / "a" / "manifest.json" in modes
    wrong = {str(p): oct(m) for p, (m, want) in modes.items() if m != want}
    assert not wrong, f"readable or writable by others: {wrong}"
