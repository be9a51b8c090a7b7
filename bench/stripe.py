#!/usr/bin/env python3
"""Reads and writes striped over two drives against one, each against fio, interleaved.

The runtime stripes each rank's swap space over the folders an ``nvme_path`` list names
([Note: striping] in infinity/store/swapspace.py). This bench measures what that layout gets from
the drives, the way ``infinity bench aio`` does (one vectored request through a ring of
queue_depth x block_size bytes, O_DIRECT): per direction, these contenders run back to back
``--repeat`` times, the order rotated each repetition:

  infinity path0 / path1   the aio engine on one drive's test file alone
  fio path0 / path1        fio (io_uring, direct=1, huge-page buffers) on that file: the drive's limit
  infinity stripe          the engine on both files as one striped space: block-sized pieces going
                           round the drives, as the store lays out its swap files; its queue_depth is
                           the handle's, shared by the drives
  infinity stripe 2x qd    the same at twice the queue depth: each drive as deep as in fio's run
  fio both at once         one fio job per file, both running together, bandwidth summed: the
                           aggregate limit of the two drives
  fio backing disk         (loop-mounted drives only) fio on a file of the file system that holds
                           the two images: the one disk both drives are made of

Reported: GB/s median (min-max); each infinity figure's ratio to its fio reference (per
repetition, each pair measured in the same rotation); and the stripe's gain, its GB/s over the
faster single path (per repetition), next to fio's (fio both at once over the faster fio path).

Drives: ``--paths A B`` (directories on two drives), or by default two ext4 file systems made here
from 2 GiB images (256 MiB with --quick), loop-mounted with the loop device in direct-I/O mode so
the page cache of the images does not serve reads (root; where it cannot mount, two folders of the
working directory, which share one drive, and the result says so). On a VM whose images live on one
virtual disk the aggregate cannot exceed that disk: compare "fio both at once" with "fio backing disk".

    python bench/stripe.py                  # 1 GiB per drive, 1M qd32, 3 repetitions
    python bench/stripe.py --quick          # smoke run in seconds
    python bench/stripe.py --paths /mnt/nvme0/swap /mnt/nvme1/swap --markdown

Results go to $INFINITY_BENCH_RESULTS or bench/results/ as JSON (stripe[-quick].json).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from infinity import measure
from infinity.measure import FioError, fio_path

ROOT = Path(__file__).resolve().parent
SINGLE = ("path0", "path1")
REFERENCE = {
    "infinity path0": "fio path0",
    "infinity path1": "fio path1",
    "infinity stripe": "fio both at once",
    "infinity stripe 2x qd": "fio both at once",
}
STRIPES = ("infinity stripe", "infinity stripe 2x qd")
FIO_BUFFERS: set[str] = set()
"""The buffers fio's jobs were given: shmhuge (2 MiB pages of the hugetlb pool) or malloc."""


def _sh(*argv: str) -> str:
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode != 0:
        raise OSError(f"{' '.join(argv)}: {(r.stderr or r.stdout).strip()}")
    return r.stdout.strip()


@contextlib.contextmanager
def loop_drives(work: Path, image_nbytes: int) -> Iterator[tuple[list[Path], str]]:
    """Two ext4 file systems from images under ``work``, loop-mounted with direct I/O; else two folders."""
    made: list[tuple[Path, str, Path]] = []  # (mount point, loop device, image)
    try:
        if os.geteuid() != 0:
            raise OSError(f"mounting needs root (uid {os.geteuid()})")
        for tool in ("losetup", "mkfs.ext4", "mount"):
            if shutil.which(tool) is None:
                raise OSError(f"{tool} is not installed")
        for i in range(2):
            image, mnt = work / f"drive{i}.img", work / f"drive{i}"
            with open(image, "wb") as f:
                f.truncate(image_nbytes)
            _sh("mkfs.ext4", "-q", "-F", "-b", "4096", str(image))
            dev = _sh("losetup", "--find", "--show", "--direct-io=on", str(image))
            mnt.mkdir()
            made.append((mnt, dev, image))
            _sh("mount", dev, str(mnt))
        yield [m for m, _, _ in made], "two ext4 images, loop-mounted (loop direct I/O on)"
    except OSError as e:
        if made:
            raise
        paths = [work / "drive0", work / "drive1"]
        for p in paths:
            p.mkdir()
        yield paths, f"two folders of one file system (could not loop-mount: {e})"
    finally:
        for mnt, dev, image in reversed(made):
            subprocess.run(["umount", str(mnt)], capture_output=True)
            subprocess.run(["losetup", "-d", dev], capture_output=True)
            image.unlink(missing_ok=True)


