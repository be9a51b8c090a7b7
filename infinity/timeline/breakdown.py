"""Where a recorded step went: compute, autograd, exposed read, exposed write, optimizer, other — from
a trace file.

[Note: where the step went]
A step is the interval the trace file's ``infinity.steps`` gives it (from its
first forward to the next step's). Its time is split on the thread that
drives the engine (the track holding the ``phase`` spans), by self time: each
instant belongs to the innermost span open on that thread then —
- a ``compute`` span (a unit's forward, backward or recomputation), or the
  forward or backward phase outside any unit's span: **compute** — but the
  backward phase's own time while no unit's backward is under way (no
  ``compute`` span of phase ``backward``, on any track, covers it) is
  **autograd**: the autograd engine's own work and the backward of modules
  outside every unit (the loss, persistent parameters). A trace with no
  unit's backward span (no stage 3) cannot tell them apart: its backward is
  compute;
- a ``wait`` for a read (a unit not yet read, the scheduler's acquire):
  **exposed read** — the part of the reads compute did not hide;
- a wait for a write or for pool memory (which write-backs free): **exposed write**;
- a wait for the optimizer (the next forward waiting for a unit's update, the
  step waiting for the last one), an Adam sub-group on this thread, or the
  ``step`` phase itself (norm, clipping, launching the update): **optimizer**;
- anything else, and time outside every span (the caller's own code between
  the engine's calls, a lock): **other**.
Work on other threads (the overlapped Adam, reads in flight) costs the step
only where this thread waits for it, which is what the split counts. The
figures sum to the step's wall time by construction.

Imports only the standard library.
"""

from __future__ import annotations

import dataclasses
from typing import Any

PARTS = ("compute", "autograd", "exposed read", "exposed write", "optimizer", "other")

_WAIT_PART = {
    "read": "exposed read",
    "write": "exposed write",
    "pool": "exposed write",
    "optimizer": "optimizer",
}


@dataclasses.dataclass(frozen=True)
class StepBreakdown:
    """One recorded step: wall seconds, seconds per part, and the I/O completed within it."""

    step: int
    wall_s: float
    parts: dict[str, float]
    read_nbytes: int
    write_nbytes: int
    read_busy_s: float
    """Seconds with at least one read in flight (the union of the read spans)."""
    optimizer_io_s: float = 0.0
    """Seconds the optimizer's work waited for reads, writes or pool memory in the step: the waits
    on the tracks that run Adam sub-groups, but the driving thread's only inside a sub-group (its
    other waits are the forward's and backward's). What keeping its state in memory removes."""

    def share(self, part: str) -> float:
        return self.parts[part] / self.wall_s if self.wall_s > 0 else 0.0


def _part(e: dict[str, Any]) -> str:
    cat = e["cat"]
    if cat == "compute":
        return "compute"
    if cat == "phase":
        return "optimizer" if e["name"] == "step" else "compute"
    if cat == "wait":
        return _WAIT_PART.get(e["args"].get("kind", ""), "other")
    if cat == "optimizer":
        return "optimizer"
    return "other"


def driving_track(doc: dict[str, Any]) -> int | None:
    """The tid of the thread that drove the engine (the one with phase spans)."""
    for e in doc["traceEvents"]:
        if e["ph"] == "X" and e["cat"] == "phase":
            return e["tid"]
    return None


def _is_backward(e: dict[str, Any]) -> bool:
    return e["cat"] == "phase" and e["name"] == "backward"


