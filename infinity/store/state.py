"""StoreState: one store's record table and everything its read, write and device paths share.

The facade (store.py) builds one StoreState and hands it, explicitly, to the
functions of read_path.py, write_path.py and device.py; the helpers here are
the ones every path needs to keep the table consistent: finding a key and
checking what a caller may do with it, putting a resident key's host view in
a pool region (a Slot) and taking it out, keeping the LRU of cache entries in
step with the records, and describing a group of keys as one I/O request.

Invariants (``check_invariants`` asserts them; tests call it after every step):
- every registered key has exactly one KeyRecord in ``records``;
- a key is in ``lru`` iff it is a cache entry (``KeyRecord.idle``);
- a Slot's ``members`` counts the records whose host view lies in it, and its
  region goes back to the pool when the last one leaves;
- every op in flight is in ``ops`` until it is completed.

Threading: ``lock`` (a plain Lock, never held while waiting for I/O or pool
space) guards ``records``, ``lru``, ``ops``, the flags, the traffic counters
and every KeyRecord and Slot; each function of the paths says whether it is
called with it held. ``stats_lock`` guards only the wait-time and checksum-time sums,
which callers and the reaper add to without the store lock. Lock order: store lock, then
pool lock.

The state holds its facade only weakly: the store's finalizer holds the state,
and must not keep the store alive (see ``new_future``).
"""

from __future__ import annotations

import collections
import errno
import threading
import time
import weakref
from collections.abc import Hashable
from typing import TYPE_CHECKING

import torch

from infinity.memory import BufferPool, PoolRegion, format_nbytes
from infinity.store.errors import StoreIOError, StoreStateError
from infinity.store.futures import IoOp, Reaper, StoreFuture
from infinity.store.handles import IoHandles
from infinity.store.record import IN_IO, KeyRecord, Residency, Slot
from infinity.store.stats import Traffic
from infinity.store.swapspace import SwapSpace

if TYPE_CHECKING:
    from infinity.store.device import DeviceTier
    from infinity.store.store import TieredStore


