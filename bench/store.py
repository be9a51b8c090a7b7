"""Fetch throughput of the tiered store from NVMe (O_DIRECT), against fio in the same run.

Three ways to read the same number of bytes, each from a cold cache (every
key evicted first; O_DIRECT, so the page cache never serves them), plus a
bare AioHandle read of the large tensor's bytes into pool memory (what the
store costs on top of its engine):
  large     one tensor of --large-mib MiB, one fetch;
  small     --small-count tensors of --small-kib KiB, registered in trace order
            and fetched in that order with fetch_many, --window-mib in flight
            (how the prefetch scheduler uses the store);
  per-key   the same small tensors, one fetch() each, the same window;
and fio (io_uring, direct=1, the store's queue depth, huge-page buffers like
the store's pool) reading a file of the same size in the same directory, in
the store's block size (the reference for large and small, whose reads are
split into blocks) and in the small tensors' size (the reference for per-key,
which issues one request per tensor). Rounds are interleaved (fio, large,
small, fio-small, per-key, fio, ...);
the table gives the median GB/s with min–max, and each ratio is the median
of the per-round ratios (the issue's targets: small / large ≥ 0.8 and large,
small / fio ≥ 0.9).

The store checksums every key (CRC32C at write, checked at read: on by default,
infinity/store/integrity.py); ``--no-integrity`` measures it without, which is
also how to compare with a store that predates checksums.

    python bench/store.py            # full: 1 GiB vs 16384 × 64 KiB, 5 rounds
    python bench/store.py --quick    # seconds: 64 MiB vs 1024 × 64 KiB, 2 rounds
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import infinity
from infinity.aio import AioConfig, AioHandle
from infinity.host import cpu_model
from infinity.memory import BufferPool
from infinity.store import TieredStore

MiB = 1 << 20
HERE = Path(__file__).resolve().parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    p.add_argument(
        "--dir", default=None, help="directory on the drive to test (default: ./infinity_nvme)"
    )
    p.add_argument(
        "--out",
        default=None,
        help="JSON output (default: $INFINITY_BENCH_RESULTS or bench/results, "
        "store-<mode>-<engine>-<time>.json)",
    )
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--large-mib", type=int, default=None)
    p.add_argument("--small-kib", type=int, default=64)
    p.add_argument("--small-count", type=int, default=None)
    p.add_argument(
        "--window-mib", type=int, default=128, help="bytes of small fetches kept in flight"
    )
    p.add_argument("--block-size", type=int, default=1 << 20)
    p.add_argument("--queue-depth", type=int, default=32)
    p.add_argument("--engine", default="auto", choices=["auto", "io_uring", "threads"])
    p.add_argument(
        "--no-integrity",
        dest="integrity",
        action="store_false",
        help="no CRC32C per key (the store's default checks every read)",
    )
    a = p.parse_args(argv)
    a.rounds = a.rounds or (2 if a.quick else 5)
    a.large_mib = a.large_mib or (64 if a.quick else 1024)
    a.small_count = a.small_count or (a.large_mib * 1024 // a.small_kib)
    return a


def run_fio(path: Path, nbytes: int, a: argparse.Namespace, bs: int) -> float | None:
    """fio's read GB/s of a file of ``nbytes`` in ``bs`` blocks (None when fio is not installed)."""
    fio = shutil.which("fio")
    if fio is None:
        return None
    common = [
        fio,
        "--name=ref",
        f"--filename={path}",
        f"--size={nbytes}",
        f"--bs={bs}",
        "--ioengine=io_uring",
        f"--iodepth={a.queue_depth}",
        "--direct=1",
        "--output-format=json",
    ]
    if not path.exists() or path.stat().st_size < nbytes:
        subprocess.run([*common, "--rw=write"], check=True, capture_output=True)
    for mem in ("shmhuge", "malloc"):  # huge pages like the store's pool, where the system allows
        r = subprocess.run([*common, "--rw=read", f"--mem={mem}"], capture_output=True, text=True)
        if r.returncode == 0:
            job = json.loads(r.stdout)["jobs"][0]["read"]
            return job["bw_bytes"] / 1e9
    raise RuntimeError(f"fio failed: {r.stderr.strip()}")


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def fetch_large(store: TieredStore) -> None:
    store.fetch("large").result()
    store.release("large")


def fetch_small(store: TieredStore, keys: list, chunk: int, window: int, per_key: bool) -> None:
    """Trace order with ``window`` chunks in flight: wait for the oldest, release it, issue the next."""
    inflight: list[tuple[list, list]] = []
    for i in range(0, len(keys), chunk):
        part = keys[i : i + chunk]
        futs = [store.fetch(k) for k in part] if per_key else store.fetch_many(part)
        inflight.append((part, futs))
        if len(inflight) >= window:
            done_keys, done = inflight.pop(0)
            for f in done:
                f.result()
            store.release_many(done_keys)
    for done_keys, done in inflight:
        for f in done:
            f.result()
        store.release_many(done_keys)


def evict_all(store: TieredStore, keys: list) -> None:
    for k in keys:
        store.evict(k).result()