def contenders(
    setting: measure.Setting,
    files: list[measure.TestFile],
    stripe: measure.Stripe,
    backing: measure.TestFile | None,
    op: measure.Op,
) -> dict[str, Callable[[], float]]:
    def ours(target: measure.Target, depth: int = 1) -> Callable[[], float]:
        s = dataclasses.replace(setting, queue_depth=setting.queue_depth * depth)
        return lambda: measure.measure_once(s, target, op)[0]

    def fio(target: measure.Target) -> Callable[[], float]:
        job = measure.fio_job(
            setting, target, op, "shmhuge", direct=True
        )  # malloc where the pool is short
        FIO_BUFFERS.add(job.iomem)
        return functools.partial(_fio_run, job)

    out: dict[str, Callable[[], float]] = {}
    for name, f in zip(SINGLE, files, strict=True):
        out[f"infinity {name}"] = ours(f)
        if fio_path():
            out[f"fio {name}"] = fio(f)
    out["infinity stripe"] = ours(stripe)
    out["infinity stripe 2x qd"] = ours(stripe, 2)
    if fio_path():
        out["fio both at once"] = fio(stripe)
        if backing is not None:
            out["fio backing disk"] = fio(backing)
    return out


def _fio_run(job, tries: int = 5) -> float:
    """job.run(), tried again a few seconds later while the hugetlb pool is empty: other processes on a
    shared host take its pages for a while (infinity's own buffers try 2 MiB pages first)."""
    for _ in range(tries - 1):
        try:
            return job.run()
        except FioError as e:
            if "no huge pages available" not in str(e):
                raise
            print(
                f"note: {job.op} on {len(job.paths)} file(s): the hugetlb pool was empty; fio tries again",
                file=sys.stderr,
            )
            time.sleep(2)
    return job.run()


def _stats(xs: list[float]) -> dict:
    return {
        "median": round(statistics.median(xs), 3),
        "min": round(min(xs), 3),
        "max": round(max(xs), 3),
        "runs": [round(x, 3) for x in xs],
    }


def measure_op(setting, files, stripe, backing, op, repeat: int) -> tuple[list[dict], dict]:
    runs = contenders(setting, files, stripe, backing, op)
    results: dict[str, list[float]] = {name: [] for name in runs}
    for fn in runs.values():  # warm-up, not measured
        fn()
    names = list(runs)
    for rep in range(repeat):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            try:
                results[name].append(runs[name]())
            except (FioError, RuntimeError, OSError) as e:
                raise SystemExit(f"{name} at {setting.label} {op}: {e}") from None
            gc.collect()
    rows = []
    for name, xs in results.items():
        row = {"setting": setting.label, "op": op, "contender": name, "gbps": _stats(xs)}
        ref = results.get(REFERENCE.get(name, ""))
        if ref:
            row["ratio_to_fio"] = _stats([a / b for a, b in zip(xs, ref, strict=True)])
            row["fio_reference"] = REFERENCE[name]
        rows.append(row)
    gains = {
        name: _stats(
            [
                s / max(a, b)
                for s, a, b in zip(
                    results[name], results["infinity path0"], results["infinity path1"], strict=True
                )
            ]
        )
        for name in STRIPES
    }
    if "fio both at once" in results:
        gains["fio"] = _stats(
            [
                s / max(a, b)
                for s, a, b in zip(
                    results["fio both at once"],
                    results["fio path0"],
                    results["fio path1"],
                    strict=True,
                )
            ]
        )
    return rows, gains


def format_rows(rows: list[dict], gains: dict) -> str:
    lines = [
        f"{'op':<5} {'contender':<22} {'GB/s median (min-max)':>22}  {'/ fio (median, min-max)':>24}"
    ]
    for r in rows:
        g = r["gbps"]
        q = r.get("ratio_to_fio")
        ratio = (
            f"{q['median']:.2f} ({q['min']:.2f}-{q['max']:.2f}) of {r['fio_reference']}"
            if q
            else ""
        )
        lines.append(
            f"{r['op']:<5} {r['contender']:<22} {g['median']:>6.2f} ({g['min']:.2f}-{g['max']:.2f}){'':>8}  {ratio}"
        )
    for op, g in gains.items():
        text = "; ".join(
            f"{who} {s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f})" for who, s in g.items()
        )
        lines.append(f"{op}: stripe over 2 drives / faster single drive: {text}")
    return "\n".join(lines)


