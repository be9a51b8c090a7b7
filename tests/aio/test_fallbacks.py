"""Fallbacks, each announced by one log line: io_uring refused by the kernel (simulated with the C++ test
hook INFINITY_AIO_IO_URING_REFUSE, as Docker's seccomp profile or kernel.io_uring_disabled would), and
O_DIRECT refused by the file system (really, on ramfs; and through the INFINITY_AIO_O_DIRECT_REFUSE
hook where mounting is not allowed)."""

from __future__ import annotations

import errno
import logging

import pytest
import torch
from aio_util import mounted, random_bytes

from infinity.aio import AioError, AioHandle, aligned_empty, io_uring_status
from infinity.aio.handle import Notices


@pytest.fixture
def fresh_announcements(monkeypatch):
    """Each fallback is announced once per process; start each test with none announced."""
    monkeypatch.setattr(AioHandle, "notices", Notices())


def round_trip(h: AioHandle, path) -> None:
    data = torch.from_numpy(random_bytes(3 * 4096 + 17, seed=1))
    h.sync_pwrite(data[5:], path, 3)
    out = aligned_empty(data.numel() - 5)
    h.sync_pread(out, path, 3)
    assert torch.equal(out, data[5:])


@pytest.mark.parametrize("refusal", ["EPERM", "ENOSYS"])
def test_auto_falls_back_to_threads_when_io_uring_is_refused(
    monkeypatch, caplog, fresh_announcements, nvme_dir, refusal
):
    monkeypatch.setenv("INFINITY_AIO_IO_URING_REFUSE", refusal)
    why = f"io_uring_setup: {'Operation not permitted' if refusal == 'EPERM' else 'Function not implemented'}"
    assert io_uring_status() == f"{why} (simulated by INFINITY_AIO_IO_URING_REFUSE)"
    with caplog.at_level(logging.WARNING, logger="infinity.aio"):
        with AioHandle(engine="auto") as h, AioHandle(engine="auto") as h2:
            assert h.engine == h2.engine == "threads"
            round_trip(h, nvme_dir / "f")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        f"io_uring is not available ({why} (simulated by INFINITY_AIO_IO_URING_REFUSE)); using the threads "
        "I/O engine. In Docker, io_uring is blocked by the default seccomp profile (see docs/troubleshooting.md)."
    ], "exactly one line, however many handles"


def test_explicit_io_uring_refused_is_an_error(monkeypatch, fresh_announcements):
    monkeypatch.setenv("INFINITY_AIO_IO_URING_REFUSE", "EPERM")
    with pytest.raises(AioError) as ei:
        AioHandle(engine="io_uring")
    assert ei.value.errno == errno.ENOSYS
    assert str(ei.value) == (
        f"[Errno {errno.ENOSYS}] engine='io_uring' is not available here (io_uring_setup: Operation not "
        "permitted (simulated by INFINITY_AIO_IO_URING_REFUSE)); use engine='auto' to fall back to the "
        "threads engine"
    )


def test_threads_engine_needs_no_io_uring(monkeypatch, caplog, fresh_announcements, nvme_dir):
    monkeypatch.setenv("INFINITY_AIO_IO_URING_REFUSE", "EPERM")
    with caplog.at_level(logging.WARNING, logger="infinity.aio"), AioHandle(engine="threads") as h:
        round_trip(h, nvme_dir / "f")
    assert caplog.records == [], "asking for threads is not a fallback: nothing to announce"


def test_o_direct_refused_by_a_real_file_system(engine, caplog, fresh_announcements, nvme_dir):
    """ramfs has no direct I/O at all: files there are opened buffered, with one log line."""
    with mounted("ramfs", nvme_dir) as mnt:
        with caplog.at_level(logging.WARNING, logger="infinity.aio"), AioHandle(engine=engine) as h:
            f = h.open(mnt / "f", "rw")
            assert not f.direct
            round_trip(h, f)
            round_trip(h, mnt / "g")  # by path, again: still one line
            f.close()
    assert [r.getMessage() for r in caplog.records] == [
        f"O_DIRECT is refused by the file system holding {mnt}; using buffered I/O there (reads may be "
        "served from the page cache)"
    ]


def test_o_direct_refused_simulated(engine, monkeypatch, caplog, fresh_announcements, nvme_dir):
    monkeypatch.setenv("INFINITY_AIO_O_DIRECT_REFUSE", "1")
    with caplog.at_level(logging.WARNING, logger="infinity.aio"), AioHandle(engine=engine) as h:
        with h.open(nvme_dir / "f", "rw") as f:
            assert not f.direct
            round_trip(h, f)
    assert len(caplog.records) == 1
    assert (
        caplog.records[0]
        .getMessage()
        .startswith(f"O_DIRECT is refused by the file system holding {nvme_dir}")
    )
    monkeypatch.delenv("INFINITY_AIO_O_DIRECT_REFUSE")
    with AioHandle(engine=engine) as h, h.open(nvme_dir / "f", "rw") as f:
        assert f.direct


def test_o_direct_off_by_choice(engine, caplog, fresh_announcements, nvme_dir):
    with (
        caplog.at_level(logging.WARNING, logger="infinity.aio"),
        AioHandle(engine=engine, o_direct=False) as h,
    ):
        with h.open(nvme_dir / "f", "rw") as f:
            assert not f.direct
            round_trip(h, f)
    assert caplog.records == []
