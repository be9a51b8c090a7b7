"""nvme_path: one place resolves and checks the swap folder and joins rank<N>; every caller uses it.

The callers (the engine, zero.Init, a TieredStore, the estimator) each get the
same answer for the same path: ``~`` expanded, a regular file refused as a
file, a file system refusing O_DIRECT named once with its type, one reporting
no size named as such.
"""

import contextlib
import errno
import logging
import os

import pytest
import torch
from aio_util import mounted

import infinity
from infinity.config import ConfigError
from infinity.estimate.machine import disk_info
from infinity.memory import BufferPool
from infinity.store import SwapSpaceError, TieredStore, nvme_path
from infinity.store.errors import NvmePathError
from tests.engine.models import tiny_gpt
from tests.engine.reference import engine_config


@pytest.fixture(autouse=True)
def fresh_reports():
    nvme_path._forget_reports()
    yield
    nvme_path._forget_reports()


@pytest.fixture
def home(nvme_dir, monkeypatch):
    """HOME pointed at a disk folder holding an empty 'swap' folder: '~/swap' names it."""
    monkeypatch.setenv("HOME", str(nvme_dir))
    (nvme_dir / "swap").mkdir()
    return nvme_dir


def test_rank_dir_expands_tilde_and_joins_rank(home):
    d = nvme_path.rank_dir("~/swap", 3)
    assert d == home / "swap" / "rank3" and d.is_dir()
    assert list(d.iterdir()) == []  # the O_DIRECT probe leaves nothing behind


def test_every_caller_expands_tilde(home):
    # the engine: each rank's swap files under ~/swap/rank0
    with infinity.initialize(
        tiny_gpt(), engine_config(3, "nvme", "nvme", "~/swap", gas=1)
    ) as engine:
        dirs = engine.runtime.param_store.directories + engine.runtime.state_store.directories
        assert dirs and all(d.parent == home / "swap" / "rank0" for d in dirs)
    # zero.Init's store
    init = infinity.zero.Init(engine_config(3, "nvme", "cpu", "~/swap", gas=1))
    with init:
        torch.nn.Linear(64, 64)
        assert init.store.store.directories[0].parent == home / "swap" / "rank0"
    # a store given the path directly
    with TieredStore("~/swap", pool=BufferPool(1, 1 << 20)) as store:
        assert store.directories[0].parent == home / "swap"
    # the estimator's view of the disk
    assert disk_info("~/swap").existing == str(home / "swap")


def test_a_regular_file_is_named_as_a_file(nvme_dir):
    f = nvme_dir / "swapfile"
    f.write_text("x")
    with pytest.raises(NvmePathError, match=f"^nvme_path '{f}' is a file, not a directory; point"):
        nvme_path.rank_dir(f, 0)
    with pytest.raises(SwapSpaceError, match=f"^nvme_path '{f}' is a file, not a directory"):
        TieredStore(f, pool=BufferPool(1, 1 << 20))
    with pytest.raises(ConfigError, match=f"^nvme_path '{f}' is a file, not a directory"):
        infinity.initialize(tiny_gpt(), engine_config(3, "nvme", "cpu", f, gas=1))
    assert f.read_text() == "x"


def test_a_missing_path_is_refused_by_zero_init_too(nvme_dir):
    # zero.Init used to create the whole missing path with os.makedirs
    missing = nvme_dir / "no" / "such"
    with pytest.raises(ConfigError, match=f"^nvme_path '{missing}' does not exist; create it"):
        with infinity.zero.Init(engine_config(3, "nvme", "cpu", missing, gas=1)):
            torch.nn.Linear(4, 4)
    assert not (nvme_dir / "no").exists()


def test_tilde_that_expands_to_a_missing_path_names_both(home):
    with pytest.raises(
        NvmePathError, match=rf"^nvme_path '~/nope' \({home / 'nope'}\) does not exist"
    ):
        nvme_path.rank_dir("~/nope", 0)