class StoreState:
    """One store's records and shared machinery (see the module docstring for what guards what)."""

    def __init__(
        self,
        owner: TieredStore,
        *,
        name: str,
        pool: BufferPool,
        io: IoHandles,
        swap: SwapSpace | None,
        device: DeviceTier,
        reaper: Reaper,
        integrity: bool,
        pool_timeout: float | None,
    ):
        self._owner = weakref.ref(owner)
        self.name = name
        self.pool = pool
        self.io = io
        self.swap = swap
        self.device = device
        self.reaper = reaper
        self.integrity = integrity  # CRC32C per key (integrity.py)
        self.pool_timeout = pool_timeout
        self.lock = threading.Lock()
        self.records: dict[Hashable, KeyRecord] = {}
        self.lru: collections.OrderedDict[KeyRecord, None] = collections.OrderedDict()
        self.ops: set[IoOp] = set()
        self.closing = False  # close() is draining I/O: no new operations, no more write-backs
        self.closed = False
        # The first background write-back that failed and has not been retried since
        # ([Note: failed write-backs] in write_path.py).
        self.fault: StoreIOError | None = None
        self.read = Traffic()
        self.write = Traffic()
        self.h2d = Traffic()
        self.d2h = Traffic()
        self.counts: collections.Counter[str] = collections.Counter()
        # NVMe bytes moved per key, both directions (stats.KeyTraffic): what a key costs per step
        self.read_by_key: collections.Counter[Hashable] = collections.Counter()
        self.written_by_key: collections.Counter[Hashable] = collections.Counter()
        self.evicting_nbytes = 0  # bytes of background write-backs that will free their room
        self.stats_lock = threading.Lock()
        self.wait_s = 0.0
        self.pool_wait_s = 0.0
        self.checksum_nbytes = 0  # integrity.py: bytes checksummed, seconds it took, and the
        self.checksum_s = 0.0  # part of those in callers' threads
        self.checksum_caller_s = 0.0

    # -- lookups and checks (under the lock) ----------------------------------

    def record(self, key: Hashable) -> KeyRecord:
        try:
            return self.records[key]
        except KeyError:
            raise KeyError(f"key {key!r} is not registered in store '{self.name}'") from None
        except TypeError:
            raise TypeError(f"keys must be hashable, got {type(key).__name__}") from None

    def check_open(self) -> None:
        if self.closed or self.closing:
            raise self.closed_error()

    def swap_space(self) -> SwapSpace:
        """``swap``, for work on keys that rest in it: only a store with an nvme_path has such
        keys (register refuses home "nvme" without one), and ``swap`` never changes."""
        assert self.swap is not None, f"store '{self.name}' has no swap space (no nvme_path)"
        return self.swap

    def closed_error(self) -> StoreStateError:
        return StoreStateError(f"store '{self.name}' is closed")

    def check_usable(self, action: str) -> None:
        """check_open, and refuses work that needs the drive while a write-back failure stands."""
        self.check_open()
        if self.fault is not None:
            raise self.fault_error(action)

    def fault_error(self, action: str) -> StoreIOError:
        """The error raised for ``action`` while ``fault`` stands ([Note: failed write-backs])."""
        fault = self.fault
        assert fault is not None
        stuck = [r for r in self.records.values() if r.error is not None]
        keys = ", ".join(repr(r.key) for r in stuck[:3]) + (" …" if len(stuck) > 3 else "")
        exc = StoreIOError(
            fault.errno or errno.EIO,
            f"{action} refused: store '{self.name}' could not write its data home: {fault}. "
            f"Nothing is lost: {len(stuck)} key(s) ({keys}) stay resident and dirty in host memory. "
            "Fix the drive (or free space on it) and call flush_all() on the store to retry the "
            "write-back, or stop and resume from the last checkpoint on a working drive",
            key=fault.key,
        )
        exc.__cause__ = fault
        return exc

    def settle_fault(self) -> bool:
        """Clears ``fault`` once no key's last write home has failed (retried, or unregistered);
        True if it was cleared now. Under the lock."""
        if self.fault is None or any(r.error is not None for r in self.records.values()):
            return False
        self.fault = None
        return True

    def wait_cause(self, label: str) -> BaseException | None:
        """Why ``label``'s wait for pool memory can never end well, if it cannot (BufferPool.acquire's
        ``cause``; called without the lock): the store was closed, or a write-back failed."""
        with self.lock:
            if self.closed or self.closing:
                return self.closed_error()
            if self.fault is not None:
                return self.fault_error(label)
            return None

    def refuse_if_busy(self, rec: KeyRecord, action: str) -> None:
        if rec.holds:
            raise StoreStateError(
                f"cannot {action} key {rec.key!r}: it is held {rec.holds} time(s) (state "
                f"{rec.state.value}); release it first"
            )
        if rec.state in IN_IO:
            raise StoreStateError(
                f"cannot {action} key {rec.key!r} while it is {rec.state.value}: wait for that "
                "operation's future first"
            )

    def new_future(self, op: IoOp | None, label: str | tuple) -> StoreFuture:
        """A future of this store. It holds the store strongly, so a store with a pending future
        stays alive and waiting on it can complete its op (see [Note: completing ops])."""
        return StoreFuture(self._owner(), op, label)

    # -- slots and the LRU (under the lock) ------------------------------------

    def join_slot(self, rec: KeyRecord, slot: Slot, offset: int) -> None:
        rec.slot = slot
        rec.slot_offset = offset
        slot.members += 1
        rec.host = slot.region.bytes_at(offset, rec.nbytes).view(rec.dtype).view(rec.shape)

    def join_group(self, recs: list[KeyRecord], slot: Slot) -> None:
        """join_slot for keys back to back in ``slot``: one split makes all their views."""
        dtype = recs[0].dtype
        if len(recs) == 1 or any(r.dtype != dtype for r in recs):
            off = 0
            for rec in recs:
                self.join_slot(rec, slot, off)
                off += rec.disk_extent().nbytes
            return
        itemsize = torch.empty((), dtype=dtype).element_size()
        total = sum(r.disk_extent().nbytes for r in recs)
        typed = slot.region.bytes_at(0, total).view(dtype)
        parts = typed.split([r.disk_extent().nbytes // itemsize for r in recs])
        off = 0
        for rec, part in zip(recs, parts, strict=True):
            rec.slot = slot
            rec.slot_offset = off
            off += rec.disk_extent().nbytes
            numel = rec.nbytes // itemsize
            rec.host = (part if part.numel() == numel else part[:numel]).view(rec.shape)
        slot.members += len(recs)

    def leave_slot(self, rec: KeyRecord) -> None:
        slot = rec.slot
        assert slot is not None, f"{rec!r} is not resident in a slot"
        rec.slot = None
        rec.host = None
        slot.members -= 1
        if slot.members == 0:
            slot.region.release()

    def sync_lru(self, rec: KeyRecord) -> None:
        """Puts ``rec`` at the young end of the LRU if it is a cache entry, else takes it out."""
        self.lru.pop(rec, None)
        if rec.idle:
            self.lru[rec] = None

    # -- I/O (pool waits outside the lock; the rest under it) -----------------

    def acquire(self, nbytes: int, label: str) -> PoolRegion:
        """A pool region of ``nbytes`` (waiting up to pool_timeout); called without the lock."""
        t0 = time.monotonic()
        try:
            return self.pool.acquire(
                nbytes, timeout=self.pool_timeout, name=label, cause=lambda: self.wait_cause(label)
            )
        finally:
            dt = time.monotonic() - t0
            with self.stats_lock:
                self.pool_wait_s += dt

    def count_wait(self, seconds: float) -> None:
        with self.stats_lock:
            self.wait_s += seconds

    def track(self, op: IoOp, traffic: Traffic) -> None:
        """Makes ``op`` the op in flight of its keys (their waiting futures drive it) and counts it."""
        for rec in op.recs:
            rec.op = op
            for fut, _tier in rec.waiters:
                fut.follow(op)
        traffic.start()
        self.ops.add(op)

    def io_items(self, recs: list[KeyRecord], slot: Slot) -> list[tuple]:
        """(buffer, file, offset) items for the keys, merging keys adjacent both on disk and in the slot."""
        ranges: list[list[int]] = []  # [logical offset, nbytes, slot offset]
        for rec in sorted(recs, key=lambda r: r.slot_offset):
            ext = rec.disk_extent()
            if (
                ranges
                and ranges[-1][0] + ranges[-1][1] == ext.offset
                and ranges[-1][2] + ranges[-1][1] == rec.slot_offset
            ):
                ranges[-1][1] += ext.nbytes
            else:
                ranges.append([ext.offset, ext.nbytes, rec.slot_offset])
        items = []
        region = slot.region
        for off, n, slot_off in ranges:
            for run in self.swap_space().runs(off, n):
                items.append(
                    (region.bytes_at(slot_off + run.rel, run.nbytes), run.file, run.file_offset)
                )
        return items

    def io_error(self, rec: KeyRecord, verb: str, err: BaseException) -> StoreIOError:
        """A failed read or write of ``rec``, naming the key, its size, the file and the offset."""
        where = self.swap_space().describe(rec.disk_extent().offset, rec.disk_extent().nbytes)
        exc = StoreIOError(
            getattr(err, "errno", None) or errno.EIO,
            f"{verb} of key {rec.key!r} ({format_nbytes(rec.nbytes)}, at {where}) in store "
            f"'{self.name}' failed: {err}",
            key=rec.key,
        )
        exc.__cause__ = err
        return exc

    # -- invariants ----------------------------------------------------------

    def check_invariants(self) -> int:
        """Asserts the invariants of the module docstring and of [Note: residency]; returns
        the pool bytes the store's slots hold. Called under the lock."""
        slots: dict[int, tuple[Slot, int]] = {}
        for rec in self.records.values():
            _check_record(rec)
            assert (rec in self.lru) == rec.idle, rec
            if rec.op is not None:
                assert rec.op in self.ops or rec.op.claimed, rec
            if rec.slot is not None:
                slot, n = slots.get(id(rec.slot), (rec.slot, 0))
                slots[id(rec.slot)] = (slot, n + 1)
        for slot, n in slots.values():
            assert slot.members == n and not slot.region.released, (slot.members, n)
        assert len(self.lru) == sum(1 for r in self.records.values() if r.idle)
        return sum(slot.region.size for slot, _n in slots.values())


def _check_record(rec: KeyRecord) -> None:
    assert rec.holds >= 0, rec
    if rec.home_tensor is not None:
        assert rec.slot is None and rec.state in (
            Residency.AT_REST,
            Residency.COPYING,
            Residency.ON_DEVICE,
        ), rec
    elif rec.state is Residency.AT_REST:
        assert rec.slot is None and rec.holds == 0 and not rec.dirty and not rec.waiters, rec
    elif rec.state is not Residency.READING:
        assert rec.slot is not None, rec
    assert (rec.state is Residency.DIRTY) <= rec.dirty, rec
    assert not (rec.state is Residency.IN_HOST and rec.dirty), rec
