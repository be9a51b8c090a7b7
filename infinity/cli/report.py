"""``infinity report TRACE``: where a traced step went, and the one change that would help most.

TRACE is a file a run wrote with the ``trace`` section or ``INFINITY_TRACE``
(docs/tracing.md). The split of the step is [Note: where the step went] in
infinity/timeline/breakdown.py; the advice is [Note: advice from the figures]
in infinity/timeline/advice.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from infinity.timeline import read_trace
from infinity.timeline.advice import advise
from infinity.timeline.breakdown import PARTS, StepBreakdown, mean_breakdown, step_breakdowns

NAME = "report"
HELP = (
    "report: where a traced step's time went (compute, exposed I/O, optimizer) and what to change"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "trace", type=Path, help="a trace file written by a run (trace.output_path)"
    )


def describe(steps: list[StepBreakdown], plan: dict) -> list[str]:
    """The report's lines: one row per step, the mean, and the advice."""
    lines = [
        f"{'step':>6} {'wall s':>8} "
        + " ".join(f"{p:>14}" for p in PARTS)
        + f" {'read GB/s':>10} {'NVMe MB r/w':>14}"
    ]

    def row(label: str, s: StepBreakdown) -> str:
        rate = s.read_nbytes / s.read_busy_s / 1e9 if s.read_busy_s > 0 else 0.0
        cells = " ".join(f"{s.parts[p]:>7.3f} ({s.share(p):>3.0%})" for p in PARTS)
        io = f"{s.read_nbytes / 1e6:.1f}/{s.write_nbytes / 1e6:.1f}"
        return f"{label:>6} {s.wall_s:>8.3f} {cells} {rate:>10.2f} {io:>14}"

    for s in steps:
        lines.append(row(str(s.step), s))
    mean = mean_breakdown(steps)
    if len(steps) > 1:
        lines.append(row("mean", mean))
    lines.append("")
    lines.append(advise(mean, plan))
    return lines


def run(args: argparse.Namespace) -> int:
    try:
        doc = read_trace(args.trace)
        steps = step_breakdowns(doc)
        if not steps:
            raise ValueError(f"{args.trace} holds no recorded step")
    except (OSError, ValueError) as e:
        print(f"infinity report: {e}", file=sys.stderr)
        return 2
    print(f"{args.trace}: {len(steps)} recorded step(s)")
    print("\n".join(describe(steps, doc["infinity"].get("plan", {}))))
    return 0