def test_o_direct_refusal_is_reported_once_with_path_and_file_system(nvme_dir, caplog):
    with mounted("ramfs", nvme_dir) as mnt, caplog.at_level(logging.WARNING, "infinity.store"):
        d = nvme_path.rank_dir(mnt, 0)  # keeps working: the aio engine falls back to buffered I/O
        assert d == mnt / "rank0" and list(d.iterdir()) == []
        nvme_path.rank_dir(mnt, 1)  # same file system: already said
        nvme_path._forget_reports()
        nvme_path.rank_dir(mnt, 2, o_direct=False)  # aio.o_direct false asks for buffered I/O
    assert [r.getMessage() for r in caplog.records] == [
        f"nvme_path '{mnt}' is on a ramfs file system (mounted at {mnt}), which is host memory, not "
        "NVMe: swap files there take RAM, so offloading to it saves none (and ramfs refuses O_DIRECT). "
        "Point nvme_path at a directory on a local NVMe drive (ext4, xfs)",
        # buffered I/O asked for: no word on O_DIRECT, but memory is still memory
        f"nvme_path '{mnt}' is on a ramfs file system (mounted at {mnt}), which is host memory, not "
        "NVMe: swap files there take RAM, so offloading to it saves none. Point nvme_path at a "
        "directory on a local NVMe drive (ext4, xfs)",
    ]


def test_a_disk_file_system_refusing_o_direct_is_reported_as_buffered(
    nvme_dir, caplog, monkeypatch
):
    monkeypatch.setattr(nvme_path, "probe_o_direct", lambda d: False)
    with caplog.at_level(logging.WARNING, "infinity.store"):
        nvme_path.rank_dir(nvme_dir, 0)
    m = nvme_path.mount_of(nvme_dir)
    assert [r.getMessage() for r in caplog.records] == [
        f"nvme_path '{nvme_dir}' is on a {m.fs_type} file system (mounted at {m.mountpoint}), which "
        "refuses O_DIRECT: swap files there are read and written through the page cache (slower, and "
        "the cache takes host memory). Point nvme_path at a local disk (ext4, xfs) for direct I/O, or "
        "set aio.o_direct to false if buffered I/O is meant"
    ]


def test_tmpfs_is_named_as_memory_not_nvme(nvme_dir, caplog):
    # it was accepted and logged as NVMe while `infinity doctor` called it memory
    with (
        mounted("tmpfs", nvme_dir, size="64M") as mnt,
        caplog.at_level(logging.INFO, "infinity.store"),
    ):
        with infinity.initialize(tiny_gpt(), engine_config(3, "nvme", "nvme", mnt, gas=1)):
            pass
        infinity.zero.Init(engine_config(3, "nvme", "cpu", mnt, gas=1))
    said = [r for r in caplog.records if str(mnt) in r.getMessage() and "tmpfs" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING]  # once per file system
    assert (
        said[0]
        .getMessage()
        .startswith(
            f"nvme_path '{mnt}' is on a tmpfs file system (mounted at {mnt}), which is host memory, not "
            "NVMe: swap files there take RAM, so offloading to it saves none"
        )
    )


def test_a_disk_path_is_logged_with_its_file_system_type(nvme_dir, caplog):
    m = nvme_path.mount_of(nvme_dir)
    with caplog.at_level(logging.INFO, "infinity.store"):
        nvme_path.rank_dir(nvme_dir, 0)
        nvme_path.rank_dir(nvme_dir, 1)
    assert [r.getMessage() for r in caplog.records] == [
        f"nvme_path '{nvme_dir}': a {m.fs_type} file system on {m.device} (mounted at {m.mountpoint}), "
        "with O_DIRECT"
    ]


def test_a_read_only_mount_is_named_with_the_remount_fix(nvme_dir):
    # it got "not writable by this process ...; change its owner or mode", which cannot help
    with mounted("tmpfs", nvme_dir, options="ro") as mnt:
        with pytest.raises(NvmePathError) as e:
            nvme_path.rank_dir(mnt, 0)
        assert e.value.errno == errno.EROFS
        assert str(e.value) == (
            f"nvme_path '{mnt}' is on a read-only mount (tmpfs at {mnt}); remount it read-write "
            f"(mount -o remount,rw {mnt}) or point nvme_path at a directory on a writable drive"
        )
        with pytest.raises(ConfigError, match="is on a read-only mount"):
            infinity.initialize(tiny_gpt(), engine_config(3, "nvme", "cpu", mnt, gas=1))


def test_a_refused_nvme_path_leaves_nothing_behind(nvme_dir):
    # a refusal left an empty rank0/ in the user's folder
    with mounted("ramfs", nvme_dir) as mnt:
        with pytest.raises(ConfigError, match="reports no size"):
            infinity.initialize(tiny_gpt(), engine_config(3, "nvme", "nvme", mnt, gas=1))
        assert os.listdir(mnt) == []
    full = nvme_dir / "full"
    full.mkdir()
    cfg = engine_config(3, "nvme", "nvme", full, gas=1)
    with pytest.raises(ConfigError, match="not enough free space"):
        with _free_nbytes_reported(0):
            infinity.initialize(tiny_gpt(), cfg)
    assert os.listdir(full) == []
    # an existing rank folder is the user's: left as it was
    (full / "rank0").mkdir()
    with pytest.raises(ConfigError, match="not enough free space"):
        with _free_nbytes_reported(0):
            infinity.initialize(tiny_gpt(), cfg)
    assert os.listdir(full) == ["rank0"] and os.listdir(full / "rank0") == []


