"""``infinity bench aio``: the aio throughput sweep (DeepSpeed's ds_io / aio_bench_perf_sweep).

A table of GB/s per setting (block size x queue depth x threads), progress while it runs, the page
cache defeated and said so, and with ``--vs-fio`` the same setting run by fio right after each of
ours, with the ratio. Given several paths (one per drive) it measures each alone and then the stripe
over all of them, laid out as a store striped over those drives lays out its swap space; fio's
figure for the stripe is one job per file, all at once (the drives' aggregate limit).
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

from infinity import host, measure

NAME = "bench"
HELP = "measure: `infinity bench aio` sweeps the NVMe I/O engine's settings"

DEFAULT_PATH = Path("infinity_nvme")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    p = sub.add_parser(
        "aio", help="read/write GB/s of the async I/O engine per setting, optionally vs fio"
    )
    add_aio_arguments(p)


def add_aio_arguments(p: argparse.ArgumentParser, *, size: str = "2G") -> None:
    p.add_argument(
        "--path",
        type=Path,
        nargs="+",
        default=[DEFAULT_PATH],
        help="directory on the drive to measure (default ./infinity_nvme); several, one per drive: "
        "each alone, then the stripe over all",
    )
    p.add_argument(
        "--size",
        type=measure.size_arg,
        default=measure.parse_size(size),
        help=f"test file size, per path (default {size})",
    )
    p.add_argument(
        "--block-sizes", type=measure.sizes_arg, default="128K,1M,8M", help="default 128K,1M,8M"
    )
    p.add_argument(
        "--queue-depths", type=measure.ints_arg, default="8,32,64", help="default 8,32,64"
    )
    p.add_argument(
        "--threads",
        type=measure.ints_arg,
        default="1,2",
        help="workers per handle (intra_op_parallelism), default 1,2",
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument("--read", action="store_true", help="reads only")
    which.add_argument("--write", action="store_true", help="writes only")
    p.add_argument("--engine", choices=["auto", "io_uring", "threads"], default="auto")
    p.add_argument(
        "--repeat", type=int, default=None, help="runs per setting (default 1, or 3 with --vs-fio)"
    )
    p.add_argument(
        "--vs-fio",
        action="store_true",
        help="run fio (io_uring, direct, huge-page buffers) after each of our runs",
    )
    p.add_argument(
        "--json",
        type=Path,
        metavar="OUT.json",
        help="write the results (with machine and versions) here",
    )
    p.add_argument("--plot", type=Path, metavar="OUT.png", help="bar chart of the results")
    p.add_argument(
        "--keep", action="store_true", help="keep the test file (default: delete it at the end)"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    ops: list[measure.Op] = (
        ["read"] if args.read else ["write"] if args.write else ["read", "write"]
    )
    settings = [
        measure.Setting(bs, qd, tc, args.engine)
        for bs, qd, tc in itertools.product(args.block_sizes, args.queue_depths, args.threads)
    ]
    repeat = args.repeat or (3 if args.vs_fio else 1)
    if args.vs_fio and measure.fio_path() is None:
        raise SystemExit("--vs-fio needs fio, which is not installed (Debian: apt-get install fio)")
    measure.check_settings(settings)
    targets = measure.targets(args.path, args.size, "infinity-bench-aio.dat")
    for _, t in targets:
        t.prepare()
    direct = all(t.direct_io_works() for _, t in targets)
    what = (
        f"{targets[0][1].path} ({measure.format_size(args.size)})"
        if len(targets) == 1
        else f"{len(args.path)} paths, each alone and the stripe over all ({measure.format_size(args.size)} "
        "per path; stripe unit = block size)"
    )
    print(
        f"infinity bench aio: {what}, {len(settings)} settings x {', '.join(ops)}, {repeat} run(s) each"
    )
    for group in measure.shared_file_systems(args.path) if len(targets) > 1 else ():
        print(
            f"note: {' and '.join(map(str, group))} are on one file system: the stripe shares its bandwidth"
        )
    print(f"page cache: {measure.page_cache_note(direct)}")
    print(
        "buffers: a ring of queue_depth x block_size x threads bytes per setting (the memory fio cycles through)"
    )
    if args.vs_fio:
        print(
            f"fio: io_uring, direct={int(direct)}, --iomem=shmhuge where the hugetlb pool has room ({host.hugetlb_free_nbytes() >> 20} MiB free), else malloc; run right after each of ours"
            + ("; on the stripe one job per file, all at once" if len(targets) > 1 else "")
        )
    samples: list[measure.Sample] = []
    try:
        for label, target in targets:
            samples += measure.run_sweep(
                settings,
                ops,
                target,
                repeat=repeat,
                fio_iomem="shmhuge" if args.vs_fio else None,
                progress=not args.quiet,
                desc=f"bench aio {label}".rstrip(),
                target=label,
            )
    finally:
        if not args.keep:
            for _, t in targets:
                t.remove()
    engines = sorted({sm.engine for sm in samples})
    print(f"engine: {', '.join(engines)}")
    huge = min(sm.huge_fraction for sm in samples)
    print(
        f"2 MiB pages back {huge:.0%} of the buffers"
        + (
            ""
            if huge > 0.99
            else " (enable THP or vm.nr_hugepages: 4 KiB pages cap the request size)"
        )
    )
    print(measure.format_table(samples))
    final = targets[-1][0]  # the one path, or the stripe
    top, figures = measure.best([sm for sm in samples if sm.target == final])
    print(
        f"best{' (stripe)' if final else ''}: "
        + top.label
        + " ("
        + ", ".join(f"{op} {v:.2f} GB/s" for op, v in figures.items())
        + ")"
    )
    if args.json:
        record = {
            "command": "infinity bench aio",
            "machine": measure.machine_info(args.path),
            "file_nbytes": args.size,
            "page_cache": measure.page_cache_note(direct),
            "repeat": repeat,
            "results": [sm.to_dict() for sm in samples],
            "best": {**top.__dict__, **figures},
        }
        args.json.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        where = targets[0][1].path.parent if len(targets) == 1 else ", ".join(map(str, args.path))
        measure.plot(samples, args.plot, f"infinity bench aio: {where} ({', '.join(engines)})")
        print(f"wrote {args.plot}")
    return 0
