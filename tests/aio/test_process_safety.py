"""fork() and interpreter exit with handles alive and requests in flight, each in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys
import textwrap

FORK_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    from infinity.aio import AioError, AioHandle

    # numpy, not torch, for the data: torch's OpenMP pool does not survive fork() (a known
    # libgomp limitation, unrelated to the engine), and this test must only see the engine.
    engine, d = sys.argv[1], sys.argv[2]
    data = (np.arange(3 << 20) % 251).astype(np.uint8)
    h = AioHandle(engine=engine, block_size=64 << 10, queue_depth=4)
    h.sync_pwrite(data, f"{d}/parent")
    in_flight = h.pwrite(data, f"{d}/across_fork")  # may still be running at fork()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            h.sync_pread(np.empty_like(data), f"{d}/parent")
            code = 10  # the inherited handle must refuse, not hang
        except AioError as e:
            if "fork" not in str(e):
                code = 11
        with AioHandle(engine=engine) as child:
            out = np.empty_like(data)
            child.sync_pread(out, f"{d}/parent")
            if not np.array_equal(out, data):
                code = 12
            child.sync_pwrite(out, f"{d}/child")
        sys.exit(code)  # a normal exit: atexit runs in the child too
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, os.waitstatus_to_exitcode(status)
    in_flight.wait()
    for name in ("child", "across_fork"):
        out = np.empty_like(data)
        h.sync_pread(out, f"{d}/{name}")
        assert np.array_equal(out, data), name
    print("ok")
    """
)

EXIT_SCRIPT = textwrap.dedent(
    """
    import sys, threading, torch
    from infinity.aio import AioError, AioHandle, aligned_empty

    engine, d = sys.argv[1], sys.argv[2]
    data = (torch.arange(4 << 20) % 253).to(torch.uint8)
    writer = AioHandle(engine=engine, block_size=16 << 10, queue_depth=2)
    for i in range(8):
        writer.pwrite(data, f"{d}/out", i * data.numel())  # never waited, never closed
    reader = AioHandle(engine=engine, block_size=4096, queue_depth=1)
    reader.sync_pwrite(data, f"{d}/src")
    big = aligned_empty(data.numel())
    blocked = threading.Event()

    def read_forever():
        blocked.set()
        try:
            while True:
                reader.sync_pread(big, f"{d}/src")
        except AioError as e:  # exit closed the handle under this thread: it must say so
            assert "AioHandle is closed" in str(e), e

    threading.Thread(target=read_forever, daemon=True).start()
    blocked.wait()
    print("exiting")
    sys.exit(0)  # handles open, requests in flight, a daemon thread inside wait()
    """
)


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=60
    )


def test_fork_child_refuses_inherited_handle_and_can_make_its_own(engine, nvme_dir):
    r = run(FORK_SCRIPT, engine, str(nvme_dir))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == "ok"


def test_interpreter_exit_with_requests_in_flight(engine, nvme_dir):
    r = run(EXIT_SCRIPT, engine, str(nvme_dir))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Exception ignored" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    # Exit waited for the unwaited writes: all 8 copies are on disk.
    data = bytes((i % 253) for i in range(4 << 20))
    with open(nvme_dir / "out", "rb") as f:
        content = f.read()
    assert len(content) == 8 * len(data)
    for i in range(8):
        assert content[i * len(data) : (i + 1) * len(data)] == data, f"copy {i}"
