"""Swap space: path checks with clear errors, file layout and modes, striping, stale-directory reclaim."""

import json
import logging
import os
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

from infinity.memory import BufferPool
from infinity.store import StoreStateError, SwapSpaceError, TieredStore
from infinity.store.swapdir import LOCK_NAME, OWNER_TAG, process_start_time
from tests.store.conftest import StoreFactory

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]


def _pool():
    return BufferPool(8, MiB, name="swap-test")


def test_missing_nvme_path_is_named():
    missing = "/nonexistent/infinity-swap"
    with pytest.raises(SwapSpaceError, match=f"nvme_path '{missing}' does not exist; create it"):
        TieredStore(missing, pool=_pool())


def test_nvme_path_that_is_a_file_is_refused(nvme_dir):
    f = nvme_dir / "a-file"
    f.write_text("x")
    with pytest.raises(SwapSpaceError, match="is a file, not a directory"):
        TieredStore(f, pool=_pool())
    fifo = nvme_dir / "a-fifo"
    os.mkfifo(fifo)
    with pytest.raises(SwapSpaceError, match=f"nvme_path '{fifo}' is not a directory"):
        TieredStore(fifo, pool=_pool())


def test_non_writable_nvme_path_is_named():
    d = Path(tempfile.mkdtemp(prefix="infinity-ro-"))
    try:
        d.chmod(0o555)
        script = textwrap.dedent(
            f"""
            import os, sys
            from infinity.memory import BufferPool
            from infinity.store import TieredStore, SwapSpaceError
            pool = BufferPool(1, 1 << 20)
            if os.geteuid() == 0:  # root ignores modes: become nobody (modules are loaded already)
                os.setgid(65534); os.setuid(65534)
            try:
                TieredStore({str(d)!r}, pool=pool)
            except SwapSpaceError as e:
                print(e); sys.exit(0)
            sys.exit("no error")
            """
        )
        r = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=60
        )
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"nvme_path '{d}' is not writable by this process" in r.stdout
    finally:
        d.chmod(0o755)
        d.rmdir()


