"""A store (or scheduler) dropped without close() cleans up in the finalizer thread, running no Python
code in the thread that dropped it ([Note: finalizers run no Python] in infinity/aio/handle.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
import weakref

import torch

from infinity.memory import BufferPool
from infinity.schedule import PrefetchScheduler
from infinity.store import TieredStore, finalizer
from tests.finalizers import python_calls_while
from tests.store.conftest import RecordingAio


def test_dropping_a_store_with_io_in_flight_runs_no_python_and_cleans_up(nvme_dir):
    pool = BufferPool(4, 1 << 20, name="dropped-pool")
    aio = RecordingAio()
    try:
        store = TieredStore(nvme_dir, pool=pool, aio=aio, name="dropped")
        store.register_many([("a", (1 << 18,), torch.float32), ("b", (1 << 18,), torch.float32)])
        gate = aio.gate_next("write")
        fut = store.write("a", torch.ones(1 << 18))  # held back: in flight when the store goes
        store.write("b", torch.ones(1 << 18))
        dirs = store.directories
        gone = weakref.ref(store)
        held = {"store": store, "fut": fut}
        del store, fut
        gate.set()
        calls = python_calls_while(held.clear)
        assert calls == [], f"dropping the store ran Python code in the dropping thread: {calls}"
        # The reaper thread may hold the store for a moment while it completes the released write: the
        # last reference then goes there, and only after that is the cleanup queued.
        deadline = time.monotonic() + 30
        while gone() is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gone() is None, "the dropped store was never collected"
        assert finalizer.drain(30)
        assert pool.stats().in_use == 0 and not dirs[0].exists()
    finally:
        aio.close()


def test_dropping_a_prefetch_scheduler_runs_no_python(nvme_dir):
    pool = BufferPool(4, 1 << 20)
    with TieredStore(nvme_dir, pool=pool, name="sched") as store:
        store.register("u", (1024,), torch.float32)
        store.write("u", torch.ones(1024)).result(10)
        held = {
            "s": PrefetchScheduler(
                store,
                prefetch_bucket_nbytes=1 << 20,
                max_live_nbytes=1 << 20,
                max_reuse_distance_nbytes=0,
                tier="host",
            )
        }
        assert python_calls_while(held.clear) == []


def test_a_store_never_closed_removes_its_files_at_exit(nvme_dir):
    script = textwrap.dedent(
        """
        import sys, torch
        from infinity.memory import BufferPool
        from infinity.store import TieredStore
        store = TieredStore(sys.argv[1], pool=BufferPool(2, 1 << 20), name="at-exit")
        store.register("k", (1000,), torch.float32)
        store.write("k", torch.ones(1000)).result(10)
        print(store.directories[0])
        """
    )
    r = subprocess.run(
        [sys.executable, "-c", script, str(nvme_dir)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    from pathlib import Path

    d = Path(r.stdout.strip().splitlines()[-1])
    assert d.parent == nvme_dir and not d.exists(), f"{d} was left behind"
