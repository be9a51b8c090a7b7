"""``infinity tune nvme``: finds the fastest aio setting for a drive and writes it into a DeepSpeed config.

The equivalent of DeepSpeed's ``ds_nvme_tune``, minus its trap: that tool writes keys its runtime
ignores (``num_threads``, string booleans). This one writes exactly the keys
``AioConfig.from_dict`` reads, merged into the ``aio`` section of an existing config if there is one.
A sweep at one run per setting picks three candidates; those are re-measured, interleaved, three
times each, and the best read + write median wins.

Given several paths (the folders an ``nvme_path`` list names, one per drive), the sweep and the
finalists run on the stripe over all of them, laid out as the runtime stripes its swap space (the
stripe unit is the block size); the winner is then measured on each path alone, so the output
says what each drive gives and what the stripe adds (a stripe runs at the pace of its slowest drive).
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import Any

from infinity import measure
from infinity.aio import AioConfig

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
        nargs="+",
        default=[Path("infinity_nvme")],
        help="directory on the drive (default ./infinity_nvme); several, one per drive, as nvme_path "
        "lists them: tuned on the stripe over all, then each measured alone",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("ds_config.json"),
        help="config to write or merge into (default ds_config.json)",
    )
    p.add_argument(
        "--size", type=measure.size_arg, default="1G", help="test file size, per path (default 1G)"
    )
    p.add_argument("--block-sizes", type=measure.sizes_arg, default="256K,1M,4M")
    p.add_argument("--queue-depths", type=measure.ints_arg, default="16,32,64")
    p.add_argument("--threads", type=measure.ints_arg, default="1,2")
    p.add_argument(
        "--engines",
        type=measure.names_arg,
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


def tuned_section(setting: measure.Setting, engine_used: str) -> dict[str, Any]:
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
        measure.Setting(bs, qd, tc, engine)
        for engine, bs, qd, tc in itertools.product(
            args.engines, args.block_sizes, args.queue_depths, args.threads
        )
    ]
    measure.check_settings(settings)
    targets = measure.targets(args.path, args.size, "infinity-tune-nvme.dat")
    label, tuned = targets[-1]  # the one path, or the stripe over all of them
    for _, t in targets:
        t.prepare()
    where = (
        f"{tuned.path} ({measure.format_size(args.size)})"
        if not label
        else f"the stripe over {len(args.path)} paths ({measure.format_size(args.size)} each), then each alone"
    )
    print(f"infinity tune nvme: {where}, {len(settings)} settings, read and write")
    for group in measure.shared_file_systems(args.path) if label else ():
        print(
            f"note: {' and '.join(map(str, group))} are on one file system: striping over them adds no bandwidth"
        )
    print(f"page cache: {measure.page_cache_note(all(t.direct_io_works() for _, t in targets))}")
    alone: list[measure.Sample] = []
    try:
        sweep = measure.run_sweep(
            settings, ["read", "write"], tuned, progress=not args.quiet, desc="sweep", target=label
        )
        finalists = _rank(sweep)[: max(1, args.finalists)]
        final = measure.run_sweep(
            finalists,
            ["read", "write"],
            tuned,
            repeat=3,
            progress=not args.quiet,
            desc="finalists",
            target=label,
        )
        top, figures = measure.best(final)
        for path_label, t in targets[:-1]:
            alone += measure.run_sweep(
                [top], ["read", "write"], t, repeat=3, progress=not args.quiet, desc=path_label,
                target=path_label,
            )  # fmt: skip
    finally:
        for _, t in targets:
            t.remove()
    print(measure.format_table(final + alone))
    engine_used = next(sm.engine for sm in final if sm.setting == top)
    section = tuned_section(top, engine_used)
    config, dropped = merge_into(args.out, section)
    args.out.write_text(json.dumps(config, indent=2) + "\n")
    print(
        f"best: {top.label} on {engine_used}{' (stripe)' if label else ''}: read {figures['read']:.2f} GB/s, "
        f"write {figures['write']:.2f} GB/s"
    )
    if alone:
        print(_stripe_gain(figures, alone))
    if dropped:
        print(
            f"removed from the old aio section (the runtime does not read them): {', '.join(dropped)}"
        )
    print(f"wrote the aio section of {args.out}:")
    print(json.dumps({"aio": section}, indent=2))
    if label:
        paths = json.dumps([str(p) for p in args.path])
        print(
            f'stripe over these drives with "nvme_path": {paths} in offload_param and offload_optimizer'
        )
    return 0


def _stripe_gain(stripe: dict[str, float], alone: list[measure.Sample]) -> str:
    """The stripe against its drives: x the best one alone, and the share of their sum it reaches."""
    parts = []
    for op in ("read", "write"):
        each = [sm.median for sm in alone if sm.op == op]
        parts.append(
            f"{op} {stripe[op]:.2f} GB/s = {stripe[op] / max(each):.2f}x the fastest path alone, "
            f"{stripe[op] / sum(each):.0%} of the paths' sum ({sum(each):.2f} GB/s)"
        )
    return "stripe: " + "; ".join(parts)


def _rank(samples: list[measure.Sample]) -> list[measure.Setting]:
    totals: dict[measure.Setting, float] = {}
    for sm in samples:
        totals[sm.setting] = totals.get(sm.setting, 0.0) + sm.median
    return sorted(totals, key=totals.get, reverse=True)  # type: ignore[arg-type]
