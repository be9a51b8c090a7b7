"""``infinity tune nvme``: finds the fastest aio setting for a drive and writes it into a DeepSpeed config.

The equivalent of DeepSpeed's ``ds_nvme_tune``, minus its trap: that tool writes keys its runtime
ignores (``num_threads``, string booleans). This one writes exactly the keys
``AioConfig.from_dict`` reads, merged into the ``aio`` section of an existing config if there is one.
A sweep at one run per setting picks three candidates; those are re-measured, interleaved, three
times each, and the best read + write median wins.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import Any

from infinity.aio import AioConfig
from infinity.cli import iobench

NAME = "tune"
HELP = (
    "tune: `infinity tune nvme` picks the fastest aio setting and writes it into a DeepSpeed config"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="tune", metavar="TARGET", required=True)
    p = sub.add_parser(
        "nvme",
        help="sweep aio settings on a drive; write the best into ds_config.json's aio section",
    )
    p.add_argument(
        "--path",
        type=Path,
        default=Path("infinity_nvme"),
        help="directory on the drive (default ./infinity_nvme)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("ds_config.json"),
        help="config to write or merge into (default ds_config.json)",
    )
    p.add_argument(
        "--size", type=iobench.size_arg, default="1G", help="test file size (default 1G)"
    )
    p.add_argument("--block-sizes", type=iobench.sizes_arg, default="256K,1M,4M")
    p.add_argument("--queue-depths", type=iobench.ints_arg, default="16,32,64")
    p.add_argument("--threads", type=iobench.ints_arg, default="1,2")
    p.add_argument(
        "--engines",
        type=iobench.names_arg,
        default="auto",
        help="engines to try (auto,io_uring,threads); default auto",
    )
    p.add_argument(
        "--finalists",
        type=int,
        default=3,
        help="candidates re-measured 3x, interleaved (default 3)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def tuned_section(setting: iobench.Setting, engine_used: str) -> dict[str, Any]:
    """The aio section for ``setting``: only keys AioConfig.from_dict reads, booleans as booleans."""
    section = {
        "block_size": setting.block_size,
        "queue_depth": setting.queue_depth,
        "intra_op_parallelism": setting.thread_count,
        "single_submit": setting.single_submit,
        "overlap_events": True,
        # io_uring measured best: keep "auto" so a container that refuses io_uring still runs
        # (on threads, announced) instead of failing.
        "engine": "threads" if engine_used == "threads" else "auto",
    }
    assert set(section) <= set(AioConfig.KEYS)
    return section


def merge_into(out: Path, section: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The config at ``out`` (read leniently, as DeepSpeed does) with its aio section updated.

    Returns the config and the keys dropped from the old aio section because the runtime does not
    read them (or they would contradict the tuned values, like an old ``thread_count``).
    """
    config: dict[str, Any] = {}
    if out.exists():
        import hjson

        try:
            config = dict(hjson.loads(out.read_text()))
        except (hjson.HjsonDecodeError, ValueError) as e:
            raise SystemExit(
                f"{out} is not a JSON config ({e}); fix it or pass another --out"
            ) from None
    old = dict(config.get("aio") or {})
    dropped = sorted(k for k in old if k not in AioConfig.KEYS or k == "thread_count")
    merged = {k: v for k, v in old.items() if k not in dropped}
    merged.update(section)
    AioConfig.from_dict(merged)  # what the runtime will do with it; raises naming the key
    config["aio"] = merged
    return config, dropped


def run(args: argparse.Namespace) -> int:
    settings = [
        iobench.Setting(bs, qd, tc, engine)
        for engine, bs, qd, tc in itertools.product(
            args.engines, args.block_sizes, args.queue_depths, args.threads
        )
    ]
    iobench.check_settings(settings)
    test_file = iobench.TestFile(args.path, args.size, name="infinity-tune-nvme.dat")
    test_file.prepare()
    print(
        f"infinity tune nvme: {test_file.path} ({iobench.format_size(args.size)}), {len(settings)} settings, read and write"
    )
    print(f"page cache: {iobench.page_cache_note(test_file.direct_io_works())}")
    try:
        sweep = iobench.run_sweep(
            settings, ["read", "write"], test_file, progress=not args.quiet, desc="sweep"
        )
        ranked = _rank(sweep)
        finalists = ranked[: max(1, args.finalists)]
        final = iobench.run_sweep(
            finalists,
            ["read", "write"],
            test_file,
            repeat=3,
            progress=not args.quiet,
            desc="finalists",
        )
    finally:
        test_file.remove()
    print(iobench.format_table(final))
    top, figures = iobench.best(final)
    engine_used = next(sm.engine for sm in final if sm.setting == top)
    section = tuned_section(top, engine_used)
    config, dropped = merge_into(args.out, section)
    args.out.write_text(json.dumps(config, indent=2) + "\n")
    print(
        f"best: {top.label} on {engine_used}: read {figures['read']:.2f} GB/s, write {figures['write']:.2f} GB/s"
    )
    if dropped:
        print(
            f"removed from the old aio section (the runtime does not read them): {', '.join(dropped)}"
        )
    print(f"wrote the aio section of {args.out}:")
    print(json.dumps({"aio": section}, indent=2))
    return 0


def _rank(samples: list[iobench.Sample]) -> list[iobench.Setting]:
    totals: dict[iobench.Setting, float] = {}
    for sm in samples:
        totals[sm.setting] = totals.get(sm.setting, 0.0) + sm.median
    return sorted(totals, key=totals.get, reverse=True)  # type: ignore[arg-type]
