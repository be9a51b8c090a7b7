"""Prefetch scheduler: stall time with and without read-ahead, on a chain of units read from NVMe (O_DIRECT).

    python bench/prefetch.py            # 32 units x 32 MiB (1 GiB), loads 0.25 0.5 0.8 1.25 2, 3 rounds
    python bench/prefetch.py --quick    # seconds: 8 units x 2 MiB, load 0.5, 2 rounds (the CI smoke run)

A step is the partitioner's pattern over a chain of units: a forward over
units 0..n-1 (compute t each) and a backward n-1..0 (compute 2t each), every
unit acquired before its compute and released after. The compute is a real
fp32 matmul on the unit's data, repeated until t has passed. t is set by the *load*:
what the forward consumes (one unit per t; the backward needs at most one
unit per 2t) as a fraction of the disk's read bandwidth measured in the same
run, i.e. t = unit bytes / (load x bandwidth). Load < 1: the disk delivers
faster than compute consumes, and read-ahead should hide the reads (target:
stall <= 5% of step time); load > 1: the disk is the bottleneck and stall
cannot vanish. The compute's real duration is measured in every step and
the load it amounts to is reported next to the one asked for, and so is the
*average read load*: Belady's minimum of bytes a step must read, per second
of the step's compute, relative to the disk (units still cached from the
previous step's backward need no read, so it is below the forward's load).

Contenders, interleaved in every round (the order alternating): "on demand"
(StoreShardSource, what the partitioner uses without a scheduler: fetch,
wait, compute, release) and "prefetch" (PrefetchScheduler; its trace is
recorded once before the rounds). Each run starts from a cold store (every
unit evicted) and its first step is a warm-up; the others are measured.
Stall = time the caller spent in acquire + release, as a fraction of the
step's wall time. Bytes read come from the store's counters; the disk's
limit from fio (io_uring, direct=1, 1 MiB, qd 32) in the same run, when fio
is installed. Reads are O_DIRECT (the page cache is never hit); the file
system is reported.

Writes a JSON with the configuration, versions and machine into
bench/results/ (or $INFINITY_BENCH_RESULTS), and prints a table. Swap files go
under ./infinity_nvme (--dir), which must be on a disk, not tmpfs.
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
from infinity.aio import AioConfig
from infinity.host import cpu_model, memory_total_nbytes, mount_of
from infinity.memory import BufferPool
from infinity.schedule import PrefetchScheduler
from infinity.store import TieredStore
from infinity.zero.shard_source import StoreShardSource

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
BACKWARD_FACTOR = 2.0  # backward compute per unit, relative to forward
MATMUL_N = 256


def belady_misses(trace: list[str], capacity: int, repeats: int = 3) -> int:
    """Misses in the last of ``repeats`` consecutive steps under Belady's optimal replacement."""
    seq = trace * repeats
    nxt = [0] * len(seq)
    last: dict[str, int] = {}
    for i in range(len(seq) - 1, -1, -1):
        nxt[i] = last.get(seq[i], 1 << 60)
        last[seq[i]] = i
    cache: dict[str, int] = {}  # key -> its next use
    misses = 0
    start = len(trace) * (repeats - 1)
    for i, k in enumerate(seq):
        if k not in cache:
            if i >= start:
                misses += 1
            if len(cache) >= capacity:
                del cache[max(cache, key=cache.__getitem__)]
        cache[k] = nxt[i]
    return misses


