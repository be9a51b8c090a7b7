"""TieredStore: tensors at rest on NVMe (or in host memory), made resident in pool memory and on the device.

The public face of the store: registration, write / fetch / release / evict /
flush, and the residency rules of [Note: residency] (record.py). Swap files
are SwapSpace's, asynchrony is futures.py's, pool memory is the caller's
BufferPool (shared with other stores if the caller likes).

Invariants:
- every key has exactly one KeyRecord; its state says where its data is;
- a key's host view lies in exactly one Slot (pool region), which returns to
  the pool when its last member goes back to rest;
- a dirty key is never dropped: eviction writes it home first, and a failed
  write leaves it dirty and resident;
- a fetch of a key resident or being read never reads it again;
- peak host memory = the pool + the home "cpu" tensors + metadata.

Threading: every public method may be called from any thread. One lock (a
plain Lock) guards all records, slots, the LRU and the counters; it is never
held while waiting for I/O or for pool space, and futures are resolved after
it is released (see [Note: completing ops] in futures.py). Lock order:
store lock, then pool lock — the pool calls the store's reclaimer with no
lock held (or, on the fetch fast path, try_acquire under the store lock).

Size: ~1200 lines, over the ~500-line soft cap. Every method here moves a
key between residency states under the one lock, and the transitions of
[Note: residency] are easiest to check when their triggers (fetch, write,
evict, flush) and their completions (_complete_read/_complete_write) sit
side by side; what is separable already lives elsewhere: the state record
(record.py), swap files and extents (swapspace.py, swapdir.py), futures and
the reaper (futures.py), device copies (device.py), counters (stats.py).
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import threading
import time
import weakref
from collections.abc import Hashable, Iterable, Sequence
from pathlib import Path
from typing import Literal

import torch

from infinity.aio import AioConfig, aligned_empty, crc32c
from infinity.memory import BufferPool, format_nbytes, round_up
from infinity.store.device import DeviceTier
from infinity.store.errors import IntegrityError, StoreIOError, StoreStateError
from infinity.store.futures import IoOp, Reaper, StoreFuture, done_future, gather, settle
from infinity.store.handles import AioHandleLike, IoHandles
from infinity.store.record import IN_IO, RESIDENT, KeyRecord, KeySpec, Residency, Slot
from infinity.store.stats import StoreStats, Traffic
from infinity.store.swapdir import new_store_id
from infinity.store.swapspace import SwapSpace, open_swap

log = logging.getLogger("infinity.store")

Tier = Literal["host", "device"]
Home = Literal["nvme", "cpu"]
ALIGN = 4096
DEFAULT_FILE_NBYTES = 16 << 30


def _key_label(keys: Sequence[KeyRecord]) -> str:
    if len(keys) == 1:
        return f"key {keys[0].key!r}"
    return f"{len(keys)} keys {keys[0].key!r} … {keys[-1].key!r}"


class TieredStore:
    """Tensors with a home tier ("nvme" or "cpu") made resident in pinned host memory and on ``device``.

    ``nvme_path``: a directory, a list of directories (extents are striped over
    them), or None when every key has home "cpu". ``pool``: the BufferPool
    resident keys live in. ``aio``: an AioConfig (the store opens its own read
    and write handles) or an AioHandle-like object to use as is (tests wrap
    one to record or inject failures). ``integrity``: CRC32C per key, stored
    at write and verified at read. ``pool_timeout``: how long a fetch or write
    waits for pool space before its future fails with TimeoutError.
    """

    def __init__(
        self,
        nvme_path: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
        *,
        pool: BufferPool,
        aio: AioConfig | AioHandleLike | None = None,
        device: torch.device | str = "cpu",
        name: str = "store",
        integrity: bool = False,
        file_nbytes: int = DEFAULT_FILE_NBYTES,
        stripe_nbytes: int | None = None,
        pool_timeout: float | None = 300.0,
    ):
        if not isinstance(pool, BufferPool):
            raise TypeError(
                f"pool must be an infinity.memory.BufferPool, got {type(pool).__name__}"
            )
        self.name = name
        self.pool = pool
        self.id = new_store_id(name)
        self.integrity = integrity
        self._pool_timeout = pool_timeout
        self._device = DeviceTier(torch.device(device))
        self._lock = threading.Lock()
        self._stats_lock = threading.Lock()  # the two wait-time sums, updated outside self._lock
        self._records: dict[Hashable, KeyRecord] = {}
        self._lru: collections.OrderedDict[KeyRecord, None] = collections.OrderedDict()
        self._ops: set[IoOp] = set()
        self._closed = False
        self._closing = False
        self._init_counters()

        self._io = IoHandles.open(aio)
        self._rio: AioHandleLike = self._io.read
        self._wio: AioHandleLike = self._io.write
        try:
            self._swap: SwapSpace | None = open_swap(
                nvme_path,
                handle=self._rio,
                store_id=self.id,
                store_name=name,
                stripe_nbytes=stripe_nbytes,
                file_nbytes=file_nbytes,
            )
        except BaseException:
            self._io.close()
            raise
        self._io.register_pool(pool.slab, name)
        self._reaper = Reaper(self._finish, name)
        pool.add_reclaimer(self._reclaim)
        self._finalizer = weakref.finalize(
            self, _finalize, self._records, self._ops, self._swap, self._reaper, self._io
        )

    def _init_counters(self) -> None:
        self._read = Traffic()
        self._write = Traffic()
        self._h2d = Traffic()
        self._d2h = Traffic()
        self._wait_s = 0.0
        self._pool_wait_s = 0.0
        self._evicting_nbytes = 0  # bytes of background write-backs that will free their room
        self._n = collections.Counter()

    # -- registration --------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self._device.device

    @property
    def directories(self) -> list[Path]:
        """The store's own swap directories (one per drive)."""
        return [d.path for d in self._swap.dirs] if self._swap else []

    def reserve(self, total_nbytes: int) -> None:
        """Preallocates swap space for ``total_nbytes`` bytes of keys (checked against the free space)."""
        with self._lock:
            self._check_open()
            if self._swap is None:
                raise ValueError(f"store '{self.name}' has no nvme_path: nothing to reserve")
            self._swap.reserve(round_up(total_nbytes, ALIGN))

    def register(
        self, key: Hashable, shape: Sequence[int], dtype: torch.dtype, *, home: Home = "nvme"
    ) -> KeySpec:
        return self.register_many([(key, shape, dtype)], home=home)[0]

    def register_many(
        self, specs: Iterable[tuple[Hashable, Sequence[int], torch.dtype]], *, home: Home = "nvme"
    ) -> list[KeySpec]:
        """Registers keys laid out contiguously on disk in the given order (register in use order)."""
        if home not in ("nvme", "cpu"):
            raise ValueError(f"home must be 'nvme' or 'cpu', got {home!r}")
        recs = []
        for key, shape, dtype in specs:
            hash(key)
            shape = tuple(int(d) for d in shape)
            if any(d < 0 for d in shape):
                raise ValueError(f"key {key!r}: negative dimension in shape {shape}")
            if not isinstance(dtype, torch.dtype):
                raise TypeError(f"key {key!r}: dtype must be a torch.dtype, got {dtype!r}")
            numel = 1
            for d in shape:
                numel *= d
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            recs.append(KeyRecord(key, shape, dtype, nbytes, home))
        if home == "nvme" and self._swap is None and any(r.nbytes for r in recs):
            raise ValueError(
                f"store '{self.name}' has no nvme_path, so keys cannot have home 'nvme'; pass "
                "nvme_path=... or register with home='cpu'"
            )
        for rec in recs:  # allocated outside the lock: first touch of fresh memory is slow
            if home == "cpu" or rec.nbytes == 0:
                if rec.nbytes:
                    rec.home_tensor = aligned_empty(rec.nbytes, rec.dtype, huge_pages=False).view(
                        rec.shape
                    )
                else:
                    rec.home_tensor = torch.empty(rec.shape, dtype=rec.dtype)
                    rec.written = True  # no bytes: nothing to write
                rec.host = rec.home_tensor
        with self._lock:
            self._check_open()
            seen = set()
            for rec in recs:
                if rec.key in self._records or rec.key in seen:
                    raise KeyError(f"key {rec.key!r} is already registered in store '{self.name}'")
                seen.add(rec.key)
            on_disk = [r for r in recs if r.home_tensor is None]
            if on_disk:
                total = sum(round_up(r.nbytes, ALIGN) for r in on_disk)
                ext = self._swap.alloc(total, f"register of {_key_label(on_disk)}")
                pos = ext.offset
                for r in on_disk:
                    r.extent = type(ext)(pos, round_up(r.nbytes, ALIGN))
                    pos += r.extent.nbytes
            for rec in recs:
                self._records[rec.key] = rec
            return [r.spec() for r in recs]

    def unregister(self, key: Hashable) -> None:
        """Forgets a key and frees its swap extent (its data is discarded)."""
        with self._lock:
            self._check_open()
            rec = self._rec(key)
            self._refuse_if_busy(rec, "unregister")
            if rec.state in RESIDENT:
                self._lru.pop(rec, None)
                rec.to_at_rest(discard=True)
                self._leave_slot(rec)
            if rec.extent is not None:
                self._swap.free(rec.extent)
            del self._records[key]

    def spec(self, key: Hashable) -> KeySpec:
        with self._lock:
            return self._rec(key).spec()

    def locate(self, key: Hashable) -> list[tuple[str, int, int]]:
        """Where a home "nvme" key lies: (file path, file offset, nbytes) per physical run, in order
        (nbytes rounded up to 4 KiB); [] for keys that live in host memory."""
        with self._lock:
            rec = self._rec(key)
            if rec.extent is None:
                return []
            runs = self._swap.runs(rec.extent.offset, rec.extent.nbytes)
            return [(r.file.path, r.file_offset, r.nbytes) for r in runs]

    def keys(self) -> list[Hashable]:
        with self._lock:
            return list(self._records)

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._records

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)

    # -- write ---------------------------------------------------------------

    def write(self, key: Hashable, tensor: torch.Tensor) -> StoreFuture:
        """Copies ``tensor`` home. The tensor may be reused as soon as this returns.

        For home "nvme" the data goes through a pool region (kept afterwards as
        a clean cache entry). A write of a key being written waits for that
        write first; writing a held key or one being read is refused.
        """
        label = f"write of key {key!r}"
        while True:
            with self._lock:
                self._check_open()
                rec = self._rec(key)
                self._check_tensor(rec, tensor)
                if rec.state is Residency.WRITING and rec.holds == 0:
                    pending = rec.write_future  # writes to one key are ordered: wait, then retry
                else:
                    self._refuse_if_busy(rec, "write")
                    self._n["writes"] += 1
                    if rec.home_tensor is not None:
                        rec.home_tensor.copy_(tensor.reshape(rec.shape))
                        rec.written = True
                        return done_future(None, label)
                    need_region = rec.state is Residency.AT_REST
                    rec.to_writing()
                    self._lru.pop(rec, None)
                    fut = StoreFuture(self, None, label)
                    rec.write_future = fut
                    break
            try:
                pending.result()
            except Exception:
                pass  # a failed write left the key dirty; this write replaces its data
        try:
            if need_region:
                region = self._acquire(rec.extent.nbytes, label)
            with torch.no_grad():
                target = (
                    rec.host
                    if not need_region
                    else region.bytes_at(0, rec.nbytes).view(rec.dtype).view(rec.shape)
                )
                target.copy_(tensor.reshape(rec.shape))
        except BaseException as e:
            with self._lock:
                if need_region:
                    rec.to_at_rest()
                else:
                    rec.to_dirty()  # the resident copy may be half overwritten: it is newer than home
                    self._sync_lru(rec)
                waiters, rec.waiters = rec.waiters, []
                rec.holds -= len(waiters)
                rec.write_future = None
            for w, _tier in waiters:
                w.set_exception(e)
            if isinstance(e, Exception):
                fut.set_exception(e)
                return fut
            raise
        with self._lock:
            if need_region:
                if self._closed or self._closing:
                    region.release()
                    rec.to_at_rest()
                    rec.write_future = None
                    fut.set_exception(self._closed_error())
                    return fut
                self._join_slot(rec, Slot(region), 0)
            self._submit_write([rec], background=False)
        return fut

    # -- fetch / release -----------------------------------------------------

    def fetch(self, key: Hashable, tier: Tier = "host", *, overwrite: bool = False) -> StoreFuture:
        """Makes ``key`` resident and adds one hold; the future gives a view of the resident tensor.

        Returns once the key has pool memory: when the pool is full it evicts
        cache entries, and if none can go it waits (FIFO, up to pool_timeout;
        a timeout fails the future). The read itself is asynchronous.
        ``overwrite=True``: the caller will overwrite every byte, so nothing is
        read and the key becomes dirty.
        """
        return self._fetch([key], tier, overwrite)[0]

    def fetch_many(
        self, keys: Sequence[Hashable], tier: Tier = "host", *, overwrite: bool = False
    ) -> list[StoreFuture]:
        """fetch() for several keys; those at rest are read together, up to the pool's buffer_size
        per region and one request per region (keys contiguous on disk: one large read)."""
        return self._fetch(list(keys), tier, overwrite)

    def release(self, key: Hashable) -> None:
        """Drops one hold. An unheld resident key stays cached until the pool needs its room."""
        with self._lock:
            self._check_open()
            rec = self._rec(key)
            if rec.holds == 0:
                raise self._not_held(rec)
            self._unhold(rec)
            self._feed_pool()

    def release_many(self, keys: Iterable[Hashable]) -> None:
        """release() for several keys (a key listed n times drops n holds); all or nothing."""
        with self._lock:
            self._check_open()
            recs = [self._rec(k) for k in keys]
            counts = collections.Counter(id(r) for r in recs)
            for rec in recs:
                if rec.holds < counts[id(rec)]:
                    raise self._not_held(rec)
            for rec in recs:
                self._unhold(rec)
            self._feed_pool()

    def _unhold(self, rec: KeyRecord) -> None:
        rec.holds -= 1
        if rec.holds == 0 and rec.device is not None and rec.state is Residency.ON_DEVICE:
            self._drop_device(rec)
        self._sync_lru(rec)

    @staticmethod
    def _not_held(rec: KeyRecord) -> StoreStateError:
        return StoreStateError(
            f"release of key {rec.key!r}, which is not held (state {rec.state.value}): "
            "every release must follow a fetch"
        )

    def mark_dirty(self, key: Hashable) -> None:
        """Declares that a holder changed the resident data: it is written home before being dropped."""
        with self._lock:
            self._check_open()
            rec = self._rec(key)
            if rec.holds == 0:
                raise StoreStateError(
                    f"mark_dirty of key {rec.key!r}, which is not held (state {rec.state.value}): "
                    "fetch it, change it, mark it dirty, then release it"
                )
            if rec.state in IN_IO:
                raise StoreStateError(
                    f"mark_dirty of key {rec.key!r} while its fetch is still in flight (state "
                    f"{rec.state.value}): wait for the fetch's result first"
                )
            if rec.state is Residency.ON_DEVICE:
                rec.device_dirty = True
                rec.dirty = rec.home_tensor is None
            elif rec.home_tensor is None:
                rec.to_dirty()

    # -- evict / flush -------------------------------------------------------

    def evict(self, key: Hashable) -> StoreFuture:
        """Drops the key's residency now (dirty: after writing it home). Refused while held or being read."""
        with self._lock:
            self._check_open()
            rec = self._rec(key)
            label = f"evict of key {key!r}"
            if rec.home_tensor is not None or rec.state is Residency.AT_REST:
                if rec.holds:
                    self._refuse_if_busy(rec, "evict")
                return done_future(None, label)
            if rec.state is Residency.WRITING and rec.holds == 0:
                rec.evict_after_write = True
                return rec.write_future
            self._refuse_if_busy(rec, "evict")
            if rec.state is Residency.IN_HOST:
                self._evict_clean(rec)
                self._feed_pool()
                return done_future(None, label)
            if rec.error is not None:
                raise StoreStateError(
                    f"evict of key {rec.key!r}: its last write home failed ({rec.error}); it stays "
                    "resident so nothing is lost — flush it to retry"
                )
            return self._submit_write([rec], background=False, evict=True)[0]

    def flush(self, key: Hashable) -> StoreFuture:
        """Writes a dirty key home (it stays resident, clean). Refused while held."""
        with self._lock:
            self._check_open()
            rec = self._rec(key)
            if rec.state is Residency.WRITING and rec.holds == 0:
                return rec.write_future
            if rec.state is not Residency.DIRTY:
                if rec.holds and rec.dirty:
                    self._refuse_if_busy(rec, "flush")
                return done_future(None, f"flush of key {key!r}")
            self._refuse_if_busy(rec, "flush")
            rec.error = None
            return self._submit_write([rec], background=False)[0]

    def flush_all(self) -> StoreFuture:
        """Writes every dirty key home; raises (writing nothing) if a dirty key is held."""
        with self._lock:
            self._check_open()
            held = [r for r in self._records.values() if r.dirty and r.holds]
            if held:
                names = ", ".join(repr(r.key) for r in held[:5]) + (" …" if len(held) > 5 else "")
                raise StoreStateError(
                    f"flush_all of store '{self.name}': {len(held)} dirty key(s) are still held ({names}); "
                    "release them first"
                )
            dirty = [r for r in self._records.values() if r.state is Residency.DIRTY]
            writing = [
                r.write_future for r in self._records.values() if r.state is Residency.WRITING
            ]
            for r in dirty:
                r.error = None
            futs = self._submit_write(dirty, background=False) if dirty else []
            return gather(futs + writing, f"flush_all of store '{self.name}'")

    # -- stats / close -------------------------------------------------------

    def stats(self) -> StoreStats:
        with self._lock:
            resident = dirty = held = 0
            for r in self._records.values():
                if r.slot is not None:
                    resident += r.nbytes
                if r.dirty:
                    dirty += r.nbytes
                held += r.holds > 0
            n = self._n
            return StoreStats(
                name=self.name,
                keys=len(self._records),
                resident_nbytes=resident,
                dirty_nbytes=dirty,
                held_keys=held,
                read=self._read.snapshot(),
                write=self._write.snapshot(),
                h2d=self._h2d.snapshot(),
                d2h=self._d2h.snapshot(),
                in_flight=len(self._ops),
                wait_s=self._wait_s,
                pool_wait_s=self._pool_wait_s,
                fetches=n["fetches"],
                hits=n["hits"],
                shared=n["shared"],
                misses=n["misses"],
                evictions=n["evictions"],
                writebacks=n["writebacks"],
                writes=n["writes"],
                integrity_checks=n["integrity_checks"],
                swap_capacity=self._swap.capacity if self._swap else 0,
                swap_used=self._swap.used if self._swap else 0,
                pool=self.pool.stats(),
            )

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Waits for I/O in flight, returns every region to the pool, removes the swap files. Idempotent."""
        with self._lock:
            if self._closed or self._closing:
                return
            self._closing = True
            ops = list(self._ops)
        while ops:
            for op in ops:
                op.wait_io(None)
                self._finish(op)
            with self._lock:
                ops = list(self._ops)
        with self._lock:
            held = [r.key for r in self._records.values() if r.holds]
            if held:
                log.warning(
                    "store '%s' closed with %d key(s) still held (%r…); their views now point into "
                    "pool memory that will be reused",
                    self.name,
                    len(held),
                    held[0],
                )
            for rec in self._records.values():
                if rec.slot is not None:
                    self._leave_slot(rec)
            self._records.clear()
            self._lru.clear()
            self._closed = True
        self._reaper.stop()
        self.pool.remove_reclaimer(self._reclaim)
        self._finalizer.detach()
        self._io.close()
        if self._swap is not None:
            self._swap.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._records)} keys"
        return f"<TieredStore '{self.name}' {state}>"

    def _check_invariants(self) -> int:
        """Asserts the store's invariants (tests call it after every step); returns pool bytes held."""
        with self._lock:
            slots: dict[int, tuple[Slot, int]] = {}
            for rec in self._records.values():
                assert rec.holds >= 0, rec
                if rec.home_tensor is not None:
                    assert rec.slot is None and rec.state in (
                        Residency.AT_REST,
                        Residency.COPYING,
                        Residency.ON_DEVICE,
                    ), rec
                elif rec.state is Residency.AT_REST:
                    assert (
                        rec.slot is None and rec.holds == 0 and not rec.dirty and not rec.waiters
                    ), rec
                elif rec.state is not Residency.READING:
                    assert rec.slot is not None, rec
                assert (rec.state is Residency.DIRTY) <= rec.dirty, rec
                assert not (rec.state is Residency.IN_HOST and rec.dirty), rec
                assert (rec in self._lru) == rec.idle, rec
                if rec.op is not None:
                    assert rec.op in self._ops or rec.op.claimed, rec
                if rec.slot is not None:
                    slot, n = slots.get(id(rec.slot), (rec.slot, 0))
                    slots[id(rec.slot)] = (slot, n + 1)
            for slot, n in slots.values():
                assert slot.members == n and not slot.region.released, (slot.members, n)
            assert len(self._lru) == sum(1 for r in self._records.values() if r.idle)
            return sum(slot.region.size for slot, _n in slots.values())

    # -- internals: fetch ----------------------------------------------------

    def _fetch(self, keys: list[Hashable], tier: Tier, overwrite: bool) -> list[StoreFuture]:
        if tier not in ("host", "device"):
            raise ValueError(f"tier must be 'host' or 'device', got {tier!r}")
        res: list = []
        futs: list[StoreFuture] = []
        to_load: list[KeyRecord] = []
        prepared = None
        with self._lock:
            self._check_open()
            recs = [self._rec(k) for k in keys]
            self._check_fetchable(recs, overwrite)
            self._n["fetches"] += len(recs)
            for rec in recs:
                fut = StoreFuture(self, rec.op, ("fetch of key", rec.key))
                futs.append(fut)
                rec.holds += 1
                st = rec.state
                if rec.home_tensor is not None:
                    self._n["hits"] += 1
                    rec.written |= overwrite
                    self._serve(rec, fut, tier, res)
                elif st is Residency.AT_REST:
                    rec.to_reading()
                    rec.waiters.append((fut, tier))
                    to_load.append(rec)
                elif st in (Residency.READING, Residency.WRITING, Residency.COPYING):
                    self._n["shared"] += 1
                    rec.waiters.append((fut, tier))
                    rec.pending_dirty |= overwrite and st is not Residency.COPYING
                    if st is Residency.COPYING and overwrite:
                        rec.device_dirty = True
                else:
                    self._n["hits"] += 1
                    if overwrite and st is Residency.IN_HOST:
                        rec.to_dirty()
                    elif overwrite and st is Residency.ON_DEVICE:
                        # the copy the caller overwrites is the one it fetched
                        rec.device_dirty |= tier == "device"
                        rec.dirty = True
                    self._serve(rec, fut, tier, res)
                self._sync_lru(rec)
            prepared = self._load_now(to_load, overwrite, res) if to_load else None
            if prepared is not None:
                to_load = []
        if prepared is not None and prepared is not True:
            self._submit_read(*prepared)
        settle(res)
        if to_load:
            self._load(to_load, overwrite)
        return futs

    def _load_now(self, recs: list[KeyRecord], overwrite: bool, res: list):
        """The fast path of _load, under the lock: when one region serves every key and the pool
        has it free now, take it here. Returns the read to submit, True when nothing needs
        reading, or None to go the slow way (_load, outside the lock)."""
        total = sum(r.extent.nbytes for r in recs)
        if len(recs) > 1 and total > self.pool.buffer_size:
            return None
        name = f"store '{self.name}': fetch of {_key_label(recs)}"
        region = self.pool.try_acquire(total, name=name)
        if region is None and not self.pool.waiting_nbytes():
            self._evict_until(total)  # a full cache is the steady state: make room here
            region = self.pool.try_acquire(total, name=name)
        if region is None:
            return None
        slot = Slot(region)
        self._join_group(recs, slot)
        self._n["misses"] += len(recs)
        if not overwrite:
            return self._prepare_read(recs, slot)
        for rec in recs:
            rec.to_dirty()
            rec.pending_dirty = False
            self._serve_waiters(rec, res)
            self._sync_lru(rec)
        return True

    def _check_fetchable(self, recs: list[KeyRecord], overwrite: bool) -> None:
        new = 0
        largest: KeyRecord | None = None
        for rec in recs:
            if rec.state is not Residency.AT_REST:
                continue
            if not overwrite and not rec.written:
                raise StoreStateError(
                    f"fetch of key {rec.key!r}, which was registered but never written: write() it "
                    "first, or fetch it with overwrite=True to fill it"
                )
            if rec.home_tensor is None:
                new += rec.extent.nbytes
                if largest is None or rec.extent.nbytes > largest.extent.nbytes:
                    largest = rec
        if largest is not None:
            self.pool.check_servable(
                largest.extent.nbytes, f"key {largest.key!r} of store '{self.name}'"
            )
        if new > self.pool.capacity:
            self.pool.check_servable(
                new, f"fetch_many of {len(recs)} keys of store '{self.name}' (held at once)"
            )

    def _load(self, recs: list[KeyRecord], overwrite: bool) -> None:
        """Finds regions for keys now READING (outside the lock) and reads them in."""
        groups: list[list[KeyRecord]] = []
        size = 0
        for rec in recs:
            if not groups or size + rec.extent.nbytes > self.pool.buffer_size:
                groups.append([])
                size = 0
            groups[-1].append(rec)
            size += rec.extent.nbytes
        for i, group in enumerate(groups):
            label = f"store '{self.name}': fetch of {_key_label(group)}"
            try:
                region = self._acquire(sum(r.extent.nbytes for r in group), label)
            except BaseException as e:
                self._abort_loads([r for g in groups[i:] for r in g], e)
                if isinstance(e, Exception):
                    return
                raise
            res: list = []
            prepared = None
            with self._lock:
                if self._closed or self._closing:
                    region.release()
                    abort = True
                else:
                    abort = False
                    slot = Slot(region)
                    self._join_group(group, slot)
                    self._n["misses"] += len(group)
                    if overwrite:
                        for rec in group:
                            rec.to_dirty()
                            rec.pending_dirty = False
                            self._serve_waiters(rec, res)
                            self._sync_lru(rec)
                    else:
                        prepared = self._prepare_read(group, slot)
            if prepared is not None:
                self._submit_read(*prepared)
            if abort:
                self._abort_loads([r for g in groups[i:] for r in g], self._closed_error())
                return
            settle(res)

    def _abort_loads(self, recs: list[KeyRecord], exc: BaseException) -> None:
        res = []
        with self._lock:
            for rec in recs:
                if rec.state is Residency.READING and rec.slot is None:
                    rec.to_at_rest()
                    rec.holds = 0
                    rec.pending_dirty = False
                    waiters, rec.waiters = rec.waiters, []
                    res.extend((f, None, exc) for f, _t in waiters)
        settle(res)

    def _serve(self, rec: KeyRecord, fut: StoreFuture, tier: Tier, res: list) -> None:
        """Resolves a fetch of a key whose data is in host memory (or starts its device copy)."""
        if tier == "host" or not self._device.separate:
            res.append((fut, rec.host, None))
        elif rec.state is Residency.ON_DEVICE:
            res.append((fut, rec.device, None))
        elif rec.state is Residency.COPYING:
            rec.waiters.append((fut, tier))
        else:
            rec.waiters.append((fut, tier))
            self._start_copy_in(rec)

    def _serve_waiters(self, rec: KeyRecord, res: list) -> None:
        waiters, rec.waiters = rec.waiters, []
        for fut, tier in waiters:
            self._serve(rec, fut, tier, res)

    # -- internals: I/O ------------------------------------------------------

    def _acquire(self, nbytes: int, label: str):
        t0 = time.monotonic()
        try:
            return self.pool.acquire(nbytes, timeout=self._pool_timeout, name=label)
        finally:
            dt = time.monotonic() - t0
            with self._stats_lock:
                self._pool_wait_s += dt

    def _items(self, recs: list[KeyRecord], slot: Slot) -> list[tuple]:
        """(buffer, file, offset) items for the keys, merging keys adjacent both on disk and in the slot."""
        ranges: list[list[int]] = []  # [logical offset, nbytes, slot offset]
        for rec in sorted(recs, key=lambda r: r.slot_offset):
            ext = rec.extent
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
            for run in self._swap.runs(off, n):
                items.append(
                    (region.bytes_at(slot_off + run.rel, run.nbytes), run.file, run.file_offset)
                )
        return items

    def _prepare_read(self, recs: list[KeyRecord], slot: Slot) -> tuple[IoOp, list[tuple]]:
        """Registers the read of ``recs`` into ``slot``; the caller submits it after unlocking."""
        op = IoOp("read", None, recs, sum(r.extent.nbytes for r in recs))
        for rec in recs:
            rec.op = op
            for fut, _tier in rec.waiters:
                fut.follow(op)
        self._read.start()
        self._ops.add(op)
        return op, self._items(recs, slot)

    def _submit_read(self, op: IoOp, items: list[tuple]) -> None:
        """Submits a prepared read, outside the store lock (submission takes microseconds that
        other threads, the reaper above all, should not spend waiting for the lock)."""
        try:
            op.attach(self._rio.pread_many(items))
        except Exception as e:  # e.g. the handle was closed: the op fails like a failed read
            op.fail_submit(e)
        self._reaper.add(op)

    def _submit_write(
        self, recs: list[KeyRecord], *, background: bool, evict: bool = False
    ) -> list[StoreFuture]:
        """Writes resident keys home, one request per slot; returns one future per key."""
        by_slot: dict[int, list[KeyRecord]] = {}
        for rec in recs:
            by_slot.setdefault(id(rec.slot), []).append(rec)
        futs = []
        for group in by_slot.values():
            for rec in group:
                if rec.state is not Residency.WRITING:
                    rec.to_writing()
                    rec.write_future = StoreFuture(self, None, f"write of key {rec.key!r}")
                rec.evict_after_write = evict
                self._lru.pop(rec, None)
            req = self._wio.pwrite_many(self._items(group, group[0].slot))
            op = IoOp(
                "write", req, group, sum(r.extent.nbytes for r in group), background=background
            )
            for rec in group:
                rec.op = op
                rec.write_future.follow(op)
                for fut, _tier in rec.waiters:
                    fut.follow(op)
                futs.append(rec.write_future)
            self._write.start()
            self._ops.add(op)
            self._reaper.add(op)
        return futs

    def _finish(self, op: IoOp, wait: bool = True) -> None:
        """Completes an op exactly once (see [Note: completing ops])."""
        with self._lock:
            claimed = op.claimed
            op.claimed = True
        if claimed:
            if wait:
                op.wait_finished()
            return
        err = op.wait_error()
        crcs = None
        if self.integrity and err is None and op.kind in ("read", "write"):
            crcs = [crc32c(r.slot.region.bytes_at(r.slot_offset, r.nbytes)) for r in op.recs]
        res: list = []
        try:
            with self._lock:
                self._ops.discard(op)
                if op.kind == "read":
                    self._read.end(op.nbytes)
                    self._complete_read(op, err, crcs, res)
                elif op.kind == "write":
                    self._write.end(op.nbytes)
                    self._complete_write(op, err, crcs, res)
                else:
                    self._h2d.end(op.nbytes)
                    self._complete_copy_in(op, err, res)
                self._feed_pool()
        finally:
            try:
                settle(res)  # before finished: whoever waits on it finds its future settled
            finally:
                op.set_finished()

    def _io_error(self, rec: KeyRecord, verb: str, err: BaseException) -> StoreIOError:
        where = self._swap.describe(rec.extent.offset, rec.extent.nbytes)
        return StoreIOError(
            getattr(err, "errno", None) or errno.EIO,
            f"{verb} of key {rec.key!r} ({format_nbytes(rec.nbytes)}, at {where}) in store "
            f"'{self.name}' failed: {err}",
            key=rec.key,
        )

    def _complete_read(
        self, op: IoOp, err: BaseException | None, crcs: list[int] | None, res: list
    ) -> None:
        for i, rec in enumerate(op.recs):
            rec.op = None
            exc: BaseException | None = None
            if err is not None:
                exc = self._io_error(rec, "fetch", err)
                exc.__cause__ = err
            elif crcs is not None and rec.crc is not None:
                self._n["integrity_checks"] += 1
                if crcs[i] != rec.crc:
                    exc = IntegrityError(
                        f"checksum mismatch for key {rec.key!r} in store '{self.name}': read "
                        f"{format_nbytes(rec.nbytes)} from {self._swap.describe(rec.extent.offset, rec.nbytes)} "
                        f"with CRC32C {crcs[i]:#010x}, but {rec.crc:#010x} was written; the swap file "
                        "was changed behind the store's back or the drive returned bad data",
                        key=rec.key,
                    )
            if exc is not None:
                waiters, rec.waiters = rec.waiters, []
                rec.holds = 0
                rec.pending_dirty = False
                rec.to_at_rest()
                self._leave_slot(rec)
                res.extend((f, None, exc) for f, _t in waiters)
            else:
                if rec.pending_dirty:
                    rec.to_dirty()
                    rec.pending_dirty = False
                else:
                    rec.to_in_host()
                self._serve_waiters(rec, res)
            self._sync_lru(rec)

    def _complete_write(
        self, op: IoOp, err: BaseException | None, crcs: list[int] | None, res: list
    ) -> None:
        for i, rec in enumerate(op.recs):
            rec.op = None
            wf, rec.write_future = rec.write_future, None
            evict, rec.evict_after_write = rec.evict_after_write, False
            if op.background and evict:
                self._evicting_nbytes -= rec.extent.nbytes
            self._n["writebacks"] += 1
            if err is not None:
                exc = self._io_error(rec, "write", err)
                exc.__cause__ = err
                rec.to_dirty()  # still resident: nothing is lost
                rec.pending_dirty = False
                if op.background:
                    rec.error = exc
                res.append((wf, None, exc))
            else:
                rec.written = True
                if crcs is not None:
                    rec.crc = crcs[i]
                if rec.pending_dirty:
                    rec.to_dirty()
                    rec.pending_dirty = False
                elif evict and rec.holds == 0 and not rec.waiters:
                    rec.to_at_rest()
                    self._leave_slot(rec)
                    self._n["evictions"] += 1
                else:
                    rec.to_in_host()
                res.append((wf, None, None))
            self._serve_waiters(rec, res)
            self._sync_lru(rec)

    # -- internals: device tier (CUDA) ----------------------------------------

    def _start_copy_in(self, rec: KeyRecord) -> None:
        rec.to_copying()
        dev, req = self._device.copy_in(rec.host)
        rec.device = dev
        op = IoOp("h2d", req, [rec], rec.nbytes)
        rec.op = op
        for fut, _tier in rec.waiters:
            fut.follow(op)
        self._h2d.start()
        self._ops.add(op)
        self._reaper.add(op)

    def _complete_copy_in(self, op: IoOp, err: BaseException | None, res: list) -> None:
        rec = op.recs[0]
        rec.op = None
        rec.to_on_device()
        if err is None:
            for fut, tier in rec.waiters:
                res.append((fut, rec.device if tier == "device" else rec.host, None))
            rec.waiters = []
        else:
            waiters, rec.waiters = rec.waiters, []
            res.extend((f, None, err) for f, _t in waiters)
        if rec.holds == 0 or err is not None:
            self._drop_device(rec)

    def _drop_device(self, rec: KeyRecord) -> None:
        if rec.device_dirty:
            self._d2h.start()
            self._device.copy_out(rec.device, rec.host)
            self._d2h.end(rec.nbytes)
        dirty = rec.dirty or (rec.device_dirty and rec.home_tensor is None)
        rec.device = None
        rec.device_dirty = False
        if rec.home_tensor is not None:
            rec.to_at_rest()
        elif dirty:
            rec.to_dirty()
        else:
            rec.to_in_host()

    # -- internals: residency and the pool -----------------------------------

    def _join_slot(self, rec: KeyRecord, slot: Slot, offset: int) -> None:
        rec.slot = slot
        rec.slot_offset = offset
        slot.members += 1
        rec.host = slot.region.bytes_at(offset, rec.nbytes).view(rec.dtype).view(rec.shape)

    def _join_group(self, recs: list[KeyRecord], slot: Slot) -> None:
        """_join_slot for keys back to back in ``slot``: one split makes all their views."""
        dtype = recs[0].dtype
        if len(recs) == 1 or any(r.dtype != dtype for r in recs):
            off = 0
            for rec in recs:
                self._join_slot(rec, slot, off)
                off += rec.extent.nbytes
            return
        itemsize = torch.empty((), dtype=dtype).element_size()
        total = sum(r.extent.nbytes for r in recs)
        typed = slot.region.bytes_at(0, total).view(dtype)
        parts = typed.split([r.extent.nbytes // itemsize for r in recs])
        off = 0
        for rec, part in zip(recs, parts, strict=True):
            rec.slot = slot
            rec.slot_offset = off
            off += rec.extent.nbytes
            numel = rec.nbytes // itemsize
            rec.host = (part if part.numel() == numel else part[:numel]).view(rec.shape)
        slot.members += len(recs)

    def _leave_slot(self, rec: KeyRecord) -> None:
        slot = rec.slot
        rec.slot = None
        rec.host = None
        slot.members -= 1
        if slot.members == 0:
            slot.region.release()

    def _sync_lru(self, rec: KeyRecord) -> None:
        if rec.idle:
            self._lru.pop(rec, None)
            self._lru[rec] = None
        else:
            self._lru.pop(rec, None)

    def _evict_clean(self, rec: KeyRecord) -> None:
        self._lru.pop(rec, None)
        rec.to_at_rest()
        self._leave_slot(rec)
        self._n["evictions"] += 1

    def _evict_until(self, nbytes: int) -> None:
        """Evicts cache entries, oldest first, until the pool can serve ``nbytes`` (or none are left)."""
        if self._closing:
            return  # close() is draining I/O: start no more
        dirty = []
        # Dirty entries free their room only when their write-back ends; room
        # already on its way counts, so one need does not flush the whole cache.
        while self._lru and not self.pool.can_serve(nbytes) and self._evicting_nbytes < nbytes:
            rec, _ = self._lru.popitem(last=False)
            if rec.state is Residency.IN_HOST:
                self._evict_clean(rec)
            else:
                dirty.append(rec)
                self._evicting_nbytes += rec.extent.nbytes
        if dirty:
            self._submit_write(dirty, background=True, evict=True)

    def _feed_pool(self) -> None:
        """When someone waits for pool space, gives it cache entries (called at the end of changes)."""
        need = self.pool.waiting_nbytes()
        if need and self._lru:
            self._evict_until(need)

    def _reclaim(self, nbytes: int) -> None:
        """The pool's reclaimer: called with no lock held by the thread at the head of its queue."""
        with self._lock:
            if not self._closed:
                self._evict_until(nbytes)

    # -- internals: checks ---------------------------------------------------

    def _rec(self, key: Hashable) -> KeyRecord:
        try:
            return self._records[key]
        except KeyError:
            raise KeyError(f"key {key!r} is not registered in store '{self.name}'") from None
        except TypeError:
            raise TypeError(f"keys must be hashable, got {type(key).__name__}") from None

    def _check_open(self) -> None:
        if self._closed or self._closing:
            raise self._closed_error()

    def _closed_error(self) -> StoreStateError:
        return StoreStateError(f"store '{self.name}' is closed")

    def _refuse_if_busy(self, rec: KeyRecord, action: str) -> None:
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

    def _check_tensor(self, rec: KeyRecord, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"write of key {rec.key!r}: expected a tensor, got {type(tensor).__name__}"
            )
        if tensor.dtype != rec.dtype or tensor.numel() * tensor.element_size() != rec.nbytes:
            raise ValueError(
                f"write of key {rec.key!r}: got a {tensor.dtype} tensor of shape {tuple(tensor.shape)}, "
                f"but the key was registered as {rec.dtype} {rec.shape}"
            )

    def _count_wait(self, seconds: float) -> None:
        with self._stats_lock:
            self._wait_s += seconds


def _finalize(records, ops, swap, reaper, io: IoHandles) -> None:
    """A store dropped without close(): wait for its I/O, give its regions back, remove its files."""
    for op in list(ops):
        op.wait_io(None)
    reaper.stop()
    for rec in records.values():
        if rec.slot is not None and not rec.slot.region.released:
            rec.slot.members = 0
            rec.slot.region.release()
    io.close()
    if swap is not None:
        swap.close()
