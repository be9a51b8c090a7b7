"""TieredStore: tensors at rest on NVMe (or in host memory), made resident in pool memory and on the device.

The public face of the store: registration, write / fetch / release / evict /
flush, stats and close, over the residency rules of [Note: residency]
(record.py). The facade owns the one lock and the record table (a
StoreState, state.py) and does registration and completion itself; the rest
lives in sibling modules, one concern each, after FSDP2's ``_fully_shard``:

    record.py      one key: KeyRecord, its Residency and asserted moves (tracked.py), Slot
    state.py       the lock, the record table and the helpers every path shares
    read_path.py   fetch: admit, find pool room, prepare, submit, complete a read; release
    write_path.py  write, mark_dirty, write-back, eviction, flush
    device.py      serving a fetch its tier; host-to-device copies and dropping them
    integrity.py   CRC32C per key, taken at write and checked at read
    handles.py     the read and write aio handles; swapspace.py the swap files
    futures.py     IoOp, StoreFuture, the reaper ([Note: completing ops])

Why plain functions over an explicit StoreState rather than mixins or path
objects: every path moves the same records under the same lock, so what a
path touches should be visible at its call sites (``st.lru``, ``st.ops``)
rather than hidden behind ``self``, and each function can say whether it runs
with the lock held. The paths depend on one another (a fetch evicts to make
room; a completed write serves the fetches that waited for it); as functions
that is a one-way import chain, device <- write_path <- read_path <- store,
where path objects would have to hold each other. The facade keeps
completion (``_finish``) because futures and the reaper call it, and it is
where the three paths' completions meet.

Where tier features go: checksums (and their default) in integrity.py; what a
failed write-back reports and when, in write_path.complete_write and
StoreState.io_error / fault_error ([Note: failed write-backs]); what a wait
names, in the futures' labels (futures.py) and StoreState.acquire's pool
label ([Note: no silent waits] in infinity/aio/waits.py); cleanup of a store
never closed, in finalizer.py; drives and striping in swapspace.py
([Note: striping]).

Invariants:
- every key has exactly one KeyRecord; its state says where its data is;
- a key's host view lies in exactly one Slot (pool region), which returns to
  the pool when its last member goes back to rest;
- a dirty key is never dropped: eviction writes it home first, and a failed
  write leaves it dirty and resident, and stops the store until retried;
- a fetch of a key resident or being read never reads it again;
- peak host memory = the pool + the home "cpu" tensors + metadata.

Threading: every public method may be called from any thread. One lock
(``StoreState.lock``, a plain Lock) guards all records, slots, the LRU and the
counters; it is never held while waiting for I/O or for pool space, and
futures are resolved after it is released (see [Note: completing ops] in
futures.py). Lock order: store lock, then pool lock — the pool calls the
store's reclaimer with no lock held (or, on the fetch fast path, try_acquire
under the store lock).
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from infinity.aio import DIRECT_ALIGNMENT, AioConfig, aligned_empty
from infinity.memory import BufferPool, round_up
from infinity.store import finalizer, read_path, write_path
from infinity.store.device import DeviceTier, Tier, complete_copy_in
from infinity.store.errors import StoreIOError
from infinity.store.futures import IoOp, Outcome, Reaper, Settlement, StoreFuture, settle
from infinity.store.handles import AioHandleLike, IoHandles
from infinity.store.integrity import DEFAULT as integrity_default
from infinity.store.integrity import checksums
from infinity.store.record import RESIDENT, KeyRecord, KeySpec, key_label
from infinity.store.state import StoreState
from infinity.store.stats import KeyTraffic, StoreStats
from infinity.store.swapdir import new_store_id
from infinity.store.swapspace import Extent, open_swap
from infinity.timeline import Timeline

log = logging.getLogger("infinity.store")

Home = Literal["nvme", "cpu"]
"""Where a key rests between uses: a swap file on NVMe, or host memory."""
DEFAULT_FILE_NBYTES = 16 << 30


class TieredStore:
    """Tensors with a home tier ("nvme" or "cpu") made resident in pinned host memory and on ``device``.

    ``nvme_path``: a directory, a list of directories (extents are striped over
    them), or None when every key has home "cpu". ``pool``: the BufferPool
    resident keys live in. ``aio``: an AioConfig (the store opens its own read
    and write handles) or an AioHandle-like object to use as is (tests wrap
    one to record or inject failures). ``integrity``: CRC32C per key, stored
    at write and verified at read (on by default, integrity.py).
    ``pool_timeout``: how long a fetch or write waits for pool space before
    its future fails with TimeoutError (a failed write-back or close ends the
    wait at once, with its own error).
    """

    def __init__(
        self,
        nvme_path: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
        *,
        pool: BufferPool,
        aio: AioConfig | AioHandleLike | None = None,
        device: torch.device | str = "cpu",
        name: str = "store",
        integrity: bool = integrity_default,
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
        device_tier = DeviceTier(torch.device(device))
        io = IoHandles.open(aio)
        try:
            swap = open_swap(
                nvme_path,
                handle=io.read,
                store_id=self.id,
                store_name=name,
                stripe_nbytes=stripe_nbytes,
                file_nbytes=file_nbytes,
            )
        except BaseException:
            io.close()
            raise
        io.register_pool(pool.slab, name)
        self._st = StoreState(
            self,
            name=name,
            pool=pool,
            io=io,
            swap=swap,
            device=device_tier,
            reaper=Reaper(self, name),
            integrity=integrity,
            pool_timeout=pool_timeout,
        )
        pool.add_reclaimer(self._reclaim)
        # Not weakref.finalize: the cleanup runs in a thread of its own (finalizer.py).
        self._finalizer = finalizer.on_collect(self, _finalize, self._st)

    @property
    def integrity(self) -> bool:
        """CRC32C per key, stored at write and verified at read (integrity.py)."""
        return self._st.integrity

    @property
    def _rio(self) -> AioHandleLike:
        """The handle reads are submitted to."""
        return self._st.io.read

    @property
    def _wio(self) -> AioHandleLike:
        """The handle writes are submitted to (the same object as ``_rio`` for a caller's handle)."""
        return self._st.io.write

    # -- registration --------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self._st.device.device

    @property
    def directories(self) -> list[Path]:
        """The store's own swap directories (one per drive)."""
        swap = self._st.swap
        return [d.path for d in swap.dirs] if swap else []

    def reserve(self, total_nbytes: int) -> None:
        """Preallocates swap space for ``total_nbytes`` bytes of keys (checked against the free space)."""
        st = self._st
        with st.lock:
            st.check_open()
            if st.swap is None:
                raise ValueError(f"store '{self.name}' has no nvme_path: nothing to reserve")
            st.swap.reserve(round_up(total_nbytes, DIRECT_ALIGNMENT))

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
        recs = [_new_record(key, shape, dtype, home) for key, shape, dtype in specs]
        st = self._st
        if home == "nvme" and st.swap is None and any(r.nbytes for r in recs):
            raise ValueError(
                f"store '{self.name}' has no nvme_path, so keys cannot have home 'nvme'; pass "
                "nvme_path=... or register with home='cpu'"
            )
        for rec in recs:  # allocated outside the lock: first touch of fresh memory is slow
            if home == "cpu" or rec.nbytes == 0:
                _give_home_tensor(rec)
        with st.lock:
            st.check_open()
            seen = set()
            for rec in recs:
                if rec.key in st.records or rec.key in seen:
                    raise KeyError(f"key {rec.key!r} is already registered in store '{self.name}'")
                seen.add(rec.key)
            on_disk = [r for r in recs if r.home_tensor is None]
            if on_disk:
                total = sum(round_up(r.nbytes, DIRECT_ALIGNMENT) for r in on_disk)
                pos = st.swap_space().alloc(total, f"register of {key_label(on_disk)}").offset
                for r in on_disk:
                    r.extent = Extent(pos, round_up(r.nbytes, DIRECT_ALIGNMENT))
                    pos += r.extent.nbytes
            for rec in recs:
                st.records[rec.key] = rec
            return [r.spec() for r in recs]

    def unregister(self, key: Hashable) -> None:
        """Forgets a key and frees its swap extent (its data is discarded)."""
        st = self._st
        with st.lock:
            st.check_open()
            rec = st.record(key)
            st.refuse_if_busy(rec, "unregister")
            if rec.state in RESIDENT:
                st.lru.pop(rec, None)
                rec.to_at_rest(discard=True)
                st.leave_slot(rec)
            if rec.extent is not None:
                st.swap_space().free(rec.extent)
            del st.records[key]
            st.settle_fault()  # its failed write-back, if it had one, is moot now

    def spec(self, key: Hashable) -> KeySpec:
        with self._st.lock:
            return self._st.record(key).spec()

    def locate(self, key: Hashable) -> list[tuple[str, int, int]]:
        """Where a home "nvme" key lies: (file path, file offset, nbytes) per physical run, in order
        (nbytes rounded up to 4 KiB); [] for keys that live in host memory."""
        st = self._st
        with st.lock:
            rec = st.record(key)
            if rec.extent is None:
                return []
            runs = st.swap_space().runs(rec.extent.offset, rec.extent.nbytes)
            return [(r.file.path, r.file_offset, r.nbytes) for r in runs]

    def keys(self) -> list[Hashable]:
        with self._st.lock:
            return list(self._st.records)

    def __contains__(self, key: Hashable) -> bool:
        with self._st.lock:
            return key in self._st.records

    def __len__(self) -> int:
        with self._st.lock:
            return len(self._st.records)

    # -- write (write_path.py) -----------------------------------------------

    def write(self, key: Hashable, tensor: torch.Tensor) -> StoreFuture:
        """Copies ``tensor`` home. The tensor may be reused as soon as this returns.

        For home "nvme" the data goes through a pool region (kept afterwards as
        a clean cache entry). A write of a key being written waits for that
        write first; writing a held key or one being read is refused.
        """
        return write_path.write(self._st, key, tensor)

    def mark_dirty(self, key: Hashable) -> None:
        """Declares that a holder changed the resident data: it is written home before being dropped."""
        write_path.mark_dirty(self._st, key)

    def evict(self, key: Hashable) -> StoreFuture:
        """Drops the key's residency now (dirty: after writing it home). Refused while held or being read."""
        return write_path.evict(self._st, key)

    def flush(self, key: Hashable) -> StoreFuture:
        """Writes a dirty key home (it stays resident, clean). Refused while held."""
        return write_path.flush(self._st, key)

    def flush_all(self) -> StoreFuture:
        """Writes every dirty key home; raises (writing nothing) if a dirty key is held."""
        return write_path.flush_all(self._st)

    # -- fetch / release (read_path.py) --------------------------------------

    def fetch(self, key: Hashable, tier: Tier = "host", *, overwrite: bool = False) -> StoreFuture:
        """Makes ``key`` resident and adds one hold; the future gives a view of the resident tensor.

        Returns once the key has pool memory: when the pool is full it evicts
        cache entries, and if none can go it waits (FIFO, up to pool_timeout;
        a timeout fails the future). The read itself is asynchronous.
        ``overwrite=True``: the caller will overwrite every byte, so nothing is
        read and the key becomes dirty.
        """
        return read_path.fetch(self._st, [key], tier, overwrite)[0]

    def fetch_many(
        self, keys: Sequence[Hashable], tier: Tier = "host", *, overwrite: bool = False
    ) -> list[StoreFuture]:
        """fetch() for several keys; those at rest are read together, up to the pool's buffer_size
        per region and one request per region (keys contiguous on disk: one large read)."""
        return read_path.fetch(self._st, list(keys), tier, overwrite)

    def release(self, key: Hashable) -> None:
        """Drops one hold. An unheld resident key stays cached until the pool needs its room."""
        read_path.release(self._st, (key,))

    def release_many(self, keys: Iterable[Hashable]) -> None:
        """release() for several keys (a key listed n times drops n holds); all or nothing."""
        read_path.release(self._st, keys)

    # -- completion ----------------------------------------------------------

    def _finish(self, op: IoOp, wait: bool = True) -> None:
        """Completes an op exactly once (see [Note: completing ops]); futures and the reaper call it."""
        st = self._st
        with st.lock:
            claimed = op.claimed
            op.claimed = True
        if claimed:
            if wait:
                op.wait_finished()
            return
        err = op.wait_error()
        ended_at = time.monotonic() if Timeline.active is not None else 0.0
        ended = Outcome(err, checksums(st, op, err, caller=wait))
        res: list[Settlement] = []
        try:
            with st.lock:
                # Beside the counters, under the same lock: the trace's bytes are theirs. One
                # append here; the span is formatted once the recording is read ([Note:
                # recording costs no lock] in infinity/timeline/recorder.py).
                tl = Timeline.active
                if tl is not None:
                    tl.deferred(_op_span, (self.name, op, ended_at, err))
                st.ops.discard(op)
                if op.kind == "read":
                    st.read.end(op.nbytes)
                    _count_by_key(st.read_by_key, op, ended)
                    read_path.complete_read(st, op, ended, res)
                elif op.kind == "write":
                    st.write.end(op.nbytes)
                    _count_by_key(st.written_by_key, op, ended)
                    write_path.complete_write(st, op, ended, res)
                else:
                    st.h2d.end(op.nbytes)
                    complete_copy_in(st, op, ended, res)
                write_path.feed_pool(st)
        finally:
            try:
                settle(res)  # before finished: whoever waits on it finds its future settled
            finally:
                op.set_finished()

    def traffic_while(self, fn: Callable[[], None]) -> tuple[int, int]:
        """(bytes read, bytes written) so far, read under the store lock while ``fn()`` runs under it:
        a timeline that ``fn`` switches on or off holds exactly the requests completed after (before)
        these counts ([Note: the tracing window] in infinity/engine/tracing.py)."""
        st = self._st
        with st.lock:
            fn()
            return st.read.nbytes, st.write.nbytes

    def _reclaim(self, nbytes: int) -> None:
        """The pool's reclaimer (registered weakly, so it is a method of the facade)."""
        write_path.reclaim(self._st, nbytes)

    def _count_wait(self, seconds: float) -> None:
        """Time a caller spent blocked in StoreFuture.result (``stats().wait_s``)."""
        self._st.count_wait(seconds)

    # -- stats / close -------------------------------------------------------

    def key_traffic(self) -> KeyTraffic:
        """NVMe bytes read and written per key since the store opened (successful requests only):
        what one key costs, where ``stats()`` gives the totals. Copies both tables (O(keys))."""
        st = self._st
        with st.lock:
            return KeyTraffic(dict(st.read_by_key), dict(st.written_by_key))

    def stats(self) -> StoreStats:
        st = self._st
        with st.lock:
            resident = dirty = held = 0
            for r in st.records.values():
                if r.slot is not None:
                    resident += r.nbytes
                if r.dirty:
                    dirty += r.nbytes
                held += r.holds > 0
            n = st.counts
            return StoreStats(
                name=self.name,
                keys=len(st.records),
                resident_nbytes=resident,
                dirty_nbytes=dirty,
                held_keys=held,
                read=st.read.snapshot(),
                write=st.write.snapshot(),
                h2d=st.h2d.snapshot(),
                d2h=st.d2h.snapshot(),
                in_flight=len(st.ops),
                wait_s=st.wait_s,
                pool_wait_s=st.pool_wait_s,
                fetches=n["fetches"],
                hits=n["hits"],
                shared=n["shared"],
                misses=n["misses"],
                evictions=n["evictions"],
                writebacks=n["writebacks"],
                writes=n["writes"],
                integrity_checks=n["integrity_checks"],
                checksum_nbytes=st.checksum_nbytes,
                checksum_s=st.checksum_s,
                checksum_caller_s=st.checksum_caller_s,
                swap_capacity=st.swap.capacity if st.swap else 0,
                swap_used=st.swap.used if st.swap else 0,
                pool=self.pool.stats(),
            )

    @property
    def closed(self) -> bool:
        return self._st.closed

    @property
    def fault(self) -> StoreIOError | None:
        """The failed write-back that stops this store, until a flush retries it; else None."""
        return self._st.fault

    def check_writebacks(self, action: str) -> None:
        """Raises StoreIOError, naming ``action``, the failed write (errno, file, offset, key) and
        the fix, while a write-back failure stands ([Note: failed write-backs] in write_path.py)."""
        st = self._st
        with st.lock:
            if st.fault is not None:
                raise st.fault_error(action)

    def close(self) -> None:
        """Waits for I/O in flight, returns every region to the pool, removes the swap files. Idempotent."""
        st = self._st
        with st.lock:
            if st.closed or st.closing:
                return
            st.closing = True
            ops = list(st.ops)
        self.pool.wake()  # fetches waiting for pool memory end now (the store is closed)
        while ops:
            for op in ops:
                op.wait_io(None)
                self._finish(op)
            with st.lock:
                ops = list(st.ops)
        with st.lock:
            held = [r.key for r in st.records.values() if r.holds]
            if held:
                log.warning(
                    "store '%s' closed with %d key(s) still held (%r…); their views now point into "
                    "pool memory that will be reused",
                    self.name,
                    len(held),
                    held[0],
                )
            for rec in st.records.values():
                if rec.slot is not None:
                    st.leave_slot(rec)
            st.records.clear()
            st.lru.clear()
            st.closed = True
        st.reaper.stop()
        self.pool.remove_reclaimer(self._reclaim)
        self._finalizer.detach()
        st.io.close()
        if st.swap is not None:
            st.swap.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._st.closed else f"{len(self._st.records)} keys"
        return f"<TieredStore '{self.name}' {state}>"

    def _check_invariants(self) -> int:
        """Asserts the store's invariants (tests call it after every step); returns pool bytes held."""
        with self._st.lock:
            return self._st.check_invariants()


def _count_by_key(table: collections.Counter, op: IoOp, ended: Outcome) -> None:
    """Adds a finished request's bytes to each of its keys' row (a failed one moved nothing)."""
    if ended.error is None:
        for rec in op.recs:
            table[rec.key] += rec.disk_extent().nbytes


def _new_record(key: Hashable, shape: Sequence[int], dtype: torch.dtype, home: Home) -> KeyRecord:
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
    return KeyRecord(key, shape, dtype, nbytes, home)


def _give_home_tensor(rec: KeyRecord) -> None:
    """A key of home "cpu" (or of no bytes) lives in its own host tensor, always resident."""
    if rec.nbytes:
        rec.home_tensor = aligned_empty(rec.nbytes, rec.dtype, huge_pages=False).view(rec.shape)
    else:
        rec.home_tensor = torch.empty(rec.shape, dtype=rec.dtype)
        rec.written = True  # no bytes: nothing to write
    rec.host = rec.home_tensor


def _finalize(st: StoreState) -> None:
    """A store dropped without close(): wait for its I/O, give its regions back, remove its files."""
    for op in list(st.ops):
        op.wait_io(None)
    st.reaper.stop()
    for rec in st.records.values():
        if rec.slot is not None and not rec.slot.region.released:
            rec.slot.members = 0
            rec.slot.region.release()
    st.io.close()
    if st.swap is not None:
        st.swap.close()


def _op_span(
    store: str, op: IoOp, ended_at: float, err: BaseException | None
) -> tuple[str, str, float, float, str, dict[str, Any]]:
    """An op as a timeline span (``Timeline.deferred``'s fields): submitted at ``op.t0``, ended
    when its request was seen done."""
    keys = [r.key for r in op.recs]
    name = f"{op.kind} {keys[0]!r}" if len(keys) == 1 else f"{op.kind} {len(keys)} keys"
    args: dict[str, Any] = {
        "keys": [repr(k) for k in keys],
        "bytes": op.nbytes,
        "tier": "nvme" if op.kind in ("read", "write") else "device",
        "store": store,
    }
    if op.background:
        args["background"] = True
    if err is not None:
        args["error"] = repr(err)
    cat = op.kind if op.kind in ("read", "write") else "copy"
    return name, cat, op.t0, ended_at, f"{store} {cat}", args
