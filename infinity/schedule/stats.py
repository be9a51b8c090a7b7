"""StepStats and SchedulerStats: what the scheduler did in each step, and in all of them.

Counted by the scheduler itself, under its lock, at the events that cause
them (cheap enough to leave on):
- each ``acquire`` is one of: a *prefetch hit* (prefetched and already
  resident), a *late prefetch* (prefetched, read still in flight: the caller
  waited), a *reuse hit* (kept or already held) or *on demand* (the caller's
  own fetch: step 0, a divergence, or a prefetch the budgets did not allow);
- ``stall_s`` is the time callers spent inside ``acquire`` (waiting for data,
  plus the scheduler's bookkeeping), ``demand_pool_wait_s`` the part spent
  in the store waiting for pool memory;
- ``reads`` / ``read_nbytes`` count the fetches of ours that found the key at
  rest, i.e. that read it from NVMe; ``rereads`` those of a key read earlier in
  the same step (a unit used twice whose reuse the memory could not keep);
  ``duplicate_reads`` those of a key whose earlier read in the step was never
  used (fetched, then dropped unused): wasted I/O, 0 on a replayed trace;
- ``pool_deferrals``: prefetches postponed because the pool had no room even
  after evicting idle cache entries (the scheduler retries at the next event,
  it never waits in the pool for speculative work); ``pressure_drops``: holds
  given up so that an on-demand fetch could get pool memory; ``reclaimed``:
  holds given up because someone else waited for pool memory.

Threading: StepCounters is mutated under the scheduler lock; the snapshots
are immutable.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class StepStats:
    step: int
    """Index of the step (0 = the first begin_step)."""
    kind: str
    """recorded | replayed | short | diverged | aborted (see StepKind)."""
    uses: int
    prefetch_hits: int
    late_prefetches: int
    reuse_hits: int
    on_demand: int
    stall_s: float
    demand_pool_wait_s: float
    reads: int
    read_nbytes: int
    rereads: int
    duplicate_reads: int
    prefetches: int
    """Prefetch fetches issued."""
    dropped_prefetches: int
    """Prefetched units released unused (divergence, a short step, pool pressure)."""
    dropped_nbytes: int
    kept: int
    """Releases that kept the unit for a reuse within the distance."""
    displaced: int
    """Kept units released early to make room for a unit needed sooner."""
    peak_live_nbytes: int
    peak_ahead_nbytes: int
    over_budget_demands: int
    """On-demand fetches served although the callers' own holds exceed max_live (see [Note: budgets])."""
    pool_deferrals: int
    pool_evictions: int
    """Idle cache entries the scheduler evicted to make pool room for a prefetch."""
    pressure_drops: int
    reclaimed: int
    """Holds given up because another pool user (the optimizer, a write) waited for memory."""
    not_ready: int
    """Times the lookahead stopped at a unit ``ready`` did not allow yet."""
    prefetch_errors: int
    """Prefetch fetches the store refused at once (the error is raised at the key's acquire)."""
    divergence_pos: int | None
    """Position in the trace of the first use that matched no known trace."""
    trace_switches: int
    wall_s: float

    @property
    def hit_rate(self) -> float:
        """Uses served without an on-demand fetch, as a fraction of all uses."""
        return 1.0 - self.on_demand / self.uses if self.uses else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "hit_rate": self.hit_rate}


_SUMMED = [
    f.name
    for f in dataclasses.fields(StepStats)
    if f.name not in ("step", "kind", "divergence_pos", "peak_live_nbytes", "peak_ahead_nbytes")
]


class StepCounters:
    """The running counts of the open step."""

    def __init__(self, step: int, t0: float):
        self.step = step
        self.t0 = t0
        self.n: dict[str, Any] = {name: 0 for name in _SUMMED}
        self.n["stall_s"] = 0.0
        self.n["demand_pool_wait_s"] = 0.0
        self.peak_live_nbytes = 0
        self.peak_ahead_nbytes = 0
        self.divergence_pos: int | None = None

    def add(self, name: str, value: float = 1) -> None:
        self.n[name] += value

    def peaks(self, live: int, ahead: int) -> None:
        if live > self.peak_live_nbytes:
            self.peak_live_nbytes = live
        if ahead > self.peak_ahead_nbytes:
            self.peak_ahead_nbytes = ahead

    def snapshot(self, kind: str, now: float) -> StepStats:
        n = dict(self.n)
        n["wall_s"] = now - self.t0
        return StepStats(
            step=self.step,
            kind=kind,
            divergence_pos=self.divergence_pos,
            peak_live_nbytes=self.peak_live_nbytes,
            peak_ahead_nbytes=self.peak_ahead_nbytes,
            **n,
        )


def total(steps: list[StepStats]) -> StepStats:
    """The sums over ``steps`` (peaks: the maximum); kind 'total'."""
    n: dict[str, Any] = {name: sum(getattr(s, name) for s in steps) for name in _SUMMED}
    return StepStats(
        step=len(steps),
        kind="total",
        divergence_pos=None,
        peak_live_nbytes=max((s.peak_live_nbytes for s in steps), default=0),
        peak_ahead_nbytes=max((s.peak_ahead_nbytes for s in steps), default=0),
        **n,
    )


@dataclasses.dataclass(frozen=True)
class SchedulerStats:
    name: str
    steps: int
    """Steps ended (end_step or abort_step)."""
    last: StepStats | None
    """The last ended step."""
    history: tuple[StepStats, ...]
    """The most recent ended steps (oldest first)."""
    total: StepStats
    """Sums over every ended step, plus untraced uses (outside begin_step/end_step)."""
    live_nbytes: int
    in_use_nbytes: int
    ahead_nbytes: int
    traces: int
    """Known traces (see [Note: divergence])."""
    untraced_uses: int
    """acquire calls outside a step (served on demand, not traced)."""

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["last"] = None if self.last is None else self.last.as_dict()
        d["history"] = [s.as_dict() for s in self.history]
        d["total"] = self.total.as_dict()
        return d