class Compute:
    """Matmuls on the unit's data until a chosen time has passed (a real load on a core, not a sleep)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(MATMUL_N, MATMUL_N, generator=g) / MATMUL_N
        self.y = torch.empty(MATMUL_N, MATMUL_N)
        w = torch.randn(MATMUL_N, MATMUL_N, generator=g)
        t0 = time.perf_counter()
        for _ in range(50):
            torch.mm(self.x, w, out=self.y)
        self.mm_s = (time.perf_counter() - t0) / 50

    def __call__(self, unit: torch.Tensor, seconds: float) -> None:
        w = unit[: MATMUL_N * MATMUL_N].view(MATMUL_N, MATMUL_N)
        deadline = time.perf_counter() + seconds
        torch.mm(self.x, w, out=self.y)
        while time.perf_counter() < deadline:
            torch.mm(self.x, w, out=self.y)


def fio_read_gbps(directory: Path, nbytes: int) -> dict | None:
    """fio's sequential O_DIRECT read bandwidth on a file in ``directory`` (None without fio).

    Huge-page buffers first (--mem=shmhuge: docs/benchmarks.md's fio reference; 4 KiB-page
    buffers hit the disk's segment limit), fio's default buffers where that fails."""
    fio = shutil.which("fio")
    if fio is None:
        return None
    path = directory / "fio-prefetch-bench.tmp"
    args = [
        fio,
        "--name=seqread",
        f"--filename={path}",
        f"--size={nbytes}",
        "--bs=1M",
        "--iodepth=32",
        "--ioengine=io_uring",
        "--direct=1",
        "--rw=read",
        "--output-format=json",
    ]
    try:
        for mem in ("shmhuge", None):
            extra = [f"--mem={mem}"] if mem else []
            r = subprocess.run(args + extra, capture_output=True, text=True, timeout=600)
            if r.returncode == 0:
                bw = json.loads(r.stdout)["jobs"][0]["read"]["bw_bytes"]
                return {"GBps": bw / 1e9, "buffers": mem or "default"}
        return None
    finally:
        path.unlink(missing_ok=True)


class Bench:
    def __init__(self, args: argparse.Namespace, directory: Path):
        self.args = args
        self.unit_nbytes = int(args.unit_mib * MiB)
        self.keys = [f"u{i}" for i in range(args.units)]
        self.trace = self.keys + self.keys[::-1]
        self.pool = BufferPool(args.pool_units, self.unit_nbytes, name="bench")
        self.store = TieredStore(
            directory, pool=self.pool, aio=AioConfig(engine=args.engine), name="bench"
        )
        numel = self.unit_nbytes // 4
        self.store.register_many([(k, (numel,), torch.float32) for k in self.keys])
        g = torch.Generator().manual_seed(1)
        for k in self.keys:
            self.store.write(k, torch.randn(numel, generator=g) * 0.01).result()
        self.store.flush_all().result()
        self.cold()
        self.compute = Compute()
        u = self.unit_nbytes
        self.sched = PrefetchScheduler(
            self.store,
            prefetch_bucket_nbytes=args.bucket_units * u,
            max_live_nbytes=args.live_units * u,
            max_reuse_distance_nbytes=args.reuse_units * u,
            tier="device",
            name="bench",
        )
        self.demand = StoreShardSource(self.store)
        self.min_reads = belady_misses(self.trace, args.pool_units)

    def cold(self) -> None:
        for k in self.keys:
            self.store.evict(k).result()

    def disk_gbps(self) -> float:
        """The store's read bandwidth for one unit at a time, nothing else running (what on-demand gets)."""
        self.cold()
        t0 = time.perf_counter()
        for k in self.keys:
            self.store.fetch(k).result()
            self.store.release(k)
        dt = time.perf_counter() - t0
        self.cold()
        return len(self.keys) * self.unit_nbytes / dt / 1e9

    def step(self, src, compute_s: list[float]) -> tuple[float, float, float]:
        """(wall, stall, forward compute) seconds of one step."""
        stall = fwd = 0.0
        n = len(self.keys)
        t_start = time.perf_counter()
        src.begin_step()
        for i, (key, r) in enumerate(zip(self.trace, compute_s, strict=True)):
            t0 = time.perf_counter()
            w = src.acquire(key)
            t1 = time.perf_counter()
            self.compute(w, r)
            t2 = time.perf_counter()
            src.release(key)
            stall += (t1 - t0) + (time.perf_counter() - t2)
            if i < n:
                fwd += t2 - t1
        src.end_step()
        return time.perf_counter() - t_start, stall, fwd

    def run(self, mode: str, compute_s: list[float], steps: int) -> dict:
        src = self.sched if mode == "prefetch" else self.demand
        self.cold()
        self.step(src, compute_s)  # warm-up: from a cold store
        r0 = self.store.stats().read.nbytes
        n0 = self.sched.stats().steps
        walls, stalls, fwds = [], [], []
        for _ in range(steps):
            wall, stall, fwd = self.step(src, compute_s)
            walls.append(wall)
            stalls.append(stall)
            fwds.append(fwd / len(self.keys))
        out = {
            "step_s": walls,
            "stall_s": stalls,
            "forward_s_per_unit": fwds,
            "read_nbytes_per_step": (self.store.stats().read.nbytes - r0) / steps,
        }
        if mode == "prefetch":
            hist = [s for s in self.sched.stats().history if s.step >= n0]
            out["scheduler"] = {
                "prefetch_hits": sum(s.prefetch_hits for s in hist),
                "late_prefetches": sum(s.late_prefetches for s in hist),
                "reuse_hits": sum(s.reuse_hits for s in hist),
                "on_demand": sum(s.on_demand for s in hist),
                "duplicate_reads": sum(s.duplicate_reads for s in hist),
                "dropped_prefetches": sum(s.dropped_prefetches for s in hist),
                "pool_deferrals": sum(s.pool_deferrals for s in hist),
                "peak_live_nbytes": max(s.peak_live_nbytes for s in hist),
                "peak_ahead_nbytes": max(s.peak_ahead_nbytes for s in hist),
                "kinds": sorted({s.kind for s in hist}),
            }
        return out

    def close(self) -> None:
        self.sched.close()
        self.store.close()


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run_load(b: Bench, load: float, disk_gbps: float, rounds: int, steps: int) -> dict:
    min_bytes = b.min_reads * b.unit_nbytes
    t_fwd = b.unit_nbytes / (load * disk_gbps * 1e9)
    compute_s = [t_fwd] * len(b.keys) + [t_fwd * BACKWARD_FACTOR] * len(b.keys)
    runs: dict[str, list[dict]] = {"on demand": [], "prefetch": []}
    for r in range(rounds):
        order = ["on demand", "prefetch"] if r % 2 == 0 else ["prefetch", "on demand"]
        for mode in order:
            runs[mode].append(b.run(mode, compute_s, steps))
    result: dict = {
        "load": load,
        "forward_compute_ms_per_unit": t_fwd * 1e3,
        "compute_s_per_step": sum(compute_s),
        "min_read_nbytes_per_step": min_bytes,
    }
    measured = [f for rs in runs.values() for r in rs for f in r["forward_s_per_unit"]]
    result["measured_load"] = _spread([b.unit_nbytes / f / (disk_gbps * 1e9) for f in measured])
    result["average_read_load"] = min_bytes / (sum(compute_s) * disk_gbps * 1e9)
    for mode, rs in runs.items():
        walls = [w for r in rs for w in r["step_s"]]
        fracs = [s / w for r in rs for w, s in zip(r["step_s"], r["stall_s"], strict=True)]
        read = statistics.median(r["read_nbytes_per_step"] for r in rs)
        row = {
            "step_s": _spread(walls),
            "stall_fraction": _spread(fracs),
            "read_nbytes_per_step": read,
            "read_vs_min": read / min_bytes if min_bytes else 0.0,
        }
        if mode == "prefetch":
            row["scheduler"] = {
                k: (
                    sum(r["scheduler"][k] for r in rs)
                    if isinstance(rs[0]["scheduler"][k], int)
                    else rs[0]["scheduler"][k]
                )
                for k in rs[0]["scheduler"]
            }
            row["scheduler"]["peak_live_nbytes"] = max(
                r["scheduler"]["peak_live_nbytes"] for r in rs
            )
            row["scheduler"]["peak_ahead_nbytes"] = max(
                r["scheduler"]["peak_ahead_nbytes"] for r in rs
            )
        result[mode] = row
    ratios = [
        p / d
        for rp, rd in zip(runs["prefetch"], runs["on demand"], strict=True)
        for p, d in zip(rp["step_s"], rd["step_s"], strict=True)
    ]
    result["step_time_prefetch_vs_on_demand"] = _spread(ratios)
    return result


def machine() -> dict:
    cpu = cpu_model() or platform.processor()
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_GiB": round(memory_total_nbytes() / 2**30, 1),
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "infinity": infinity.__version__,
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def print_table(result: dict) -> None:
    cfg = result["config"]
    print(
        f"\n{cfg['units']} units x {cfg['unit_mib']:g} MiB, pool {cfg['pool_units']} units, budgets (units): "
        f"bucket {cfg['bucket_units']}, max_live {cfg['live_units']}, reuse {cfg['reuse_units']}; "
        f"disk: store {result['disk']['store_read_GBps']:.2f} GB/s, fio "
        + (
            f"{result['disk']['fio_read']['GBps']:.2f} GB/s ({result['disk']['fio_read']['buffers']} buffers)"
            if result["disk"]["fio_read"]
            else "n/a"
        )
    )
    print(
        f"  {'load':>5s} {'(real)':>6s} {'avg read':>8s} {'fwd ms/unit':>11s} | {'stall % on demand':>22s} | {'stall % prefetch':>22s} | "
        f"{'step prefetch/demand':>20s} | {'read/min':>9s} | {'dup':>3s}"
    )
    for r in result["loads"]:
        d, p = r["on demand"], r["prefetch"]

        def pct(x: dict) -> str:
            return f"{x['median'] * 100:5.1f} ({x['min'] * 100:4.1f}-{x['max'] * 100:4.1f})"

        ratio = r["step_time_prefetch_vs_on_demand"]
        print(
            f"  {r['load']:5.2f} {r['measured_load']['median']:6.2f} {r['average_read_load']:8.2f} {r['forward_compute_ms_per_unit']:11.1f} | {pct(d['stall_fraction']):>22s} | "
            f"{pct(p['stall_fraction']):>22s} | {ratio['median']:8.2f} ({ratio['min']:.2f}-{ratio['max']:.2f}) | "
            f"{d['read_vs_min']:.2f}/{p['read_vs_min']:.2f} | {p['scheduler']['duplicate_reads']:3d}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="8 units x 2 MiB, load 0.5, 2 rounds: seconds (CI)"
    )
    ap.add_argument(
        "--units", type=int, default=None, help="units in the chain (default 32; --quick 8)"
    )
    ap.add_argument(
        "--unit-mib", type=float, default=None, help="MiB per unit (default 32; --quick 2)"
    )
    ap.add_argument(
        "--pool-units",
        type=int,
        default=None,
        help="pool capacity in units (default 12; --quick 6)",
    )
    ap.add_argument(
        "--bucket-units",
        type=int,
        default=None,
        help="stage3_prefetch_bucket_size in units (default 4; --quick 2)",
    )
    ap.add_argument(
        "--live-units",
        type=int,
        default=None,
        help="stage3_max_live_parameters in units (default 8; --quick 4)",
    )
    ap.add_argument(
        "--reuse-units",
        type=int,
        default=None,
        help="stage3_max_reuse_distance in units (default 4; --quick 2)",
    )
    ap.add_argument(
        "--loads",
        type=float,
        nargs="+",
        default=None,
        help="default 0.25 0.5 0.8 1.25 2; --quick 0.5",
    )
    ap.add_argument(
        "--rounds", type=int, default=None, help="interleaved rounds (default 3; --quick 2)"
    )
    ap.add_argument(
        "--steps", type=int, default=None, help="measured steps per run (default 2; --quick 1)"
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for the compute (default 1: a core is left for I/O)",
    )
    ap.add_argument("--engine", default="auto", choices=["auto", "io_uring", "threads"])
    ap.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="swap directory on a disk (default ./infinity_nvme)",
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON path (default $INFINITY_BENCH_RESULTS or bench/results, prefetch[-quick].json)",
    )
    args = ap.parse_args(argv)
    q = args.quick
    args.units = args.units or (8 if q else 32)
    args.unit_mib = args.unit_mib or (2 if q else 32)
    args.pool_units = args.pool_units or (6 if q else 12)
    args.bucket_units = args.bucket_units if args.bucket_units is not None else (2 if q else 4)
    args.live_units = args.live_units if args.live_units is not None else (4 if q else 8)
    args.reuse_units = args.reuse_units if args.reuse_units is not None else (2 if q else 4)
    args.loads = args.loads or ([0.5] if q else [0.25, 0.5, 0.8, 1.25, 2.0])
    args.rounds = args.rounds or (2 if q else 3)
    args.steps = args.steps or (1 if q else 2)
    if args.live_units > args.pool_units:
        ap.error(
            f"--live-units {args.live_units} exceeds --pool-units {args.pool_units}: the pool must hold max_live"
        )
    torch.set_num_threads(args.threads)
    base = args.dir or Path("infinity_nvme")
    base.mkdir(parents=True, exist_ok=True)
    results = Path(os.environ.get("INFINITY_BENCH_RESULTS", ROOT / "bench" / "results"))
    out = args.out or results / f"prefetch{'-quick' if q else ''}.json"

    directory = Path(tempfile.mkdtemp(prefix="prefetch-", dir=base))
    b = None
    try:
        b = Bench(args, directory)
        fio = fio_read_gbps(directory, min(args.units * int(args.unit_mib * MiB), 1 << 30))
        disk = b.disk_gbps()
        mount = mount_of(directory)
        result = {
            "benchmark": "prefetch",
            "machine": machine(),
            "config": {k: v for k, v in vars(args).items() if k not in ("out", "dir")},
            "disk": {
                "store_read_GBps": disk,
                "fio_read": fio,
                "file_system": mount.fs_type if mount else "?",
                "o_direct": True,
                "note": "loads are relative to store_read_GBps (one unit at a time, nothing else running)",
            },
            "matmul_ms": b.compute.mm_s * 1e3,
            "min_reads_per_step_units": b.min_reads,
            "loads": [],
        }
        b.step(b.sched, [0.0] * len(b.trace))  # step 0: the scheduler records the trace
        for load in args.loads:
            result["loads"].append(run_load(b, load, disk, args.rounds, args.steps))
    finally:
        if b is not None:
            b.close()
        shutil.rmtree(directory, ignore_errors=True)
    print(
        f"machine: {result['machine']['cpu']}, {result['machine']['cores']} cores; file system {result['disk']['file_system']}, O_DIRECT"
    )
    print_table(result)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