def _self_times(
    spans: list[dict[str, Any]], lo: float, hi: float, units: list[tuple[float, float]] | None
) -> dict[str, float]:
    """Self time per part of properly nested ``spans`` (one thread's), clipped to [lo, hi), in us;
    ``units``: the disjoint, sorted intervals some unit's backward covers (None: no such spans),
    which split the backward phase's self time into compute and autograd."""
    out = dict.fromkeys(PARTS, 0.0)
    clipped = []
    for e in spans:
        a, b = max(e["ts"], lo), min(e["ts"] + e["dur"], hi)
        if b > a:
            clipped.append((a, b, _part(e), units is not None and _is_backward(e)))
    clipped.sort(key=lambda t: (t[0], -t[1]))
    stack: list[list[Any]] = []  # [start, end, part, child time, children (backward phase only)]

    def pop() -> None:
        a, b, part, children, kids = stack.pop()
        mine = (b - a) - children
        if kids is not None and units is not None:
            gaps, at = [], a
            for ka, kb in kids:
                gaps.append((at, ka))
                at = kb
            gaps.append((at, b))
            autograd = sum((y - x) - _overlap_us(units, x, y) for x, y in gaps if y > x)
            out["autograd"] += autograd
            mine -= autograd
        out[part] += mine
        if stack:
            stack[-1][3] += b - a
            if stack[-1][4] is not None:
                stack[-1][4].append((a, b))

    for a, b, part, backward in clipped:
        while stack and stack[-1][1] <= a:
            pop()
        if stack and b > stack[-1][1]:
            b = stack[-1][1]  # a span outliving its parent (clock reads a few ns apart)
        stack.append([a, b, part, 0.0, [] if backward else None])
    while stack:
        pop()
    return out


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``intervals`` as disjoint intervals in order."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _overlap_us(merged: list[tuple[float, float]], lo: float, hi: float) -> float:
    """How much of [lo, hi) the disjoint ``merged`` intervals cover."""
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in merged if a < hi and b > lo)


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _optimizer_waits(spans: list[dict[str, Any]], driver: int | None) -> list[dict[str, Any]]:
    """The I/O waits of the optimizer's work (see ``StepBreakdown.optimizer_io_s``)."""
    adam: dict[int, list[tuple[float, float]]] = {}
    for e in spans:
        if e["cat"] == "optimizer":
            adam.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    out = []
    for e in spans:
        if e["cat"] != "wait" or e["tid"] not in adam:
            continue
        if _WAIT_PART.get(e["args"].get("kind", "")) not in ("exposed read", "exposed write"):
            continue
        a, b = e["ts"], e["ts"] + e["dur"]
        if e["tid"] == driver and not any(x <= a and b <= y for x, y in adam[e["tid"]]):
            continue
        out.append(e)
    return out


def step_breakdowns(doc: dict[str, Any]) -> list[StepBreakdown]:
    """Each recorded step of a trace document, split as [Note: where the step went] says."""
    tid = driving_track(doc)
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    mine = [e for e in spans if e["tid"] == tid]
    unit_backward = [
        (e["ts"], e["ts"] + e["dur"])
        for e in spans
        if e["cat"] == "compute" and e["args"].get("phase") == "backward"
    ]
    units = _merged(unit_backward) if unit_backward else None
    optimizer_waits = _optimizer_waits(spans, tid)
    out = []
    for s in doc["infinity"]["steps"]:
        lo, hi = s["begin"], s["end"]
        parts = _self_times(mine, lo, hi, units)
        wall = hi - lo
        parts["other"] += wall - sum(parts.values())
        ended = [
            e for e in spans if e["cat"] in ("read", "write") and lo <= e["ts"] + e["dur"] < hi
        ]
        reads = [e for e in ended if e["cat"] == "read"]
        waited: dict[int, list[tuple[float, float]]] = {}
        for e in optimizer_waits:
            a, b = max(e["ts"], lo), min(e["ts"] + e["dur"], hi)
            if b > a:
                waited.setdefault(e["tid"], []).append((a, b))
        out.append(
            StepBreakdown(
                step=s["step"],
                wall_s=wall / 1e6,
                parts={k: v / 1e6 for k, v in parts.items()},
                read_nbytes=sum(e["args"]["bytes"] for e in reads),
                write_nbytes=sum(e["args"]["bytes"] for e in ended if e["cat"] == "write"),
                read_busy_s=_union_us([(e["ts"], e["ts"] + e["dur"]) for e in reads]) / 1e6,
                optimizer_io_s=sum(_union_us(w) for w in waited.values()) / 1e6,
            )
        )
    return out


def mean_breakdown(steps: list[StepBreakdown]) -> StepBreakdown:
    """The steps' mean (step: the first one's index)."""
    if not steps:
        raise ValueError("the trace holds no recorded step")
    n = len(steps)
    return StepBreakdown(
        step=steps[0].step,
        wall_s=sum(s.wall_s for s in steps) / n,
        parts={p: sum(s.parts[p] for s in steps) / n for p in PARTS},
        read_nbytes=sum(s.read_nbytes for s in steps) // n,
        write_nbytes=sum(s.write_nbytes for s in steps) // n,
        read_busy_s=sum(s.read_busy_s for s in steps) / n,
        optimizer_io_s=sum(s.optimizer_io_s for s in steps) / n,
    )