@contextlib.contextmanager
def _free_nbytes_reported(n):
    saved = nvme_path.free_nbytes
    nvme_path.free_nbytes = lambda path: n
    try:
        yield
    finally:
        nvme_path.free_nbytes = saved


def test_a_file_system_reporting_no_size_is_named_not_called_full(nvme_dir):
    # ramfs reports 0 blocks: "0 bytes are free" was the message, as if the disk were full
    with mounted("ramfs", nvme_dir) as mnt:
        with pytest.raises(ConfigError) as e:
            infinity.initialize(tiny_gpt(), engine_config(3, "nvme", "nvme", mnt, gas=1))
        msg = str(e.value)
        assert msg.startswith(
            f"nvme_path '{mnt}' is on a ramfs file system (mounted at {mnt}) that reports "
            "no size, so whether this rank's "
        )
        assert (
            "bytes of swap files (parameters" in msg
            and "on ramfs they would fill host memory" in msg
        )
        assert os.listdir(mnt) == []  # nothing was written, no folder made


def test_full_file_system_is_named_with_its_type(nvme_dir):
    free = nvme_path.free_nbytes(nvme_dir)
    m = nvme_path.mount_of(nvme_dir)
    with pytest.raises(NvmePathError) as e:
        nvme_path.check_space(
            [(nvme_dir, free + (1 << 40), "parameters"), (nvme_dir, 5, "optimizer state")]
        )
    assert str(e.value).startswith(
        f"not enough free space at nvme_path '{nvme_dir}' ({m.fs_type} at {m.mountpoint}): this rank "
        f"needs {free + (1 << 40) + 5} bytes of swap files (parameters {free + (1 << 40)} + optimizer "
        "state 5)"
    )
    nvme_path.check_space([(nvme_dir, 1 << 20, "parameters"), (nvme_dir, 0, "optimizer state")])


def test_mount_of_finds_the_innermost_mount(nvme_dir):
    with mounted("tmpfs", nvme_dir) as mnt:
        (mnt / "a").mkdir()
        m = nvme_path.mount_of(mnt / "a" / "not-yet")
        assert (m.mountpoint, m.fs_type) == (str(mnt), "tmpfs")
    assert nvme_path.mount_of(nvme_dir).fs_type not in ("tmpfs", "?")


# -- several paths (one per drive): each checked as one path is ---------------------------------


def test_each_of_several_paths_is_checked_as_one_path_is(nvme_dir):
    a, missing, f = nvme_dir / "a", nvme_dir / "missing", nvme_dir / "swapfile"
    a.mkdir()
    f.write_text("x")
    for bad, what in ((missing, "does not exist; create it"), (f, "is a file, not a directory")):
        with pytest.raises(NvmePathError, match=f"^nvme_path '{bad}' {what}"):
            nvme_path.rank_dirs([a, bad], 0)
        with pytest.raises(ConfigError, match=f"^nvme_path '{bad}' {what}"):
            infinity.initialize(
                tiny_gpt(), _striped(engine_config(3, "nvme", "nvme", a, gas=1), [a, bad])
            )
    assert list(a.iterdir()) == [], "nothing is made on the good path before every path is checked"


def test_the_same_folder_twice_is_refused_before_anything_is_made(home):
    swap = home / "swap"
    (home / "link").symlink_to(swap)
    with pytest.raises(
        NvmePathError,
        match=(
            rf"^nvme_path lists the same directory twice: '{swap}' and '{home / 'link'}' are both {swap}; "
            "list each drive's directory once$"
        ),
    ):
        nvme_path.rank_dirs([swap, home / "link"], 0)
    # as written in a config, the key is named ("~" and a trailing slash are the same folder)
    raw = _striped(engine_config(3, "nvme", "nvme", swap, gas=1), ["~/swap", f"{swap}/"])
    with pytest.raises(
        ConfigError,
        match=(
            rf"^zero_optimization.offload_param.nvme_path lists the same folder twice: '~/swap' and '{swap}/' "
            rf"are both {swap}; list each drive's folder once"
        ),
    ):
        infinity.initialize(tiny_gpt(), raw)
    with pytest.raises(
        ConfigError, match=r"^zero_optimization.offload_param.nvme_path lists '/x' twice"
    ):
        infinity.config.load_config(
            _striped(engine_config(3, "nvme", "nvme", swap, gas=1), ["/x", "/x"])
        )
    assert list(swap.iterdir()) == []


