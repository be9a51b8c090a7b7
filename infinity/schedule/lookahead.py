"""Lookahead: which units to hold, from the trace, the cursor and the budgets (pure decisions, no I/O).

[Note: prefetch and reuse distance]
Everything the scheduler holds on its own judgement is chosen by *when it is
needed next* (Belady's rule), within the budgets:
- prefetch walks the trace from the cursor in order and fetches each unit
  not yet held while the bytes it moves ahead of use (``ahead``: reads and
  copies, not cache hits) stay within the bucket and the bytes held
  (``live``) within max_live; it stops at the first unit that does not fit,
  so reads are issued in the order of use and never skip ahead past a unit
  that would then be late;
- at a unit's last release, it is *kept* (its hold not given back) when the
  trace uses it again within ``max_reuse_distance_nbytes`` bytes of uses from
  the cursor, as DeepSpeed's stage3_max_reuse_distance does;
- when a prefetch needs room under max_live, kept units whose next use comes
  *after* the unit to fetch are given up, the furthest first: a unit needed
  sooner is worth more than one needed later (so with large budgets the kept
  set slides to the units nearest their reuse, e.g. the last layers of the
  forward, which the backward needs first);
- idle cache entries of the store are evicted in the same order to make
  pool room for a prefetch, and only those needed later than it.
Nothing here waits or touches the store; the scheduler applies the decisions.

Threading: none (called under the scheduler's lock).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable
from typing import Protocol, TypeVar

from infinity.schedule.trace import Trace


class Sized(Protocol):
    key: Hashable
    nbytes: int


R = TypeVar("R", bound=Sized)


def until_next_use(trace: Trace | None, pos: int, key: Hashable) -> float:
    """Uses from the cursor until ``key`` is needed (into the next step); inf without a trace to go by."""
    return math.inf if trace is None else trace.until_next_use(key, pos)


def furthest_first(records: Iterable[R], trace: Trace | None, pos: int) -> list[R]:
    """``records`` in Belady's eviction order: the one needed last first (stable for ties)."""
    return sorted(records, key=lambda r: -until_next_use(trace, pos, r.key))


def needed_after(records: Iterable[R], trace: Trace | None, pos: int, at: int) -> list[R]:
    """Those of ``records`` (furthest first) whose next use comes after trace position ``at``."""
    ahead = at - pos
    return [
        r for r in furthest_first(records, trace, pos) if until_next_use(trace, pos, r.key) > ahead
    ]


def displace(
    kept: Iterable[R], trace: Trace | None, pos: int, at: int, need_nbytes: int
) -> list[R] | None:
    """Kept units to give up (furthest first) so that ``need_nbytes`` more fit; None if those needed
    after position ``at`` are not enough (then nothing is given up)."""
    if need_nbytes <= 0:
        return []
    out: list[R] = []
    freed = 0
    for r in needed_after(kept, trace, pos, at):
        out.append(r)
        freed += r.nbytes
        if freed >= need_nbytes:
            return out
    return None


def keep_for_reuse(
    trace: Trace | None, pos: int, key: Hashable, max_reuse_distance_nbytes: int
) -> bool:
    """Whether ``key``, released with the cursor at ``pos``, is used again within the reuse distance."""
    if trace is None:
        return False
    d = trace.reuse_distance(key, pos)
    return d is not None and d <= max_reuse_distance_nbytes


def fits(
    nbytes: int, *, moves: bool, ahead: int, live: int, bucket: int, max_live: int
) -> tuple[bool, int]:
    """(within the bucket, bytes of max_live lacking): may a prefetch of ``nbytes`` start?

    ``moves``: the fetch transfers data; one that does not (a cache hit) is outside the bucket."""
    return (not moves or ahead + nbytes <= bucket), max(0, live + nbytes - max_live)
