"""The 0/1 knapsack behind the placement planner: which arrays to keep in host memory.

Each candidate is an array that may rest in host memory or on NVMe: kept in
host memory it costs ``weight`` bytes of the budget and saves ``value`` bytes
of NVMe traffic per step (traffic.py). ``choose`` returns a set of candidates
whose weights fit the capacity with the largest total value: the placement
with the least NVMe traffic.

[Note: exact knapsack on a grid]
Dynamic programming over the capacity, in cells of ``grid`` bytes. Shards are
padded to 4 KiB, so every weight is a multiple of the grid the solver picks
(the weights' greatest common divisor) and the answer is exact — as long as
the capacity spans at most MAX_CELLS cells and rows × cells stays within
MAX_WORK. Beyond that (budgets of tens of GiB for small shards, or thousands
of shards of distinct sizes) the grid is coarsened and each weight rounded
*up* to it: the choice still fits the capacity, and gives up at most one cell
per chosen candidate, much of which a last greedy pass (best value per byte
first) takes back — 0.3% of the optimum with 3000 distinct sizes in the tests.
Candidates with the same weight and value are interchangeable: they are
counted as one kind (binary splitting of the count keeps the DP small), and
which of them are kept follows their ``priority`` (lower first), which is
also how ties between equally good choices are broken.

Pure: numbers in, indices out; no torch, no I/O.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

MAX_CELLS = 1 << 20
"""The most capacity cells the DP spans (8 MiB of values, 128 KiB of choices per row)."""

MAX_WORK = 1 << 26
"""The most rows × cells the DP visits (well under a second): with many kinds of candidate the grid is
coarsened to stay within it."""


@dataclasses.dataclass(frozen=True)
class Candidate:
    weight: int
    """Bytes of the budget it takes in host memory."""
    value: int
    """Bytes of NVMe traffic per step it saves there."""
    priority: tuple = ()
    """Among candidates of equal weight and value, lower is kept first."""


def total_value(candidates: Sequence[Candidate], kept: set[int]) -> int:
    return sum(candidates[i].value for i in kept)


def choose(candidates: Sequence[Candidate], capacity: int) -> set[int]:
    """Indices of the candidates to keep: weights within ``capacity``, values the largest
    (see [Note: exact knapsack on a grid])."""
    capacity = max(0, int(capacity))
    free = {i for i, c in enumerate(candidates) if c.weight <= 0 and c.value >= 0}
    live = [i for i, c in enumerate(candidates) if 0 < c.weight <= capacity and c.value > 0]
    if sum(candidates[i].weight for i in live) <= capacity:
        return free | set(live)
    span = min(capacity, sum(candidates[i].weight for i in live))
    grid = math.gcd(*(candidates[i].weight for i in live))
    order, rows = _rows(candidates, live, grid)
    limit = max(1, min(MAX_CELLS, MAX_WORK // len(rows)))
    if span // grid > limit:
        grid = -(-span // limit)
        order, rows = _rows(candidates, live, grid)
    cells = capacity // grid
    span_cells = min(cells, sum(r[2] for r in rows))
    best = np.zeros(span_cells + 1, dtype=np.int64)
    taken: list[np.ndarray] = []
    for k, count, w in rows:
        value = order[k][0][1] * count
        if w > span_cells:
            taken.append(np.zeros(0, dtype=np.uint8))
            continue
        cand = best[:-w] + value
        better = cand > best[w:]
        best[w:] = np.where(better, cand, best[w:])
        taken.append(np.packbits(better))
    counts = [0] * len(order)
    c = span_cells
    for (k, count, w), bits in zip(reversed(rows), reversed(taken), strict=True):
        if w <= c and bits.size and _bit(bits, c - w):
            counts[k] += count
            c -= w
    kept = set(free)
    for k, ((_w, _v), members) in enumerate(order):
        members = sorted(members, key=lambda i: candidates[i].priority)
        kept.update(members[: counts[k]])
    # On a coarse grid the rounded-up weights leave room unused: fill it, best value per byte first.
    # (On an exact grid nothing more fits, or the DP's choice was not the best.)
    room = capacity - sum(candidates[i].weight for i in kept)
    for i in sorted(
        set(live) - kept,
        key=lambda i: (-candidates[i].value / candidates[i].weight, candidates[i].priority),
    ):
        if candidates[i].weight <= room:
            kept.add(i)
            room -= candidates[i].weight
    return kept


def _rows(
    candidates: Sequence[Candidate], live: Sequence[int], grid: int
) -> tuple[list[tuple[tuple[int, int], list[int]]], list[tuple[int, int, int]]]:
    """The kinds ((cells, value) -> members), best-ranked first — on ties the DP keeps earlier rows —
    and the DP's rows: (kind number, count, cells) per pseudo-candidate of the binary split."""
    kinds: dict[tuple[int, int], list[int]] = {}
    for i in live:
        c = candidates[i]
        kinds.setdefault((-(-c.weight // grid), c.value), []).append(i)
    order = sorted(kinds.items(), key=lambda kv: min(candidates[i].priority for i in kv[1]))
    rows: list[tuple[int, int, int]] = []
    for k, ((w, _v), members) in enumerate(order):
        n, step = len(members), 1
        while n > 0:
            take = min(step, n)
            rows.append((k, take, w * take))
            n -= take
            step *= 2
    return order, rows


def _bit(packed: np.ndarray, i: int) -> bool:
    return bool(packed[i >> 3] >> (7 - (i & 7)) & 1)
