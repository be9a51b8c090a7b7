"""Every way a checkpoint can be wrong gives a clear exception naming the culprit, and a failed load
leaves the engine exactly as it was (weights, buffers, optimizer shards, step counts, counters,
schedule, loss scale, RNG)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from infinity.engine.checkpoint import (
    CheckpointCorruptError,
    CheckpointIncompleteError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointSpaceError,
)
from infinity.models import GPT, GPTConfig
from infinity.weights.header import read_header
from tests.checkpoint.helpers import (
    N_STEPS,
    assert_same,
    config,
    flip_byte,
    make_engine,
    snapshot,
    train,
)
from tests.engine.models import VOCAB


@pytest.fixture(scope="module")
def setup():
    """An engine one step past its checkpoint, so that any partial load would show."""
    base = Path(os.environ.get("INFINITY_TEST_NVME", Path.home() / ".cache" / "infinity-tests"))
    root = base / f"{os.getpid()}-errors"
    shutil.rmtree(root, ignore_errors=True)
    (root / "swap").mkdir(parents=True)
    engine, _ = make_engine("tied", config(3, "nvme", "nvme", root / "swap"), seed=0)
    train(engine, 0, N_STEPS)
    ckpt = engine.save_checkpoint(root / "ckpt")
    train(engine, N_STEPS, 1)
    yield engine, root, ckpt
    engine.close()
    shutil.rmtree(root, ignore_errors=True)


def copy_of(ckpt: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt" / ckpt.name
    shutil.copytree(ckpt, dst)
    (dst.parent / "latest").write_text(ckpt.name + "\n")
    return dst


def refused(engine, path, exc, match, **kw):
    before = snapshot(engine)
    with pytest.raises(exc, match=match) as info:
        engine.load_checkpoint(path, **kw)
    assert_same(before, snapshot(engine), "state after a failed load")
    return info.value


def test_corrupt_shard_is_named_and_changes_nothing(setup, tmp_path):
    engine, _, ckpt = setup
    bad = copy_of(ckpt, tmp_path)
    part = bad / "part-00000-of-00001.safetensors"
    flip_byte(part, read_header(str(part)).entries["u2.exp_avg_sq"].begin + 123)
    err = refused(engine, bad.parent, CheckpointCorruptError, part.name)
    assert "'u2.exp_avg_sq'" in str(err) and "CRC32C" in str(err)


def test_corrupt_header_of_a_shard_file(setup, tmp_path):
    engine, _, ckpt = setup
    bad = copy_of(ckpt, tmp_path)
    part = bad / "part-00000-of-00001.safetensors"
    flip_byte(part, 20)
    refused(engine, bad.parent, CheckpointCorruptError, part.name)


def test_truncated_shard(setup, tmp_path):
    engine, _, ckpt = setup
    bad = copy_of(ckpt, tmp_path)
    part = bad / "part-00000-of-00001.safetensors"
    os.truncate(part, part.stat().st_size - 4096)
    refused(engine, bad.parent, CheckpointCorruptError, rf"{part.name}.*truncated")


@pytest.mark.parametrize("name", ["part-00000-of-00001.safetensors", "rank-00000.safetensors"])
def test_missing_file(setup, tmp_path, name):
    engine, _, ckpt = setup
    bad = copy_of(ckpt, tmp_path)
    (bad / name).unlink()
    refused(engine, bad.parent, CheckpointNotFoundError, rf"{name}.*missing")


def test_corrupt_rank_file_and_manifest(setup, tmp_path):
    engine, _, ckpt = setup
    bad = copy_of(ckpt, tmp_path)
    flip_byte(bad / "rank-00000.safetensors", 200)
    refused(engine, bad.parent, CheckpointCorruptError, "rank-00000.safetensors.*CRC32C")
    shutil.copy(ckpt / "rank-00000.safetensors", bad / "rank-00000.safetensors")
    (bad / "manifest.json").write_text('{"format": "infinity.checkpoint", "vers')
    refused(engine, bad.parent, CheckpointCorruptError, "manifest.json.*not valid JSON")


def test_checkpoint_of_a_different_model(setup, tmp_path):
    import infinity

    engine, _, _ = setup
    engines = {}
    for name, d_model in (("wide", 64), ("narrow", 32)):
        (tmp_path / name).mkdir()
        model = GPT(
            GPTConfig(
                vocab_size=VOCAB, seq_len=16, n_layer=2, n_head=2, d_model=d_model, bias=False
            )
        )
        engines[name] = infinity.initialize(model, config(3, "nvme", "nvme", tmp_path / name))
        engines[name].save_checkpoint(tmp_path / f"ckpt-{name}")
    try:
        # The same architecture, another width: the first tensor whose shape differs is named.
        refused(
            engines["narrow"],
            tmp_path / "ckpt-wide",
            CheckpointMismatchError,
            r"'wte.weight' has shape \[64, 64\] in the checkpoint but \[64, 32\] in this model",
        )
    finally:
        for e in engines.values():
            e.close()
    # Another architecture altogether: the first parameter it lacks is named.
    refused(
        engine,
        tmp_path / "ckpt-narrow",
        CheckpointMismatchError,
        r"parameter 'emb.weight' \(shape \[64, 32\]\) of this model is not in the checkpoint",
    )


def test_full_disk(setup, tmp_path):
    """A save to a file system without room raises CheckpointSpaceError naming the directory, leaves no
    partial checkpoint, and the previous checkpoint there still loads."""
    engine, _, _ = setup
    disk = tmp_path / "small"
    disk.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(
            f"cannot mount a small tmpfs to fill up here ({r.stderr.strip() or r.returncode}): needs root"
        )
    try:
        before = snapshot(engine)
        first = engine.save_checkpoint(disk / "ckpt", tag="first")
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        with open(disk / "ballast", "wb") as f:  # leave less room than a checkpoint takes
            f.truncate(0)
            os.posix_fallocate(f.fileno(), 0, free - 16 * 1024)
        with pytest.raises(CheckpointSpaceError, match=rf"no space left.*{disk}") as info:
            engine.save_checkpoint(disk / "ckpt", tag="second")
        assert "free space there or save the checkpoint to another directory" in str(info.value)
        assert sorted(p.name for p in (disk / "ckpt").iterdir()) == [
            ".infinity-save.lock",
            "first",
            "latest",
        ]
        assert (disk / "ckpt" / "latest").read_text().strip() == "first"
        assert first.name == "first"
        engine.load_checkpoint(disk / "ckpt")  # "first" is the state the engine was in
        assert_same(
            before,
            snapshot(engine),
            "state after loading the checkpoint saved before the full disk",
        )
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_client_state_that_needs_pickle_is_refused_before_writing(setup, tmp_path):
    engine, _, _ = setup

    class Sampler:
        pass

    with pytest.raises(TypeError, match=r"client_state\['sampler'\] is a .*Sampler.*never pickled"):
        engine.save_checkpoint(tmp_path / "ckpt", client_state={"epoch": 1, "sampler": Sampler()})
    assert not (tmp_path / "ckpt").exists()
    with pytest.raises(TypeError, match=r"a key of client_state is a builtins.object"):
        engine.save_checkpoint(tmp_path / "ckpt", client_state={object(): "x"})


def test_save_in_the_middle_of_an_accumulation_window(setup, tmp_path):
    engine, _, _ = setup
    from tests.engine.models import batch

    x, y = batch(50, 0, 0)
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()  # micro step 1 of 2
    try:
        with pytest.raises(RuntimeError, match="middle of a gradient accumulation window"):
            engine.save_checkpoint(tmp_path / "ckpt")
    finally:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()


def test_which_checkpoint(setup, tmp_path):
    engine, _, ckpt = setup
    root = copy_of(ckpt, tmp_path).parent
    (root / "latest").unlink()
    refused(
        engine,
        root,
        CheckpointNotFoundError,
        rf"no 'latest' file in '{root}'.*{ckpt.name}; pass tag=",
    )
    refused(
        engine,
        root,
        CheckpointNotFoundError,
        "checkpoint 'nope' asked for does not exist",
        tag="nope",
    )
    (root / "half").mkdir()
    refused(engine, root, CheckpointIncompleteError, "has no manifest.json", tag="half")
    refused(engine, tmp_path / "nowhere", CheckpointNotFoundError, "does not exist")


def test_verify_false_still_checks_each_tensor_as_it_lands(setup, tmp_path):
    """Without the verify pass a corrupt tensor is still caught (its checksum is taken as it is read),
    but by then earlier units are loaded: the error says so."""
    engine, _, ckpt = setup
    bad = copy_of(ckpt, tmp_path)
    part = bad / "part-00000-of-00001.safetensors"
    flip_byte(part, read_header(str(part)).entries["u3.master"].begin + 4)
    with pytest.raises(CheckpointCorruptError, match=r"'u3.master'.*partly loaded"):
        engine.load_checkpoint(bad.parent, verify=False)
    engine.load_checkpoint(ckpt)  # a good load repairs it
    assert engine.global_steps == N_STEPS


@pytest.mark.parametrize("content", ["../other/good", "ABSOLUTE", ".good", "good/", "latest"])
def test_latest_naming_something_else_than_a_tag_is_refused(setup, tmp_path, content):
    """``latest`` is followed like a tag given by hand: a path out of the checkpoint root (relative or
    absolute), a hidden or nested name is refused, naming the file and what it holds, although a good
    checkpoint is where it points."""
    engine, _, ckpt = setup
    train(
        engine, engine.global_steps, 1
    )  # away from the checkpoint, so that a load of it would show
    good = tmp_path / "other" / "good"
    shutil.copytree(ckpt, good)
    root = tmp_path / "root"
    root.mkdir()
    shutil.copytree(good, root / ".good")
    shutil.copytree(good, root / "good")
    text = str(good) if content == "ABSOLUTE" else content
    (root / "latest").write_text(text + "\n")
    err = refused(engine, root, CheckpointCorruptError, "latest")
    assert f"'{root / 'latest'}'" in str(err) and repr(text) in str(err), str(err)
    from infinity.engine.checkpoint import export_checkpoint

    with pytest.raises(CheckpointCorruptError, match=re.escape(repr(text))):
        export_checkpoint(root, tmp_path / "m.safetensors")


def flip_bit_at(path, needle: bytes, *, after: int = 0) -> None:
    """Flips the lowest bit of the byte ``after`` bytes past the end of ``needle`` (first match)."""
    data = bytearray(Path(path).read_bytes())
    at = data.index(needle) + len(needle) + after
    data[at] ^= 1
    Path(path).write_bytes(bytes(data))


def flip_last_digit_of(path, key: bytes) -> None:
    """Flips the lowest bit of the last digit of the number after ``key``: another digit, so the JSON
    stays valid whatever the number is (its first digit would turn 10 into 00, which is not JSON,
    and the number depends on which tests trained the module's engine before)."""
    data = Path(path).read_bytes()
    start = data.index(key) + len(key)
    digits = len(data[start:]) - len(data[start:].lstrip(b"0123456789"))
    assert digits > 0, f"no number after {key!r} in {path}"
    flip_bit_at(path, key, after=digits - 1)


def _client_state_and_its_checksum(bad: Path) -> None:
    """The client state changed in the rank file, and the manifest's CRC32C of that file updated to match."""
    import json

    from infinity.aio import crc32c

    rank = bad / "rank-00000.safetensors"
    flip_bit_at(
        rank, b'client_state\\": {\\"epoch\\": '
    )  # 3 -> 2, inside the JSON string in __metadata__
    m = json.loads((bad / "manifest.json").read_bytes())
    m["files"][rank.name]["crc32c"] = crc32c(rank.read_bytes())
    (bad / "manifest.json").write_text(json.dumps(m, indent=1))


# what is changed: (the file to be named, how)
TAMPERED = {
    "manifest-global_steps": (
        "manifest.json",
        lambda bad: flip_last_digit_of(bad / "manifest.json", b'"global_steps": '),
    ),
    "manifest-skipped_steps": (
        "manifest.json",
        lambda bad: flip_last_digit_of(bad / "manifest.json", b'"skipped_steps": '),
    ),
    "manifest-micro_steps": (
        "manifest.json",
        lambda bad: flip_last_digit_of(bad / "manifest.json", b'"micro_steps": '),
    ),
    "part-header-metadata": (
        "part-00000-of-00001.safetensors",
        lambda bad: flip_bit_at(bad / "part-00000-of-00001.safetensors", b'"partition":"'),
    ),
    "client-state": ("manifest.json", _client_state_and_its_checksum),
}


@pytest.mark.parametrize("what", list(TAMPERED))
def test_a_tampered_small_file_is_named_and_changes_nothing(setup, tmp_path, what):
    """Everything a load trusts is checksummed: the manifest (counters, layout, the other files' sizes and
    checksums), each part file's header, each rank file whole (RNG, client state). One flipped bit, or a
    change with its checksum updated beside it, raises before anything changes, naming the file."""
    engine, _, _ = setup
    ckpt = engine.save_checkpoint(tmp_path / "saved", client_state={"epoch": 3})
    train(
        engine, engine.global_steps, 1
    )  # away from the checkpoint, so that a load of it would show
    bad = copy_of(ckpt, tmp_path)
    name, tamper = TAMPERED[what]
    tamper(bad)
    err = refused(engine, bad.parent, CheckpointCorruptError, re.escape(str(bad / name)))
    assert "CRC32C" in str(err) or "checksum" in str(err), str(err)


def test_a_version_1_checkpoint_loads_with_a_warning(setup, tmp_path, caplog):
    """Format version 1 had no manifest or part-header checksums: still read, saying that they are trusted."""
    import json
    import logging

    engine, _, _ = setup
    ckpt = engine.save_checkpoint(tmp_path / "saved")
    steps = engine.global_steps
    train(engine, steps, 1)
    old = copy_of(ckpt, tmp_path)
    m = json.loads((old / "manifest.json").read_bytes())
    del m["manifest_crc32c"]
    m["version"] = 1
    (old / "manifest.json").write_text(json.dumps(m, indent=1))
    with caplog.at_level(logging.WARNING, logger="infinity.checkpoint"):
        engine.load_checkpoint(old.parent)
    assert engine.global_steps == steps
    assert any(
        "format version 1" in r.getMessage() and "trusted" in r.getMessage() for r in caplog.records
    )


def test_save_into_a_file_says_so(setup, tmp_path):
    """A save_dir (or a directory on its way) that is a file, or a tag that names a file, is refused naming
    it, and the file is left alone; a load from a file says the same."""
    engine, _, _ = setup
    f = tmp_path / "ckpt"
    f.write_text("not a directory")
    with pytest.raises(NotADirectoryError, match=re.escape(f"'{f}' is a file, not a directory;")):
        engine.save_checkpoint(f)
    with pytest.raises(
        NotADirectoryError,
        match=re.escape(
            f"'{f}' is a file, not a directory, so the checkpoint directory '{f / 'sub'}' cannot be created"
        ),
    ):
        engine.save_checkpoint(f / "sub")
    root = tmp_path / "root"
    root.mkdir()
    (root / "t").write_text("a file")
    with pytest.raises(
        NotADirectoryError,
        match=re.escape(f"'{root / 't'}' is a file, not a directory, so checkpoint 't'"),
    ):
        engine.save_checkpoint(root, tag="t")
    assert f.read_text() == "not a directory" and (root / "t").read_text() == "a file"
    assert not [p for p in root.iterdir() if ".partial-" in p.name]
    refused(engine, f, CheckpointNotFoundError, re.escape(f"'{f}' is a file, not a directory"))
