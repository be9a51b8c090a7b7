"""RangeAllocator: best-fit allocation of aligned byte ranges with a coalescing free list.

One allocator serves two clients: the buffer pool (ranges of its pinned
slab) and the store's swap space (ranges of a logical file address space).

Invariants: every offset and length is a multiple of ``granule``; free runs
never overlap, never touch (adjacent runs are merged on free), and together
with the allocated ranges cover [0, capacity) exactly. Allocation takes the
smallest free run that fits (ties: lowest offset) and carves from its start,
which keeps large runs intact for large requests.

Threading: none; the owner serialises calls.
"""

from __future__ import annotations

import bisect


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class RangeAllocator:
    """Best-fit allocator over [0, capacity) in units of ``granule`` bytes."""

    def __init__(self, capacity: int = 0, *, granule: int):
        if granule <= 0:
            raise ValueError(f"granule must be positive, got {granule}")
        if capacity < 0 or capacity % granule:
            raise ValueError(
                f"capacity must be a non-negative multiple of {granule}, got {capacity}"
            )
        self.granule = granule
        self._capacity = 0
        self._starts: list[int] = []  # free run starts, sorted
        self._len: dict[int, int] = {}  # start -> length of a free run
        self._by_size: list[tuple[int, int]] = []  # (length, start), sorted
        self._free_nbytes = 0
        self.grow(capacity)

    # -- queries -------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def free_nbytes(self) -> int:
        return self._free_nbytes

    @property
    def used_nbytes(self) -> int:
        return self._capacity - self._free_nbytes

    def largest_free(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    def free_runs(self) -> list[tuple[int, int]]:
        """(offset, nbytes) of every free run, by offset."""
        return [(s, self._len[s]) for s in self._starts]

    def tail_free(self) -> int:
        """Length of the free run that ends at capacity (0 if the last byte is allocated)."""
        if not self._starts:
            return 0
        s = self._starts[-1]
        return self._len[s] if s + self._len[s] == self._capacity else 0

    # -- changes -------------------------------------------------------------

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a fresh range of round_up(nbytes, granule) bytes, or None if no run fits."""
        n = round_up(max(nbytes, 1), self.granule)
        i = bisect.bisect_left(self._by_size, (n, -1))
        if i == len(self._by_size):
            return None
        length, start = self._by_size[i]
        self._remove_run(start)
        if length > n:
            self._add_run(start + n, length - n)
        self._free_nbytes -= n
        return start

    def free(self, offset: int, nbytes: int) -> None:
        """Returns [offset, offset + round_up(nbytes)) to the free list, merging neighbours."""
        n = round_up(max(nbytes, 1), self.granule)
        if offset < 0 or offset % self.granule or offset + n > self._capacity:
            raise ValueError(
                f"cannot free [{offset}, {offset + n}): not a granule-aligned range inside "
                f"[0, {self._capacity})"
            )
        i = bisect.bisect_right(self._starts, offset)
        if i > 0:
            p = self._starts[i - 1]
            if p + self._len[p] > offset:
                raise ValueError(f"double free: [{offset}, {offset + n}) overlaps free run at {p}")
        if i < len(self._starts) and self._starts[i] < offset + n:
            raise ValueError(
                f"double free: [{offset}, {offset + n}) overlaps free run at {self._starts[i]}"
            )
        start, end = offset, offset + n
        if i > 0:
            p = self._starts[i - 1]
            if p + self._len[p] == start:
                start = p
                self._remove_run(p)
        if end in self._len:
            end += self._len[end]
            self._remove_run(offset + n)
        self._add_run(start, end - start)
        self._free_nbytes += n

    def grow(self, new_capacity: int) -> None:
        """Extends the space to ``new_capacity`` bytes; the new tail is free."""
        if new_capacity % self.granule:
            raise ValueError(f"capacity must be a multiple of {self.granule}, got {new_capacity}")
        if new_capacity < self._capacity:
            raise ValueError(f"cannot shrink from {self._capacity} to {new_capacity}")
        old = self._capacity
        if new_capacity == old:
            return
        tail = self.tail_free()
        self._capacity = new_capacity
        start = old - tail
        if tail:
            self._remove_run(start)
        self._add_run(start, new_capacity - start)
        self._free_nbytes += new_capacity - old

    # -- internals -----------------------------------------------------------

    def _add_run(self, start: int, length: int) -> None:
        bisect.insort(self._starts, start)
        self._len[start] = length
        bisect.insort(self._by_size, (length, start))

    def _remove_run(self, start: int) -> None:
        length = self._len.pop(start)
        del self._starts[bisect.bisect_left(self._starts, start)]
        del self._by_size[bisect.bisect_left(self._by_size, (length, start))]

    def check(self) -> None:
        """Asserts the invariants (tests call this after every step)."""
        assert self._starts == sorted(self._len)
        assert self._by_size == sorted((n, s) for s, n in self._len.items())
        prev_end = -1
        for s in self._starts:
            n = self._len[s]
            assert n > 0 and s % self.granule == 0 and n % self.granule == 0
            assert s > prev_end, "free runs overlap or touch"
            prev_end = s + n
        assert prev_end <= self._capacity
        assert sum(self._len.values()) == self._free_nbytes