def test_full_nvme_path_names_bytes_needed_and_free(nvme_dir):
    with TieredStore(nvme_dir, pool=_pool()) as store:
        free = os.statvfs(nvme_dir).f_bavail * os.statvfs(nvme_dir).f_frsize
        need = free + (1 << 40) + 1
        need_rounded = -(-need // MiB) * MiB  # space grows in stripe units (aio block_size)
        with pytest.raises(SwapSpaceError) as e:
            store.reserve(need)
        msg = str(e.value)
        assert f"not enough free space in nvme_path '{nvme_dir}'" in msg
        assert f"({need_rounded} bytes) more there" in msg and "bytes) free" in msg
        # the same check guards growth at register
        with pytest.raises(SwapSpaceError, match="register of key 'huge'"):
            store.register("huge", (free + (1 << 40),), torch.uint8)
        assert "huge" not in store
        store.register("small", (10,), torch.uint8)  # still usable


def test_files_are_private_preallocated_and_removed_on_close(nvme_dir):
    with TieredStore(nvme_dir, pool=_pool(), name="student") as store:
        store.reserve(3 * MiB)
        (d,) = store.directories
        assert d.parent == nvme_dir and d.name.startswith("infinity-student-")
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
        swap = d / "swap.0"
        assert stat.S_IMODE(swap.stat().st_mode) == 0o600
        assert swap.stat().st_blocks * 512 >= 3 * MiB, "fallocate'd, not sparse"
        owner = json.loads((d / LOCK_NAME).read_text())
        assert owner["pid"] == os.getpid() and owner["owner"] == OWNER_TAG
        assert store.stats().swap_capacity >= 3 * MiB
    assert not d.exists()


def test_two_stores_in_one_process_never_collide(nvme_dir):
    pool = _pool()
    with (
        TieredStore(nvme_dir, pool=pool, name="m") as teacher,
        TieredStore(nvme_dir, pool=pool, name="m") as student,
    ):
        assert teacher.directories != student.directories
        for s, v in ((teacher, 1.0), (student, 2.0)):
            s.register("w", (1000,), torch.float32)
            s.write("w", torch.full((1000,), v)).result(10)
            s.evict("w").result(10)
        assert torch.equal(teacher.fetch("w").result(10), torch.full((1000,), 1.0))
        assert torch.equal(student.fetch("w").result(10), torch.full((1000,), 2.0))
        teacher.release("w")
        student.release("w")


def test_extents_spanning_several_files(nvme_dir):
    with TieredStore(nvme_dir, pool=BufferPool(4, 2 * MiB), file_nbytes=MiB) as store:
        store.register("a", (MiB // 2,), torch.uint8)
        store.register("b", (5 * MiB // 8,), torch.float32)  # 2.5 MiB: crosses file ends
        b = torch.randn(5 * MiB // 8)
        store.write("b", b).result(10)
        store.evict("b").result(10)
        assert len(list(store.directories[0].glob("swap.*"))) >= 3
        assert torch.equal(store.fetch("b").result(10), b)
        store.release("b")


def test_striping_over_drives_is_one_vectored_request(nvme_dir):
    drives = [nvme_dir / "d0", nvme_dir / "d1"]
    for d in drives:
        d.mkdir()
    store, aio = StoreFactory(drives)(
        recording=True, pool_count=4, pool_size=2 * MiB, stripe_nbytes=MiB
    )
    try:
        x = torch.randn(3 * MiB // 4)  # 3 MiB: three stripe units
        store.register("x", x.shape, x.dtype)
        store.write("x", x).result(10)
        store.evict("x").result(10)
        aio.log.clear()
        assert torch.equal(store.fetch("x").result(10), x)
        store.release("x")
        (read,) = aio.reads()
        assert store.locate("x") == read.segments
        paths = [p for p, _o, _n in read.segments]
        assert len(read.segments) == 3 and paths[0] != paths[1] and paths[0] == paths[2]
        assert {Path(p).parent.parent for p in paths} == set(drives)
        assert all(n == MiB for _p, _o, n in read.segments)
    finally:
        store.close()
        aio.close()


def test_same_drive_twice_is_refused(nvme_dir):
    with pytest.raises(ValueError, match="same directory twice"):
        TieredStore([nvme_dir, nvme_dir], pool=_pool())


def test_cpu_only_store_needs_no_path():
    with TieredStore(None, pool=_pool()) as store:
        store.register("c", (4,), torch.float32, home="cpu")
        with pytest.raises(ValueError, match="has no nvme_path"):
            store.register("n", (4,), torch.float32)
        with pytest.raises(ValueError, match="nothing to reserve"):
            store.reserve(MiB)
    with pytest.raises(StoreStateError, match="closed"):
        store.register("d", (4,), torch.float32, home="cpu")


# -- stale directories ----------------------------------------------------------


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _fake_store_dir(root: Path, name: str, pid: int, start_time) -> Path:
    d = root / f"infinity-{name}-{pid}-0-abcdef"
    d.mkdir()
    owner = {
        "owner": OWNER_TAG,
        "pid": pid,
        "host": socket.gethostname(),
        "start_time": start_time,
        "store": name,
    }
    (d / LOCK_NAME).write_text(json.dumps(owner))
    (d / "swap.0").write_bytes(b"\0" * 8192)
    return d


def test_a_dead_process_dir_is_reclaimed_with_one_log_line(nvme_dir, caplog):
    dead = _fake_store_dir(nvme_dir, "old", _dead_pid(), 123)
    with caplog.at_level(logging.WARNING, logger="infinity.store"):
        with TieredStore(nvme_dir, pool=_pool()):
            pass
    assert not dead.exists()
    lines = [
        r.getMessage() for r in caplog.records if "reclaimed stale swap directory" in r.getMessage()
    ]
    assert len(lines) == 1 and str(dead) in lines[0] and "is dead" in lines[0]


def test_pid_reuse_does_not_keep_a_dead_dir_alive(nvme_dir):
    # the recorded pid runs (it is us), but it started at another time: the owner is gone
    reused = _fake_store_dir(nvme_dir, "reused", os.getpid(), process_start_time(os.getpid()) - 1)
    same = _fake_store_dir(nvme_dir, "same", os.getpid(), process_start_time(os.getpid()))
    with TieredStore(nvme_dir, pool=_pool()):
        pass
    assert not reused.exists()
    assert same.exists(), "a running pid with the same start time is never touched"


def test_a_live_owner_holding_the_flock_is_never_touched(nvme_dir):
    # The lock names a dead pid, but a live process holds its flock: the flock wins.
    d = _fake_store_dir(nvme_dir, "live", _dead_pid(), 1)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, fcntl; f = open(sys.argv[1]); fcntl.flock(f, fcntl.LOCK_EX); "
            "print('ok', flush=True); sys.stdin.read()",
            str(d / LOCK_NAME),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "ok"
        with TieredStore(nvme_dir, pool=_pool()):
            pass
        assert d.exists() and (d / "swap.0").exists()
    finally:
        holder.stdin.close()
        holder.stdout.close()
        holder.wait(10)


def test_foreign_directories_are_never_touched(nvme_dir):
    mine = nvme_dir / "infinity-not-a-store"
    mine.mkdir()
    (mine / "data").write_text("keep")
    other = nvme_dir / "user-data"
    other.mkdir()
    with TieredStore(nvme_dir, pool=_pool()):
        pass
    assert (mine / "data").exists() and other.exists()


def test_stripe_unit_must_be_a_multiple_of_the_block_size(nvme_dir):
    with pytest.raises(
        ValueError, match=r"stripe_nbytes must be a positive multiple of aio.block_size \(1048576\)"
    ):
        TieredStore(nvme_dir, pool=_pool(), stripe_nbytes=3 * 4096)