def summarize(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def machine() -> dict:
    cpu = cpu_model()
    return {
        "host": platform.node(),
        "kernel": platform.release(),
        "cpu": cpu,
        "cores": os.cpu_count(),
    }


def main(argv=None) -> int:
    a = parse_args(argv)
    root = Path(a.dir or "infinity_nvme")
    root.mkdir(parents=True, exist_ok=True)
    large_nbytes = a.large_mib * MiB
    small_nbytes = a.small_kib * 1024
    total_small = small_nbytes * a.small_count
    chunk_nbytes = 16 * MiB
    chunk = max(1, chunk_nbytes // small_nbytes)
    window = max(1, a.window_mib * MiB // chunk_nbytes)
    pool = BufferPool(
        max(large_nbytes, total_small) // chunk_nbytes + 1, chunk_nbytes, name="bench"
    )
    cfg = AioConfig(block_size=a.block_size, queue_depth=a.queue_depth, engine=a.engine)
    work = Path(tempfile.mkdtemp(prefix="bench-store-", dir=root))
    results: dict[str, list[float]] = {
        "fio": [],
        "aio": [],
        "large": [],
        "small": [],
        "fio-small": [],
        "per-key": [],
    }
    try:
        with TieredStore(work, pool=pool, aio=cfg, name="bench", integrity=a.integrity) as store:
            small = [("small", i) for i in range(a.small_count)]
            store.register("large", (large_nbytes,), torch.uint8)
            store.register_many([(k, (small_nbytes,), torch.uint8) for k in small])  # trace order
            src = torch.arange(large_nbytes // 8, dtype=torch.int64).view(torch.uint8)
            store.write("large", src).result()
            flat = src[:small_nbytes].clone()
            for i, k in enumerate(small):
                store.write(k, flat.roll(i))
            store.flush_all().result()
            evict_all(store, ["large", *small])
            del src
            aio = AioHandle.from_config(cfg)
            if aio.engine == "io_uring":
                aio.register_buffers([pool.slab])  # as the store does
            engine = aio.engine
            runs = store.locate("large")
            files = {path: aio.open(path, "r", create=False) for path, _o, _n in runs}
            for _ in range(a.rounds):
                fio = run_fio(work / "fio.dat", large_nbytes, a, a.block_size)
                if fio is not None:
                    results["fio"].append(fio)
                region = pool.acquire(large_nbytes)
                items, pos = [], 0
                for path, off, n in runs:
                    items.append((region.bytes_at(pos, n), files[path], off))
                    pos += n
                t = timed(lambda items=items: aio.pread_many(items).wait())
                region.release()
                results["aio"].append(large_nbytes / t / 1e9)
                t = timed(lambda: fetch_large(store))
                store.evict("large").result()
                results["large"].append(large_nbytes / t / 1e9)
                t = timed(lambda: fetch_small(store, small, chunk, window, per_key=False))
                evict_all(store, small)
                results["small"].append(total_small / t / 1e9)
                fio = run_fio(work / "fio.dat", total_small, a, small_nbytes)
                if fio is not None:
                    results["fio-small"].append(fio)
                t = timed(lambda: fetch_small(store, small, chunk, window, per_key=True))
                evict_all(store, small)
                results["per-key"].append(total_small / t / 1e9)
            stats = store.stats().as_dict()
            for f in files.values():
                f.close()
            aio.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    summary = {k: summarize(v) for k, v in results.items() if v}
    # Each ratio is the median of the per-round ratios: both sides of a round
    # ran back to back, so drift of the shared disk between rounds cancels.
    pairs = [
        ("small/large", "small", "large"),
        ("per-key/large", "per-key", "large"),
        ("large/fio", "large", "fio"),
        ("small/fio", "small", "fio"),
        ("large/aio", "large", "aio"),
        ("per-key/fio-small", "per-key", "fio-small"),
    ]
    ratios = {
        name: statistics.median(x / y for x, y in zip(results[a], results[b], strict=True))
        for name, a, b in pairs
        if results[a] and results[b]
    }
    targets = {"small/large": 0.8, "large/fio": 0.9, "small/fio": 0.9}

    print(
        f"store fetch throughput, O_DIRECT, {a.rounds} interleaved rounds, engine {engine}, "
        f"block {a.block_size // 1024} KiB, qd {a.queue_depth}, dir {root}"
    )
    print(f"{'what':<44} {'GB/s median':>12} {'min–max':>14}")
    labels = {
        "fio": f"fio read, {a.block_size // 1024} KiB blocks",
        "fio-small": f"fio read, {a.small_kib} KiB blocks",
        "aio": "AioHandle read of the same bytes",
        "large": f"1 tensor of {a.large_mib} MiB",
        "small": f"{a.small_count} × {a.small_kib} KiB, fetch_many, trace order",
        "per-key": f"{a.small_count} × {a.small_kib} KiB, one fetch() each",
    }
    for k, v in summary.items():
        print(f"{labels[k]:<44} {v['median']:>12.2f} {v['min']:>6.2f}–{v['max']:<6.2f}")
    for k, r in ratios.items():
        goal = f"   (target ≥ {targets[k]})" if k in targets else ""
        print(f"ratio {k:<38} {r:>12.2f}{goal}")

    results_dir = Path(os.environ.get("INFINITY_BENCH_RESULTS", HERE / "results"))
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    name = f"store-{'quick' if a.quick else 'full'}-{engine}-{stamp}.json"
    out = Path(a.out) if a.out else results_dir / name
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "bench": "store",
        "mode": "quick" if a.quick else "full",
        "config": {k: v for k, v in vars(a).items() if k not in ("out",)} | {"engine_used": engine},
        "versions": {
            "infinity": infinity.__version__,
            "torch": torch.__version__,
            "python": sys.version.split()[0],
        },
        "machine": machine(),
        "gbps": summary,
        "ratios": ratios,
        "targets": targets,
        "store_stats": stats,
    }
    out.write_text(json.dumps(record, indent=2, default=str))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