def format_markdown(rows: list[dict], gains: dict) -> str:
    """docs/benchmarks.md's table: per direction, GB/s median (min–max) and, for ours, the ratio to fio."""
    names = list(dict.fromkeys(r["contender"] for r in rows))
    lines = [
        "| | " + " | ".join(names) + " | stripe / faster single path: infinity, 2x qd, fio |",
        "|---" * (len(names) + 2) + "|",
    ]
    for op in dict.fromkeys(r["op"] for r in rows):
        cells = []
        for name in names:
            r = next(r for r in rows if r["op"] == op and r["contender"] == name)
            g, q = r["gbps"], r.get("ratio_to_fio")
            cells.append(
                f"{g['median']:.2f} ({g['min']:.2f}–{g['max']:.2f})"
                + (f": {q['median']:.2f}×" if q else "")
            )
        gain = gains[op]
        cells.append(
            " / ".join(f"{gain[w]['median']:.2f}×" for w in (*STRIPES, "fio") if w in gain)
        )
        lines.append(f"| {op} {rows[0]['setting']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--paths",
        type=Path,
        nargs=2,
        metavar=("PATH0", "PATH1"),
        help="directories on two drives (default: two loop-mounted ext4 images under --work)",
    )
    p.add_argument(
        "--work",
        type=Path,
        default=Path("infinity_nvme"),
        help="where the images (and the backing-disk file) go (default ./infinity_nvme)",
    )
    p.add_argument(
        "--size",
        type=measure.parse_size,
        default=None,
        help="test file per drive (default 1G; 64M with --quick)",
    )
    p.add_argument(
        "--setting", default=None, help="BS,QD,THREADS (default 1M,32,1; 1M,8,1 with --quick)"
    )
    p.add_argument(
        "--repeat", type=int, default=None, help="repetitions (default 3; 1 with --quick)"
    )
    p.add_argument("--quick", action="store_true", help="smoke run in seconds")
    p.add_argument("--markdown", action="store_true", help="also print docs/benchmarks.md's table")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON output (default $INFINITY_BENCH_RESULTS or bench/results)",
    )
    args = p.parse_args(argv)
    size = args.size or measure.parse_size("64M" if args.quick else "1G")
    repeat = args.repeat or (1 if args.quick else 3)
    bs, qd, tc = (args.setting or ("1M,8,1" if args.quick else "1M,32,1")).split(",")
    setting = measure.Setting(measure.parse_size(bs), int(qd), int(tc))
    measure.check_settings([setting])
    results = Path(os.environ.get("INFINITY_BENCH_RESULTS", ROOT / "results"))
    out = args.out or results / f"stripe{'-quick' if args.quick else ''}.json"
    if not fio_path():
        print("fio is not installed: only infinity's figures, no ratios (apt-get install fio)")
    work = args.work / f"bench-stripe-{os.getpid()}"
    work.mkdir(parents=True)
    try:
        with contextlib.ExitStack() as stack:
            if args.paths:
                paths, drives = list(args.paths), "given with --paths"
            else:
                paths, drives = stack.enter_context(
                    loop_drives(work, max(4 * size, 2 * size + (128 << 20)))
                )
            shared = measure.shared_file_systems(paths)
            files = [measure.TestFile(d, size, name="infinity-stripe.dat") for d in paths]
            stripe = measure.Stripe(files)
            backing = (
                measure.TestFile(work, size, name="infinity-backing.dat")
                if "loop-mounted" in drives
                else None
            )
            targets = [*files, *([backing] if backing else [])]
            try:
                for t in targets:
                    t.prepare()
                if not all(t.direct_io_works() for t in targets):
                    raise SystemExit(
                        f"{', '.join(map(str, paths))}: O_DIRECT is refused; this bench needs drives"
                    )
                print(
                    f"stripe bench: {drives}: {', '.join(map(str, paths))}; {measure.format_size(size)} per drive, "
                    f"{setting.label}, {repeat} repetition(s), O_DIRECT"
                )
                if shared:
                    print(
                        "note: both paths are on one file system: the stripe cannot add bandwidth there"
                    )
                rows, gains = [], {}
                for op in ("read", "write"):
                    r, g = measure_op(setting, files, stripe, backing, op, repeat)
                    rows += r
                    gains[op] = g
                machine = measure.machine_info(paths)
            finally:
                for t in targets:
                    t.remove()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(format_rows(rows, gains))
    if args.markdown:
        print(format_markdown(rows, gains))
    if "malloc" in FIO_BUFFERS:
        print(
            "note: fio ran with malloc buffers (the hugetlb pool had no room): its figures are below the disk's "
            "limit; set vm.nr_hugepages (root) for the reference figures"
        )
    record = {
        "bench": "stripe",
        "mode": "quick" if args.quick else "full",
        "command": " ".join(
            [Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]
        ),
        "drives": drives,
        "paths_share_a_file_system": bool(shared),
        "machine": machine,
        "file_nbytes_per_drive": size,
        "setting": setting.label,
        "repeat": repeat,
        "fio_buffers": sorted(FIO_BUFFERS),
        "rows": rows,
        "stripe_gain": gains,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
