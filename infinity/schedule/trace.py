"""Trace: one step's unit uses in order, with their sizes, and the distances the scheduler asks of it.

A trace is recorded once (by TraceCursor, cursor.py) and never changes: a
position ``i`` is the i-th ``acquire`` of the step, ``keys[i]`` the unit it
named and ``nbytes[i]`` that unit's size. A unit used twice appears twice.

Distances are in bytes of trace, as DeepSpeed measures reuse distance in
elements of trace: the reuse distance of a unit at cursor ``pos`` is the size
of the uses between ``pos`` and its next use, ``bytes_between(pos, next)``.

Threading: immutable after construction; safe to read from any thread.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Hashable, Iterable


class Trace:
    __slots__ = ("keys", "nbytes", "_prefix", "_positions")

    def __init__(self, entries: Iterable[tuple[Hashable, int]]):
        keys: list[Hashable] = []
        sizes: list[int] = []
        for key, n in entries:
            keys.append(key)
            sizes.append(int(n))
        self.keys: tuple[Hashable, ...] = tuple(keys)
        self.nbytes: tuple[int, ...] = tuple(sizes)
        prefix = [0]
        for n in sizes:
            prefix.append(prefix[-1] + n)
        self._prefix = prefix
        self._positions: dict[Hashable, list[int]] = {}
        for i, key in enumerate(keys):
            self._positions.setdefault(key, []).append(i)

    def __len__(self) -> int:
        return len(self.keys)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Trace) and self.keys == other.keys

    def __hash__(self) -> int:
        return hash(self.keys)

    @property
    def total_nbytes(self) -> int:
        return self._prefix[-1]

    def __contains__(self, key: Hashable) -> bool:
        return key in self._positions

    def uses(self, key: Hashable) -> list[int]:
        """Every position of ``key``, in order (empty if it is not in the trace)."""
        return list(self._positions.get(key, ()))

    def next_use(self, key: Hashable, at: int) -> int | None:
        """The first position >= ``at`` that uses ``key``, or None."""
        pos = self._positions.get(key)
        if not pos:
            return None
        i = bisect.bisect_left(pos, at)
        return pos[i] if i < len(pos) else None

    def bytes_between(self, start: int, stop: int) -> int:
        """Bytes of the uses at positions [start, stop)."""
        return self._prefix[stop] - self._prefix[start]

    def reuse_distance(self, key: Hashable, at: int) -> int | None:
        """Bytes of trace from ``at`` until ``key``'s next use (None: not used again in this step)."""
        nxt = self.next_use(key, at)
        return None if nxt is None else self.bytes_between(at, nxt)

    def until_next_use(self, key: Hashable, at: int) -> float:
        """Positions from ``at`` until ``key`` is needed, counting into the next step (inf: never).

        The order Belady's rule evicts in: the larger, the later it is needed.
        """
        nxt = self.next_use(key, at)
        if nxt is not None:
            return nxt - at
        pos = self._positions.get(key)
        if pos:
            return len(self.keys) - at + pos[0]
        return math.inf

    def starts_with(self, keys: list[Hashable]) -> bool:
        """Whether this trace begins with ``keys``."""
        n = len(keys)
        return n <= len(self.keys) and list(self.keys[:n]) == keys

    def __repr__(self) -> str:
        head = ", ".join(repr(k) for k in self.keys[:4])
        more = ", …" if len(self.keys) > 4 else ""
        return f"Trace({len(self.keys)} uses, {self.total_nbytes} bytes: {head}{more})"
