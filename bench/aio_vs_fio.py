#!/usr/bin/env python3
"""infinity's aio engine vs fio (and DeepSpeed's aio where importable): sequential read and write.

For each setting -- 1 MiB blocks at queue depth 32, and the best of an `infinity bench aio` sweep --
and each direction, the contenders run back to back ``--repeat`` times, the order rotated each
repetition (A B C, B C A, C A B, ...):

  infinity io_uring / threads   one vectored request over the file through a ring of
                                queue_depth x block_size bytes (the memory fio cycles through)
  infinity io_uring, file-size buffer   the same through one buffer as large as the file
  fio hugepages                 ioengine=io_uring direct=1 --iomem=shmhuge (the best fio does here)
  fio default buffers           the same with fio's malloc'd buffers
  deepspeed aio                 DeepSpeed's aio_handle (libaio) into its locked, file-size buffer,
                                when `deepspeed` is importable

The page cache is bypassed (O_DIRECT) everywhere. Reported: median and min-max GB/s, and each
contender's ratio to fio-with-huge-pages (median of per-repetition ratios, each pair measured
back to back). Targets: io_uring >= 0.95, threads >= 0.8. Results go to bench/results/ as JSON.

    python bench/aio_vs_fio.py            # full: 2 GiB file, 3 repetitions (about 2 minutes)
    python bench/aio_vs_fio.py --quick    # smoke run in seconds (64 MiB, 1 repetition)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from infinity import measure
from infinity.measure import FioError, fio_path, shmhuge_fits

ROOT = Path(__file__).resolve().parent
TARGETS = {"infinity io_uring": 0.95, "infinity threads": 0.8}
REFERENCE = "fio hugepages"


def deepspeed_runner(
    setting: measure.Setting, test_file: measure.TestFile, op: str
) -> Callable[[], float] | None:
    """A callable timing one DeepSpeed aio run, or None where deepspeed is not importable."""
    try:
        import torch
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except ImportError:
        return None

    def run() -> float:
        handle = (
            AsyncIOBuilder()
            .load(verbose=False)
            .aio_handle(setting.block_size, setting.queue_depth, False, True, setting.thread_count)
        )
        buf = handle.new_cpu_locked_tensor(test_file.nbytes, torch.empty(0, dtype=torch.uint8))
        try:
            t0 = time.perf_counter()
            if op == "read":
                handle.sync_pread(buf, str(test_file.path))
            else:
                handle.sync_pwrite(buf, str(test_file.path))
            return test_file.nbytes / (time.perf_counter() - t0) / 1e9
        finally:
            handle.free_cpu_locked_tensor(buf)

    return run


def contenders(
    setting: measure.Setting, test_file: measure.TestFile, op: measure.Op, *, whole_file: bool
) -> dict[str, Callable[[], float]]:
    def ours(engine: str, ring: int | None = None) -> Callable[[], float]:
        s = measure.Setting(setting.block_size, setting.queue_depth, setting.thread_count, engine)
        return lambda: measure.measure_once(s, test_file, op, ring_nbytes=ring)[0]

    out: dict[str, Callable[[], float]] = {
        "infinity io_uring": ours("io_uring"),
        "infinity threads": ours("threads"),
    }
    if whole_file:
        out["infinity io_uring, file-size buffer"] = ours("io_uring", test_file.nbytes)
    if fio_path():
        for name, iomem in ((REFERENCE, "shmhuge"), ("fio default buffers", "malloc")):
            job = measure.fio_job(setting, test_file, op, iomem, direct=True)  # type: ignore[arg-type]
            if iomem == "shmhuge" and job.iomem != "shmhuge":
                print(
                    f"note: the hugetlb pool is too small for fio's shmhuge at {setting.label}; using malloc",
                    file=sys.stderr,
                )
            out[name] = job.run
    ds = deepspeed_runner(setting, test_file, op)
    if ds is not None:
        out["deepspeed aio (file-size buffer)"] = ds
    return out


def measure_setting(
    setting: measure.Setting, test_file: measure.TestFile, repeat: int, *, whole_file: bool
) -> list[dict]:
    rows = []
    for op in ("read", "write"):
        runs = contenders(setting, test_file, op, whole_file=whole_file)
        results: dict[str, list[float]] = {name: [] for name in runs}
        for fn in runs.values():  # warm-up, not measured
            fn()
        names = list(runs)
        for rep in range(repeat):
            # Rotate who goes first, so no contender always follows the same neighbour.
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                fn = runs[name]
                try:
                    results[name].append(fn())
                except (FioError, RuntimeError, OSError) as e:
                    raise SystemExit(f"{name} at {setting.label} {op}: {e}") from None
                gc.collect()
        ref = results.get(REFERENCE)
        for name, xs in results.items():
            row = {
                "setting": setting.label,
                **setting.__dict__,
                "op": op,
                "contender": name,
                "gbps": {
                    "median": round(statistics.median(xs), 3),
                    "min": round(min(xs), 3),
                    "max": round(max(xs), 3),
                    "runs": [round(x, 3) for x in xs],
                },
            }
            if ref:
                ratios = [a / b for a, b in zip(xs, ref, strict=True)]
                row["ratio_to_fio_hugepages"] = {
                    "median": round(statistics.median(ratios), 3),
                    "min": round(min(ratios), 3),
                    "max": round(max(ratios), 3),
                }
                if name in TARGETS:
                    row["target"] = TARGETS[name]
            rows.append(row)
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = [
        f"{'setting':<14} {'op':<5} {'contender':<36} {'GB/s median (min-max)':>22} {'/ fio hugepages':>16}"
    ]
    for r in rows:
        g = r["gbps"]
        ratio = ""
        if "ratio_to_fio_hugepages" in r:
            q = r["ratio_to_fio_hugepages"]
            ratio = f"{q['median']:.2f} ({q['min']:.2f}-{q['max']:.2f})"
            if "target" in r:
                ratio += "  ok" if q["median"] >= r["target"] else f"  below {r['target']}"
        lines.append(
            f"{r['setting']:<14} {r['op']:<5} {r['contender']:<36} {g['median']:>6.2f} ({g['min']:.2f}-{g['max']:.2f}){'':>6} {ratio}"
        )
    return "\n".join(lines)


def format_markdown(rows: list[dict]) -> str:
    """docs/benchmarks.md's table: GB/s median, then the ratio to fio with huge pages: median (min–max).

    The reference's cells (and all cells where fio is absent) give GB/s median (min–max)."""
    names = list(dict.fromkeys(r["contender"] for r in rows))
    lines = ["| setting | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for key in dict.fromkeys((r["setting"], r["op"]) for r in rows):
        cells = []
        for name in names:
            r = next(
                (r for r in rows if (r["setting"], r["op"]) == key and r["contender"] == name), None
            )
            if r is None:
                cells.append("")
                continue
            g, q = r["gbps"], r.get("ratio_to_fio_hugepages")
            if q is None or name == REFERENCE:
                cells.append(f"{g['median']:.2f} ({g['min']:.2f}–{g['max']:.2f})")
            else:
                cells.append(
                    f"{g['median']:.2f}: {q['median']:.2f}× ({q['min']:.2f}–{q['max']:.2f})"
                )
        lines.append(f"| {key[1]} {key[0]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--path",
        type=Path,
        default=Path("infinity_nvme"),
        help="directory on the drive (default ./infinity_nvme)",
    )
    p.add_argument(
        "--size",
        type=measure.parse_size,
        default=None,
        help="test file (default 2G; 64M with --quick)",
    )
    p.add_argument(
        "--repeat", type=int, default=None, help="repetitions (default 3; 1 with --quick)"
    )
    p.add_argument(
        "--best",
        default=None,
        help="BS,QD,THREADS instead of sweeping for the best setting, e.g. 1M,8,1",
    )
    p.add_argument("--quick", action="store_true", help="smoke run in seconds")
    p.add_argument(
        "--markdown",
        action="store_true",
        help="also print the table as markdown (as in docs/benchmarks.md)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON output (default $INFINITY_BENCH_RESULTS or bench/results, aio_vs_fio[-quick].json)",
    )
    args = p.parse_args(argv)
    size = args.size or measure.parse_size("64M" if args.quick else "2G")
    repeat = args.repeat or (1 if args.quick else 3)
    results = Path(os.environ.get("INFINITY_BENCH_RESULTS", ROOT / "results"))
    out = args.out or results / f"aio_vs_fio{'-quick' if args.quick else ''}.json"

    test_file = measure.TestFile(args.path, size, name="infinity-aio-vs-fio.dat")
    test_file.prepare()
    if not test_file.direct_io_works():
        raise SystemExit(
            f"{args.path} refuses O_DIRECT; this comparison needs a drive (pass --path on one)"
        )
    print(
        f"aio_vs_fio: {test_file.path} ({measure.format_size(size)}), {repeat} repetition(s), page cache bypassed (O_DIRECT)"
    )
    if not fio_path():
        print(
            "fio is not installed: only infinity's (and DeepSpeed's) figures, no ratios (apt-get install fio)"
        )
    try:
        base = measure.Setting(1 << 20, 32, 1)
        if args.best:
            bs, qd, tc = args.best.split(",")
            best = measure.Setting(measure.parse_size(bs), int(qd), int(tc))
            sweep_note = f"given with --best: {best.label}"
        else:
            grid = [
                measure.Setting(bs, qd, tc)
                for bs in ((1 << 20,) if args.quick else (128 << 10, 1 << 20, 8 << 20))
                for qd in ((8, 32) if args.quick else (8, 32, 64))
                for tc in ((1,) if args.quick else (1, 2))
            ]
            sweep = measure.run_sweep(grid, ["read", "write"], test_file, progress=False)
            best, figures = measure.best(sweep)
            sweep_note = (
                f"best of a {len(grid)}-setting sweep (read+write): {best.label} "
                + ", ".join(f"{k} {v:.2f}" for k, v in figures.items())
            )
        print(f"best setting: {sweep_note}")
        rows = measure_setting(base, test_file, repeat, whole_file=True)
        if best != base:
            rows += measure_setting(best, test_file, repeat, whole_file=False)
    finally:
        test_file.remove()
    print(format_rows(rows))
    if args.markdown:
        print(format_markdown(rows))
    if not shmhuge_fits(1 << 20, 32, 1):
        print(
            "note: fio ran with malloc buffers where the hugetlb pool had no room; set vm.nr_hugepages (root) for the reference figures"
        )
    record = {
        "bench": "aio_vs_fio",
        "mode": "quick" if args.quick else "full",
        "command": " ".join(
            [Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]
        ),
        "machine": measure.machine_info(args.path),
        "file_nbytes": size,
        "repeat": repeat,
        "best_setting": sweep_note,
        "deepspeed": "measured"
        if any(r["contender"].startswith("deepspeed") for r in rows)
        else "not importable",
        "rows": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
