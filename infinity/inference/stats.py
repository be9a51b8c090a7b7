"""InferenceStats: what the prefetch scheduler and the store did over a run of forwards (or one generate).

One forward of the model is one prefetch step (see [Note: one decode step,
one trace step] in engine.py): the scheduler records the first and replays
it for every later one, so a generation of N tokens is 1 recorded step (the
first forward the engine ever ran) and replayed steps after it, each served
from reads issued ahead of use (``prefetch_hits``) rather than on demand.
The figures are differences of the scheduler's and the store's running
totals between two moments, so they cover exactly the calls in between.

Threading: built by the thread that runs the engine.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

STEP_KINDS = ("recorded", "replayed", "short", "diverged", "aborted")


@dataclasses.dataclass(frozen=True)
class InferenceStats:
    forwards: int
    """Forwards of the model (prefill and decode steps alike)."""
    steps: dict[str, int]
    """Forwards by how the prefetch trace went: recorded, replayed, short, diverged, aborted."""
    uses: int
    """Unit fetches the forwards asked for."""
    prefetch_hits: int
    """Fetches served by a read issued ahead of use that had already arrived."""
    late_prefetches: int
    """Fetches served by a read issued ahead of use that was still in flight (the forward waited for the rest)."""
    reuse_hits: int
    """Fetches of a unit still held from an earlier use."""
    on_demand: int
    """Fetches read when asked for (the first forward, a divergence, budgets too small to read ahead)."""
    stall_s: float
    """Seconds the forwards spent waiting for units (I/O and the scheduler's bookkeeping)."""
    read_nbytes: int
    """Bytes the parameter store read from NVMe."""
    wall_s: float
    tokens: int = 0
    """New tokens generated (generate only: batch × new positions)."""

    @property
    def replayed_steps(self) -> int:
        return self.steps.get("replayed", 0)

    @property
    def hit_rate(self) -> float:
        """Fetches served without an on-demand read, as a fraction of all."""
        return 1.0 - self.on_demand / self.uses if self.uses else 0.0

    @property
    def read_gbps(self) -> float:
        return self.read_nbytes / self.wall_s / 1e9 if self.wall_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self),
            "replayed_steps": self.replayed_steps,
            "hit_rate": self.hit_rate,
            "read_gbps": self.read_gbps,
            "tokens_per_s": self.tokens_per_s,
        }

    def summary(self) -> str:
        kinds = ", ".join(f"{n} {k}" for k, n in self.steps.items() if n)
        return (
            f"{self.forwards} forwards ({kinds}); {self.prefetch_hits}/{self.uses} unit fetches read ahead "
            f"({self.late_prefetches} late, {self.on_demand} on demand); {self.read_nbytes / 1e9:.2f} GB read "
            f"at {self.read_gbps:.2f} GB/s; {self.stall_s:.2f} s of {self.wall_s:.2f} s waiting for weights"
        )


@dataclasses.dataclass(frozen=True)
class Mark:
    """The running totals at one moment (the engine's counters, the scheduler's, the store's)."""

    kinds: Counter
    totals: Any
    """The scheduler's SchedulerStats.total (StepStats sums)."""
    read_nbytes: int
    t: float

    def since(self, before: Mark, *, tokens: int = 0) -> InferenceStats:
        kinds = self.kinds - before.kinds
        a, b = self.totals, before.totals
        return InferenceStats(
            forwards=sum(kinds.values()),
            steps={k: kinds.get(k, 0) for k in STEP_KINDS},
            uses=a.uses - b.uses,
            prefetch_hits=a.prefetch_hits - b.prefetch_hits,
            late_prefetches=a.late_prefetches - b.late_prefetches,
            reuse_hits=a.reuse_hits - b.reuse_hits,
            on_demand=a.on_demand - b.on_demand,
            stall_s=a.stall_s - b.stall_s,
            read_nbytes=self.read_nbytes - before.read_nbytes,
            wall_s=self.t - before.t,
            tokens=tokens,
        )
