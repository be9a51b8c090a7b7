"""nvme_path: one place resolves and checks the swap folder and joins rank<N>; every caller uses it.

The callers (the engine, zero.Init, a TieredStore, the estimator) each get the
same answer for the same path: ``~`` expanded, a regular file refused as a
file, a file system refusing O_DIRECT named once with its type, one reporting
no size named as such.
"""

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
        f"nvme_path '{mnt}' is on a ramfs file system (mounted at {mnt}), which refuses O_DIRECT: "
        "swap files there are read and written through the page cache (slower, and the cache takes "
        "host memory). Point nvme_path at a local disk (ext4, xfs) for direct I/O, or set "
        "aio.o_direct to false if buffered I/O is meant"
    ]


def test_a_file_system_reporting_no_size_is_named_not_called_full(nvme_dir):
    # ramfs reports 0 blocks: "0 bytes are free" was the message, as if the disk were full
    with mounted("ramfs", nvme_dir) as mnt:
        with pytest.raises(ConfigError) as e:
            infinity.initialize(tiny_gpt(), engine_config(3, "nvme", "nvme", mnt, gas=1))
        msg = str(e.value)
        assert msg.startswith(
            f"nvme_path '{mnt / 'rank0'}' is on a ramfs file system (mounted at {mnt}) that reports "
            "no size, so whether this rank's "
        )
        assert (
            "bytes of swap files (parameters" in msg
            and "on ramfs they would fill host memory" in msg
        )
        assert os.listdir(mnt / "rank0") == []  # nothing was written


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
