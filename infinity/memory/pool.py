"""BufferPool: one pinned, page-aligned slab of ``count × size`` bytes, handed out in regions.

DeepSpeed's meaning of the two numbers is kept (``buffer_count`` buffers of
``buffer_size`` bytes): together they are the pool's capacity, allocated once
at construction, so the host memory the pool costs is set by the config and
never by the model. See [Note: pool allocator] for how regions are carved.

Invariants:
- regions are 4 KiB aligned, never overlap, and ``in_use`` is the sum of
  their (rounded) sizes; a region is released exactly once;
- a request larger than the capacity is refused up front (PoolTooSmallError,
  naming the tensor, its size, the capacity and the config key to raise);
- waiting is FIFO: while anyone waits, later requests queue behind them, so a
  large request is not starved by a stream of small ones.

Threading: every method may be called from any thread. Reclaimers (callbacks
that let the pool's users, e.g. a store's cache, give memory back) are called
with no pool lock held, by an acquirer that found no room: before it queues
when nobody waits, then each time it is at the head of the queue. They may
call ``release`` and the read-only queries.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Callable

import torch

from infinity.aio import DIRECT_ALIGNMENT, aligned_empty
from infinity.aio.waits import wait_until
from infinity.memory.ranges import RangeAllocator, round_up

# [Note: pool allocator]
# Regions come from a 4 KiB-granular best-fit arena with a coalescing free
# list (RangeAllocator), not from whole buffer_size buffers. Why:
# - a small tensor costs its own size, not a whole buffer: DeepSpeed's
#   buffer_size must exceed the largest parameter (#3506), so a pool of whole
#   buffers wastes almost all of itself on small tensors, which is why it
#   packs tensors into buffers by hand (SwapBufferManager);
# - a tensor larger than buffer_size is served by any contiguous run, i.e.
#   by several buffers' worth of the slab, rather than refused;
# - fragmentation is bounded by best fit, coalescing, FIFO waiting (held
#   regions drain while a large request waits at the head) and the owners'
#   reclaimers, which evict cached regions when a request does not fit.
# buffer_size keeps a meaning for the owners: the store packs the tensors of
# one fetch_many into regions of at most buffer_size bytes.

log = logging.getLogger("infinity.memory")

Reclaimer = Callable[[int], None]


class _WeakCallable:
    """A weakly held function or bound method, like WeakMethod but with no callback of its own:
    WeakMethod's runs Python code in whatever thread drops the owner, where a KeyboardInterrupt
    would be lost ([Note: finalizers run no Python] in infinity/aio/handle.py)."""

    __slots__ = ("_ref", "_func")

    def __init__(self, fn: Reclaimer):
        owner = getattr(fn, "__self__", None)
        self._ref = weakref.ref(fn if owner is None else owner)
        self._func = None if owner is None else fn.__func__  # type: ignore[attr-defined]

    def __call__(self) -> Reclaimer | None:
        obj = self._ref()
        if obj is None or self._func is None:
            return obj
        return self._func.__get__(obj)


class PoolTooSmallError(ValueError):
    """A request that this pool can never serve, whatever is released."""


def format_nbytes(n: int | float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


@dataclasses.dataclass(frozen=True)
class PoolStats:
    name: str
    count: int
    buffer_size: int
    capacity: int
    in_use: int
    """Bytes in live regions (rounded up to 4 KiB each)."""
    peak_in_use: int
    regions: int
    """Live regions."""
    largest_free: int
    """Largest contiguous free run: the largest request servable right now."""
    acquires: int
    waits: int
    """Acquires that had to wait."""
    wait_s: float
    """Total seconds acquirers spent waiting."""
    waiting: int
    """Acquirers waiting now."""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class PoolRegion:
    """A 4 KiB-aligned range of a pool's slab. ``tensor`` is a uint8 view of its ``nbytes`` bytes."""

    __slots__ = ("pool", "offset", "nbytes", "size", "name", "_released")

    def __init__(self, pool: BufferPool | None, offset: int, nbytes: int, size: int, name: str):
        self.pool = pool
        self.offset = offset
        self.nbytes = nbytes
        self.size = size  # nbytes rounded up to the pool's granule
        self.name = name
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    @property
    def tensor(self) -> torch.Tensor:
        """The region's ``nbytes`` bytes as a uint8 tensor (a view of the pool's slab)."""
        self._check_live()
        if self.pool is None:
            return torch.empty(0, dtype=torch.uint8)
        return self.pool._slab[self.offset : self.offset + self.nbytes]

    def bytes_at(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 view of ``nbytes`` bytes at ``offset`` within the region (up to ``size``)."""
        self._check_live()
        if offset < 0 or offset + nbytes > self.size:
            raise ValueError(
                f"bytes [{offset}, {offset + nbytes}) lie outside region '{self.name}' of {self.size} bytes"
            )
        if self.pool is None:
            return torch.empty(0, dtype=torch.uint8)
        start = self.offset + offset
        return self.pool._slab[start : start + nbytes]

    def view(
        self,
        dtype: torch.dtype,
        shape: tuple[int, ...] | torch.Size | None = None,
        *,
        offset: int = 0,
    ) -> torch.Tensor:
        """The bytes at ``offset`` as a ``dtype`` tensor of ``shape`` (default: 1-D, as many as fit)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        if shape is None:
            numel = (self.nbytes - offset) // itemsize
            shape = (numel,)
        else:
            numel = 1
            for d in shape:
                numel *= d
        if offset % itemsize:
            raise ValueError(f"offset {offset} is not a multiple of {dtype}'s size {itemsize}")
        return self.bytes_at(offset, numel * itemsize).view(dtype).view(tuple(shape))

    def release(self) -> None:
        if self.pool is not None:
            self.pool.release(self)
        else:
            self._released = True

    def __enter__(self) -> PoolRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._released:
            self.release()

    def _check_live(self) -> None:
        if self._released:
            raise RuntimeError(
                f"region '{self.name}' was released; its memory belongs to the pool again"
            )

    def __repr__(self) -> str:
        state = "released" if self._released else "live"
        return f"<PoolRegion '{self.name}' {format_nbytes(self.nbytes)} at {self.offset} {state}>"


@dataclasses.dataclass(eq=False)
class _Waiter:
    name: str
    nbytes: int
    since: float
    thread: str


class BufferPool:
    """``count`` buffers of ``size`` bytes in one slab, allocated once (DeepSpeed's buffer_count/buffer_size).

    ``pin=None`` pins with cudaHostRegister when CUDA is available. ``config_hint``
    names the config keys an error should tell the user to raise, e.g.
    ``"zero_optimization.offload_param.buffer_count / buffer_size"``.
    """

    @staticmethod
    def capacity_for(count: int, size: int) -> int:
        """The bytes ``BufferPool(count, size)`` holds: each buffer is rounded up to 4 KiB (O_DIRECT)."""
        return count * round_up(size, DIRECT_ALIGNMENT)

    def __init__(
        self,
        count: int,
        size: int,
        *,
        pin: bool | None = None,
        huge_pages: bool = True,
        name: str = "pool",
        config_hint: str = "buffer_count / buffer_size",
    ):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(
                f"BufferPool count (buffer_count) must be a positive integer, got {count!r}"
            )
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(
                f"BufferPool size (buffer_size, bytes) must be a positive integer, got {size!r}"
            )
        self.name = name
        self.count = count
        self.buffer_size = round_up(size, DIRECT_ALIGNMENT)
        self.capacity = self.capacity_for(count, size)
        self.config_hint = config_hint
        self._slab = aligned_empty(self.capacity, torch.uint8, huge_pages=huge_pages, pin=pin)
        self._alloc = RangeAllocator(self.capacity, granule=DIRECT_ALIGNMENT)
        self._cv = threading.Condition(threading.Lock())
        self._waiters: collections.deque[_Waiter] = collections.deque()
        self._live: dict[int, PoolRegion] = {}
        self._reclaimers: list[_WeakCallable] = []
        self._peak = 0
        self._acquires = 0
        self._waits = 0
        self._wait_s = 0.0

    @property
    def slab(self) -> torch.Tensor:
        """The whole pool as one uint8 tensor (e.g. to register it with io_uring)."""
        return self._slab

    # -- acquire / release ---------------------------------------------------

    def check_servable(self, nbytes: int, name: str | None = None) -> int:
        """The rounded size of a request, or PoolTooSmallError if this pool can never serve it."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be a non-negative int, got {nbytes!r}")
        size = round_up(nbytes, DIRECT_ALIGNMENT)
        if size > self.capacity:
            what = f"'{name}'" if name else "a request"
            raise PoolTooSmallError(
                f"{what} needs {format_nbytes(nbytes)} ({nbytes} bytes) of pinned buffer space, but "
                f"pool '{self.name}' holds {self.count} × {format_nbytes(self.buffer_size)} = "
                f"{format_nbytes(self.capacity)} in all; raise {self.config_hint} so that "
                f"buffer_count × buffer_size ≥ {format_nbytes(size)}"
            )
        return size

    def try_acquire(self, nbytes: int, *, name: str | None = None) -> PoolRegion | None:
        """A region now, or None (also when others are waiting: no queue jumping)."""
        size = self.check_servable(nbytes, name)
        if size == 0:
            return PoolRegion(None, 0, 0, 0, name or "")
        with self._cv:
            if self._waiters:
                return None
            return self._take(nbytes, size, name)

    def acquire(
        self,
        nbytes: int,
        *,
        timeout: float | None = None,
        name: str | None = None,
        cause: Callable[[], BaseException | None] | None = None,
    ) -> PoolRegion:
        """A region of ``nbytes`` bytes, waiting (FIFO) until one is free.

        Raises PoolTooSmallError at once if the pool can never serve the request,
        and TimeoutError after ``timeout`` seconds naming the waiter and the holders.
        While it waits it logs every few seconds what it waits for and who holds the
        pool ([Note: no silent waits] in infinity/aio/waits.py); ``cause()`` is asked
        after each slice and what it returns (e.g. the owner's failed write-back, which
        keeps the memory waited for) is raised at once; ``wake()`` makes waiters ask now.
        """
        size = self.check_servable(nbytes, name)
        if size == 0:
            return PoolRegion(None, 0, 0, 0, name or "")
        label = name or "a request"
        t0 = time.monotonic()
        with self._cv:
            first = not self._waiters
            if first:
                r = self._take(nbytes, size, name)
                if r is not None:
                    return r
        if first:  # nobody queued: ask the owners for room before counting a wait
            self._run_reclaimers(size)
        with self._cv:
            if first and not self._waiters:
                r = self._take(nbytes, size, name)
                if r is not None:
                    return r
            me = _Waiter(label, size, t0, threading.current_thread().name)
            self._waiters.append(me)
            self._waits += 1
        got: list[PoolRegion] = []

        def ready(slice_s: float) -> bool:
            with self._cv:
                head = self._waiters[0] is me
                if head:
                    r = self._take(nbytes, size, name)
                    if r is not None:
                        got.append(r)
                        return True
            if head:
                self._run_reclaimers(size)
            with self._cv:
                if self._waiters[0] is me:
                    r = self._take(nbytes, size, name)
                    if r is not None:
                        got.append(r)
                        return True
                # Releases notify; the slice only bounds how long a reclaimer's progress
                # that did not go through release() (none known) could go unnoticed.
                self._cv.wait(min(slice_s, 0.1))
            return False

        try:
            if not wait_until(
                ready,
                what=lambda: (
                    f"{format_nbytes(size)} of contiguous pinned buffer space in pool "
                    f"'{self.name}' for {label} (thread {me.thread})"
                ),
                holder=self._holders,
                cause=cause,
                timeout=timeout,
                log=log,
                kind="pool",
            ):
                with self._cv:
                    raise TimeoutError(self._timeout_message(me, timeout))
            return got[0]
        finally:
            with self._cv:
                self._waiters.remove(me)
                self._wait_s += time.monotonic() - t0
                self._cv.notify_all()

    def wake(self) -> None:
        """Makes every waiter look again now (its ``cause`` may have changed)."""
        with self._cv:
            self._cv.notify_all()

    def release(self, region: PoolRegion) -> None:
        """Returns a region to the pool. Releasing twice, or a foreign region, raises."""
        if region.pool is None and region.size == 0:
            region._released = True
            return
        if region.pool is not self:
            raise ValueError(f"{region!r} does not belong to pool '{self.name}'")
        with self._cv:
            if region._released or self._live.get(region.offset) is not region:
                raise RuntimeError(f"{region!r} was already released to pool '{self.name}'")
            del self._live[region.offset]
            region._released = True
            self._alloc.free(region.offset, region.size)
            self._cv.notify_all()

    def _take(self, nbytes: int, size: int, name: str | None) -> PoolRegion | None:
        off = self._alloc.alloc(size)
        if off is None:
            return None
        r = PoolRegion(self, off, nbytes, size, name or "")
        self._live[off] = r
        self._acquires += 1
        self._peak = max(self._peak, self._alloc.used_nbytes)
        return r

    # -- reclaimers ----------------------------------------------------------

    def add_reclaimer(self, fn: Reclaimer) -> None:
        """Registers ``fn(nbytes)``, called when a request waits, to give memory back (held weakly)."""
        ref = _WeakCallable(fn)
        with self._cv:
            self._reclaimers.append(ref)

    def remove_reclaimer(self, fn: Reclaimer) -> None:
        with self._cv:
            self._reclaimers = [r for r in self._reclaimers if r() is not None and r() != fn]

    def _run_reclaimers(self, size: int) -> None:
        with self._cv:
            fns = [r() for r in self._reclaimers]
            self._reclaimers = [r for r in self._reclaimers if r() is not None]
        for fn in fns:
            if fn is None:
                continue
            fn(size)
            with self._cv:
                if self._alloc.largest_free() >= size:
                    return

    # -- queries -------------------------------------------------------------

    def waiting_nbytes(self) -> int:
        """Size of the request at the head of the queue (0 when nobody waits)."""
        with self._cv:
            return self._waiters[0].nbytes if self._waiters else 0

    def can_serve(self, nbytes: int) -> bool:
        """Whether a request of ``nbytes`` would be served now."""
        with self._cv:
            return self._alloc.largest_free() >= round_up(nbytes, DIRECT_ALIGNMENT)

    @property
    def in_use(self) -> int:
        with self._cv:
            return self._alloc.used_nbytes

    def stats(self) -> PoolStats:
        with self._cv:
            wait_s = self._wait_s + sum(time.monotonic() - w.since for w in self._waiters)
            return PoolStats(
                name=self.name,
                count=self.count,
                buffer_size=self.buffer_size,
                capacity=self.capacity,
                in_use=self._alloc.used_nbytes,
                peak_in_use=self._peak,
                regions=len(self._live),
                largest_free=self._alloc.largest_free(),
                acquires=self._acquires,
                waits=self._waits,
                wait_s=wait_s,
                waiting=len(self._waiters),
            )

    def _holders(self) -> str:
        """Who holds the pool now: the largest regions by name, the total and the largest free run."""
        with self._cv:
            holders = sorted(self._live.values(), key=lambda r: -r.size)
            shown = ", ".join(f"'{r.name or '?'}' {format_nbytes(r.size)}" for r in holders[:5])
            more = f" and {len(holders) - 5} more" if len(holders) > 5 else ""
            return (
                f"{len(holders)} region(s) ({shown}{more}), "
                f"{format_nbytes(self._alloc.used_nbytes)} of {format_nbytes(self.capacity)} in use, "
                f"largest free run {format_nbytes(self._alloc.largest_free())}, "
                f"{len(self._waiters)} waiter(s)"
            )

    def _timeout_message(self, me: _Waiter, timeout: float | None) -> str:
        holders = sorted(self._live.values(), key=lambda r: -r.size)
        shown = ", ".join(f"'{r.name or '?'}' {format_nbytes(r.size)}" for r in holders[:5])
        more = f" and {len(holders) - 5} more" if len(holders) > 5 else ""
        ahead = list(self._waiters).index(me)
        queue = f"; {ahead} earlier waiter(s) queued ahead of it" if ahead else ""
        return (
            f"pool '{self.name}': {me.name} (thread {me.thread}) waited {timeout} s for "
            f"{format_nbytes(me.nbytes)} of contiguous pinned buffer space; "
            f"{format_nbytes(self._alloc.used_nbytes)} of {format_nbytes(self.capacity)} is in use by "
            f"{len(holders)} region(s) ({shown}{more}), largest free run "
            f"{format_nbytes(self._alloc.largest_free())}{queue}. Release what is held, or raise "
            f"{self.config_hint}"
        )

    def __repr__(self) -> str:
        return (
            f"BufferPool('{self.name}', {self.count} × {format_nbytes(self.buffer_size)}, "
            f"in use {format_nbytes(self.in_use)})"
        )
