"""Whole-process contracts, each in a subprocess: bounded host memory, and recovery after a crash."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch

from infinity.memory import BufferPool
from infinity.store import TieredStore

ROOT = Path(__file__).resolve().parents[2]
GiB = 1 << 30
MiB = 1 << 20


def _python(script: str, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


MEMORY_SCRIPT = """
    import json, sys, torch
    from infinity.memory import BufferPool
    from infinity.host import process_status as status
    from infinity.store import TieredStore

    # One intra-op thread: on a 2-core machine shared with the I/O threads (and
    # other jobs), torch's spinning OpenMP workers make copies 10x slower.
    torch.set_num_threads(1)
    MiB = 1 << 20
    pool = BufferPool(16, 16 * MiB, name="param")  # 256 MiB, allocated once
    big = [(("big", i), (8 * MiB,), torch.float32) for i in range(64)]  # 64 × 32 MiB = 2 GiB
    small = [(("small", i), (MiB // 4,), torch.float32) for i in range(2048)]  # 2048 × 1 MiB = 2 GiB
    src = torch.empty(8 * MiB)
    before = status()
    with TieredStore(sys.argv[1], pool=pool, name="memtest") as store:
        store.register_many(big)
        store.register_many(small)
        for i, (key, shape, _) in enumerate(big + small):
            n = shape[0]
            store.write(key, src[:n].fill_(i))
        store.flush_all().result()
        bad = 0
        for cycle in range(2):
            for i, (key, _, _) in enumerate(big):
                t = store.fetch(key).result()
                bad += int(not bool((t == i).all()))
                store.release(key)
            keys = [k for k, _, _ in small]
            for j in range(0, len(keys), 64):
                chunk = keys[j : j + 64]
                for n, f in enumerate(store.fetch_many(chunk)):
                    bad += int(not bool((f.result() == len(big) + j + n).all()))
                store.release_many(chunk)
        st = store.stats()
    print(json.dumps({"before": before, "after": status(), "bad": bad,
                      "read": st.read.nbytes, "written": st.write.nbytes, "pool_peak": st.pool.peak_in_use}))
"""


def test_cycling_4_gib_through_a_256_mib_pool_keeps_peak_rss_under_1_gib(nvme_dir):
    p = _python(MEMORY_SCRIPT, str(nvme_dir))
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err
    r = json.loads(out.strip().splitlines()[-1])
    assert r["bad"] == 0, "data read back differs from what was written"
    assert r["written"] >= 4 * GiB and r["read"] >= 8 * GiB
    assert r["pool_peak"] <= 256 * MiB
    # The pool may sit in hugetlb pages, which VmHWM does not count: add them.
    peak = r["after"]["VmHWM"] + r["after"].get("HugetlbPages", 0)
    assert peak < GiB, f"peak host memory {peak / MiB:.0f} MiB for 4 GiB of tensors"


CRASH_SCRIPT = """
    import sys, torch
    from infinity.memory import BufferPool
    from infinity.store import TieredStore
    store = TieredStore(sys.argv[1], pool=BufferPool(8, 1 << 20), name=sys.argv[2])
    store.register_many([(i, (1 << 18,), torch.float32) for i in range(64)])
    x = torch.randn(1 << 18)
    print(store.directories[0], flush=True)
    i = 0
    while True:  # write forever; the parent kills us mid-write
        store.write(i % 64, x)
        i += 1
        if sys.argv[2] == "idle":
            sys.stdin.read()
"""


def test_a_process_killed_mid_write_is_reclaimed_and_a_live_one_is_not(nvme_dir):
    crashed = _python(CRASH_SCRIPT, str(nvme_dir), "crashing")
    live = _python(CRASH_SCRIPT, str(nvme_dir), "idle", stdin=subprocess.PIPE)
    try:
        crashed_dir = Path(crashed.stdout.readline().strip())
        live_dir = Path(live.stdout.readline().strip())
        time.sleep(0.3)  # let it get well into its writes
        crashed.send_signal(signal.SIGKILL)
        crashed.wait(10)
        assert crashed.returncode == -signal.SIGKILL
        assert (crashed_dir / "swap.0").exists(), "a killed process leaves its files behind"

        with TieredStore(nvme_dir, pool=BufferPool(2, 1 << 20), name="next") as store:
            assert not crashed_dir.exists(), "the next open reclaims the dead process's files"
            assert live_dir.exists() and (live_dir / "swap.0").exists(), (
                "a live process is never touched"
            )
            store.register("k", (1000,), torch.float32)
            store.write("k", torch.ones(1000)).result(10)
            store.evict("k").result(10)
            assert torch.equal(store.fetch("k").result(10), torch.ones(1000))
            store.release("k")
            mine = store.directories[0]
            assert sorted(p.name for p in nvme_dir.iterdir()) == sorted([mine.name, live_dir.name])
    finally:
        for p in (crashed, live):
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=10)
    assert live_dir.exists()  # killed just now: the next open would reclaim it
    os.sync()