def test_a_list_expands_tilde_in_every_path(home):
    (home / "swap2").mkdir()
    assert nvme_path.rank_dirs(["~/swap", "~/swap2"], 3) == [
        home / "swap" / "rank3",
        home / "swap2" / "rank3",
    ]
    with pytest.raises(
        NvmePathError, match=rf"^nvme_path '~/nope' \({home / 'nope'}\) does not exist"
    ):
        nvme_path.rank_dirs(["~/swap", "~/nope"], 0)


def test_two_paths_on_one_file_system_are_allowed_and_reported_once(nvme_dir, caplog):
    a, b = nvme_dir / "a", nvme_dir / "b"
    a.mkdir()
    b.mkdir()
    m = nvme_path.mount_of(nvme_dir)
    with caplog.at_level(logging.WARNING, "infinity.store"):
        assert nvme_path.rank_dirs([a, b], 0) == [a / "rank0", b / "rank0"]
        nvme_path.rank_dirs([a, b], 1)
        with TieredStore([a, b], pool=BufferPool(1, 1 << 20)) as store:  # a store given the list
            assert [d.parent for d in store.directories] == [a, b]
    assert [r.getMessage() for r in caplog.records] == [
        f"nvme_path lists '{a}' and '{b}' on one file system ({m.fs_type} at {m.mountpoint}): swap space is "
        "striped over them, but they share one drive's bandwidth, so this is no faster than one of them; "
        "list one directory per drive"
    ]


def test_zero_init_stripes_over_every_path_too(nvme_dir):
    a, b = nvme_dir / "a", nvme_dir / "b"
    a.mkdir()
    b.mkdir()
    raw = _striped(engine_config(3, "nvme", "nvme", a, gas=1), [a, b])
    raw["aio"]["block_size"] = 64 << 10  # the stripe unit: the layer's 256 KiB span both drives
    init = infinity.zero.Init(raw)
    with init:
        layer = torch.nn.Linear(128, 512)
    dirs = init.store.store.directories  # the parameters wait there for initialize
    assert [d.parent for d in dirs] == [a / "rank0", b / "rank0"]
    assert all(any(f.read_bytes().strip(b"\0") for f in d.glob("swap.*")) for d in dirs), (
        "data on each"
    )
    with infinity.initialize(layer, raw) as engine:
        assert [d.parent for d in engine.runtime.param_store.directories] == [
            a / "rank0",
            b / "rank0",
        ]


def test_a_striped_run_is_refused_when_one_drive_cannot_take_its_share(nvme_dir):
    """Each drive must hold its share: a roomy first drive does not make up for a full second one."""
    (nvme_dir / "a").mkdir()
    with mounted("ext4", nvme_dir, "16M") as small:
        os.posix_fallocate(
            fd := os.open(small / "filler", os.O_CREAT | os.O_WRONLY, 0o600),
            0,
            nvme_path.free_nbytes(small) - (64 << 10),
        )
        os.close(fd)
        raw = _striped(engine_config(3, "nvme", "nvme", nvme_dir, gas=1), [nvme_dir / "a", small])
        with pytest.raises(
            ConfigError,
            match=rf"^not enough free space at nvme_path '{small}' \(ext4 at "
            rf"{small}\): this rank needs \d+ bytes of swap files \(parameters \d+ \+ optimizer state",
        ):
            infinity.initialize(tiny_gpt(), raw)
        assert not (small / "rank0").exists() and not (nvme_dir / "a" / "rank0").exists()


def test_paths_on_two_file_systems_are_not_reported(nvme_dir, caplog):
    (nvme_dir / "a").mkdir()
    with mounted("ext4", nvme_dir) as mnt, caplog.at_level(logging.WARNING, "infinity.store"):
        assert nvme_path.rank_dirs([nvme_dir / "a", mnt], 0) == [
            nvme_dir / "a" / "rank0",
            mnt / "rank0",
        ]
    assert caplog.records == []


def _striped(raw: dict, paths: list) -> dict:
    """``raw`` with both offload sections' nvme_path set to the list ``paths``."""
    for section in ("offload_param", "offload_optimizer"):
        raw["zero_optimization"][section]["nvme_path"] = [str(p) for p in paths]
    return raw
