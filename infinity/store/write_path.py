"""The write path: how newer data gets home — write(), mark_dirty, write-back, eviction, flush.

Data reaches home in three ways, all ending in ``submit_write`` (one request
per pool region, the keys WRITING until it completes in ``complete_write``):
- ``write``: the caller's tensor is copied into the key's region (a fresh one
  for a key AT_REST) and written home; the region stays as a clean cache entry;
- ``flush`` / ``flush_all``: DIRTY keys are written home and stay resident;
- eviction: when the pool needs room (its reclaimer, or ``feed_pool`` at the
  end of a change while someone waits for pool space), cache entries go,
  oldest first: clean ones at once, dirty ones after a background write-back
  (``evict_after_write``). ``evict`` does the same for one key, now.

A failed write leaves its keys DIRTY and resident, so nothing is lost: the
future of an explicit write, flush or evict fails with StoreIOError naming the
key, file and offset, and the failure stands for the store as a whole:

[Note: failed write-backs]
Nobody waits for a background write-back (eviction's), nor for the evictions
and flushes the optimizer starts and leaves running, so a failed write home
must not wait to be noticed: a drive failing on writes used to show only as a
fetch timing out minutes later for pool space the unwritten data held. Now,
whoever started the write:
- the error (errno, file, offset, key) is logged at once, kept on the record
  (``KeyRecord.error``: the key stays DIRTY and resident, no longer a cache
  entry, so its data is never dropped) and becomes the store's ``fault``;
- while the fault stands, every call that needs the drive (fetch, write, and
  each wait for pool memory, which is woken) raises StoreIOError naming it
  and the keys held back (StoreState.check_usable, fault_error); release,
  evict of clean keys, flush and close still work. The engine asks its
  stores before each forward, backward and step (TieredStore.check_writebacks);
- ``flush(key)`` / ``flush_all()`` retry: once no key's write-back has failed
  since, the fault is cleared and the store carries on. A failed retry keeps it.
Keeping the data (rather than dropping it and failing later reads) is the
choice: a transient error (a full file system being cleaned, a drive reset)
can be retried without losing a step, and otherwise the error is immediate
and says to resume from a checkpoint.

Threading: the entry points (``write``, ``mark_dirty``, ``evict``, ``flush``,
``flush_all``, ``reclaim``) take the store lock themselves; the others are
called with it held. ``write`` waits for pool space and copies the
caller's tensor without the lock.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import NamedTuple

import torch

from infinity.memory import PoolRegion
from infinity.store.device import serve_waiters
from infinity.store.errors import StoreIOError, StoreStateError
from infinity.store.futures import IoOp, Outcome, Settlement, StoreFuture, done_future, gather
from infinity.store.record import IN_IO, KeyRecord, Residency, Slot
from infinity.store.state import StoreState

log = logging.getLogger("infinity.store")

# -- write ---------------------------------------------------------------------


class _Begun(NamedTuple):
    """A write() that made its key WRITING: its future, and whether it needs a fresh region."""

    fut: StoreFuture
    need_region: bool


def write(st: StoreState, key: Hashable, tensor: torch.Tensor) -> StoreFuture:
    """TieredStore.write: copies ``tensor`` home (through a pool region for home "nvme")."""
    label = f"write of key {key!r}"
    while True:
        with st.lock:
            st.check_usable(label)
            rec = st.record(key)
            _check_tensor(rec, tensor)
            pending = rec.write_future if rec.state is Residency.WRITING and not rec.holds else None
            if pending is None:
                begun = _begin_write(st, rec, tensor, label)
                break
        try:
            pending.result()  # writes to one key are ordered: wait, then retry
        except Exception:
            pass  # a failed write left the key dirty; this write replaces its data
    if isinstance(begun, StoreFuture):
        return begun
    fut, need_region = begun
    region: PoolRegion | None = None
    try:
        if need_region:
            region = st.acquire(rec.disk_extent().nbytes, label)
        with torch.no_grad():
            if region is None:  # the key was resident: write into its host view
                assert rec.host is not None
                target = rec.host
            else:
                target = _typed(region, rec)
            target.copy_(tensor.reshape(rec.shape))
    except BaseException as e:
        _abandon_write(st, rec, need_region, region, e)
        if isinstance(e, Exception):
            fut.set_exception(e)
            return fut
        raise
    with st.lock:
        if region is not None:
            if st.closed or st.closing:
                region.release()
                rec.to_at_rest()
                rec.write_future = None
                fut.set_exception(st.closed_error())
                return fut
            st.join_slot(rec, Slot(region), 0)
        submit_write(st, [rec], background=False)
    return fut


def _begin_write(
    st: StoreState, rec: KeyRecord, tensor: torch.Tensor, label: str
) -> StoreFuture | _Begun:
    """Under the lock: a home "cpu" key is written at once (its done future); any other key
    becomes WRITING, its data to be copied in outside the lock."""
    st.refuse_if_busy(rec, "write")
    st.counts["writes"] += 1
    if rec.home_tensor is not None:
        rec.home_tensor.copy_(tensor.reshape(rec.shape))
        rec.written = True
        return done_future(None, label)
    need_region = rec.state is Residency.AT_REST
    rec.to_writing()
    st.lru.pop(rec, None)
    rec.write_future = st.new_future(None, label)
    return _Begun(rec.write_future, need_region)


def _typed(region: PoolRegion, rec: KeyRecord) -> torch.Tensor:
    return region.bytes_at(0, rec.nbytes).view(rec.dtype).view(rec.shape)


def _abandon_write(
    st: StoreState,
    rec: KeyRecord,
    need_region: bool,
    region: PoolRegion | None,
    exc: BaseException,
) -> None:
    """A write failed before its request (no pool space, or the copy raised): the key goes back
    to where it was — AT_REST, or DIRTY since its resident copy may be half overwritten."""
    with st.lock:
        if need_region:
            if region is not None:
                region.release()
            rec.to_at_rest()
        else:
            rec.to_dirty()
            st.sync_lru(rec)
        waiters, rec.waiters = rec.waiters, []
        rec.holds -= len(waiters)
        rec.write_future = None
    for w, _tier in waiters:
        w.set_exception(exc)


def _check_tensor(rec: KeyRecord, tensor: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"write of key {rec.key!r}: expected a tensor, got {type(tensor).__name__}")
    if tensor.dtype != rec.dtype or tensor.numel() * tensor.element_size() != rec.nbytes:
        raise ValueError(
            f"write of key {rec.key!r}: got a {tensor.dtype} tensor of shape {tuple(tensor.shape)}, "
            f"but the key was registered as {rec.dtype} {rec.shape}"
        )


def mark_dirty(st: StoreState, key: Hashable) -> None:
    """TieredStore.mark_dirty: a holder changed the resident data (the device copy, if it has one)."""
    with st.lock:
        st.check_open()
        rec = st.record(key)
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


# -- the write itself ----------------------------------------------------------


def submit_write(
    st: StoreState, recs: list[KeyRecord], *, background: bool, evict: bool = False
) -> list[StoreFuture]:
    """Writes resident keys home, one request per slot; returns one future per key (under the lock).

    ``background``: a write-back nobody asked for (eviction's: its room counts as on its way back);
    ``evict``: the keys leave the pool when it ends, unless held or fetched meanwhile.
    """
    by_slot: dict[int, list[KeyRecord]] = {}
    for rec in recs:
        by_slot.setdefault(id(rec.slot), []).append(rec)
    futs: list[StoreFuture] = []
    for group in by_slot.values():
        for rec in group:
            if rec.state is not Residency.WRITING:
                rec.to_writing()
                rec.write_future = st.new_future(None, f"write of key {rec.key!r}")
            rec.evict_after_write = evict
            st.lru.pop(rec, None)
        slot = group[0].slot
        assert slot is not None  # the keys are resident: their host views lie in this slot
        req = st.io.write.pwrite_many(st.io_items(group, slot))
        op = IoOp(
            "write", req, group, sum(r.disk_extent().nbytes for r in group), background=background
        )
        st.track(op, st.write)
        for rec in group:
            wf = rec.write_in_flight()
            wf.follow(op)
            futs.append(wf)
        st.reaper.add(op)
    return futs


def complete_write(st: StoreState, op: IoOp, ended: Outcome, res: list[Settlement]) -> None:
    """A write ended (under the lock): its keys are clean (or gone, if evicting), or it failed
    and they stay DIRTY and resident; fetches that waited for the write are served. A failed
    write is the store's fault until retried ([Note: failed write-backs])."""
    failed: StoreIOError | None = None
    for i, rec in enumerate(op.recs):
        rec.op = None
        wf, rec.write_future = rec.write_future, None
        evict, rec.evict_after_write = rec.evict_after_write, False
        if op.background and evict:
            st.evicting_nbytes -= rec.disk_extent().nbytes
        st.counts["writebacks"] += 1
        if ended.error is not None:
            exc = st.io_error(rec, "write", ended.error)
            rec.to_dirty()  # still resident: nothing is lost
            rec.pending_dirty = False
            rec.error = exc  # not a cache entry until a flush retries it
            failed = failed or exc
            res.append((wf, None, exc))
        else:
            rec.written = True
            if ended.crcs is not None:
                rec.crc = ended.crcs[i]
            if rec.pending_dirty:
                rec.to_dirty()
                rec.pending_dirty = False
            elif evict and rec.holds == 0 and not rec.waiters:
                _drop(st, rec)
            else:
                rec.to_in_host()
            res.append((wf, None, None))
        serve_waiters(st, rec, res)
        st.sync_lru(rec)
    if failed is not None:
        _fault(st, failed, len(op.recs))
    elif st.settle_fault():
        log.warning(
            "store '%s': the failed write-backs were retried successfully; carrying on", st.name
        )


def _fault(st: StoreState, exc: StoreIOError, nkeys: int) -> None:
    """A write-back failed (under the lock): say so now, and make it the store's fault."""
    log.error(
        "store '%s': %s (%d key(s) in the request). The data stays in host memory; the store "
        "refuses further fetches and writes until flush_all() succeeds",
        st.name,
        exc,
        nkeys,
    )
    if st.fault is None:
        st.fault = exc
    st.pool.wake()  # waiters for pool memory this data holds: they raise now, not at a timeout


# -- eviction ------------------------------------------------------------------


def evict(st: StoreState, key: Hashable) -> StoreFuture:
    """TieredStore.evict: drops the key's residency now (a dirty key after writing it home)."""
    with st.lock:
        st.check_open()
        rec = st.record(key)
        label = f"evict of key {key!r}"
        if rec.home_tensor is not None or rec.state is Residency.AT_REST:
            if rec.holds:
                st.refuse_if_busy(rec, "evict")
            return done_future(None, label)
        if rec.state is Residency.WRITING and rec.holds == 0:
            rec.evict_after_write = True
            return rec.write_in_flight()
        st.refuse_if_busy(rec, "evict")
        if rec.state is Residency.IN_HOST:
            _drop(st, rec)
            feed_pool(st)
            return done_future(None, label)
        if rec.error is not None:
            raise StoreStateError(
                f"evict of key {rec.key!r}: its last write home failed ({rec.error}); it stays "
                "resident so nothing is lost — flush it to retry"
            )
        return submit_write(st, [rec], background=False, evict=True)[0]


def _drop(st: StoreState, rec: KeyRecord) -> None:
    """A clean resident key (IN_HOST, or WRITING whose write just ended) leaves its region."""
    st.lru.pop(rec, None)
    rec.to_at_rest()
    st.leave_slot(rec)
    st.counts["evictions"] += 1


def evict_until(st: StoreState, nbytes: int) -> None:
    """Evicts cache entries, oldest first, until the pool can serve ``nbytes`` (or none are left)."""
    if st.closing:
        return  # close() is draining I/O: start no more
    dirty = []
    # Dirty entries free their room only when their write-back ends; room
    # already on its way counts, so one need does not flush the whole cache.
    while st.lru and not st.pool.can_serve(nbytes) and st.evicting_nbytes < nbytes:
        rec, _ = st.lru.popitem(last=False)
        if rec.state is Residency.IN_HOST:
            _drop(st, rec)
        else:
            dirty.append(rec)
            st.evicting_nbytes += rec.disk_extent().nbytes
    if dirty:
        submit_write(st, dirty, background=True, evict=True)


def feed_pool(st: StoreState) -> None:
    """When someone waits for pool space, gives it cache entries (called at the end of changes)."""
    need = st.pool.waiting_nbytes()
    if need and st.lru:
        evict_until(st, need)


def reclaim(st: StoreState, nbytes: int) -> None:
    """The pool's reclaimer: called with no lock held by the thread at the head of its queue."""
    with st.lock:
        if not st.closed:
            evict_until(st, nbytes)


# -- flush ---------------------------------------------------------------------


def flush(st: StoreState, key: Hashable) -> StoreFuture:
    """TieredStore.flush: writes a dirty key home; it stays resident, clean."""
    with st.lock:
        st.check_open()
        rec = st.record(key)
        if rec.state is Residency.WRITING and rec.holds == 0:
            return rec.write_in_flight()
        if rec.state is not Residency.DIRTY:
            if rec.holds and rec.dirty:
                st.refuse_if_busy(rec, "flush")
            return done_future(None, f"flush of key {key!r}")
        st.refuse_if_busy(rec, "flush")
        rec.error = None
        return submit_write(st, [rec], background=False)[0]


def flush_all(st: StoreState) -> StoreFuture:
    """TieredStore.flush_all: writes every dirty key home; refused (writing nothing) if one is held."""
    with st.lock:
        st.check_open()
        records = st.records.values()
        held = [r for r in records if r.dirty and r.holds]
        if held:
            names = ", ".join(repr(r.key) for r in held[:5]) + (" …" if len(held) > 5 else "")
            raise StoreStateError(
                f"flush_all of store '{st.name}': {len(held)} dirty key(s) are still held ({names}); "
                "release them first"
            )
        dirty = [r for r in records if r.state is Residency.DIRTY]
        writing = [r.write_in_flight() for r in records if r.state is Residency.WRITING]
        for r in dirty:
            r.error = None
        futs = submit_write(st, dirty, background=False) if dirty else []
        return gather(futs + writing, f"flush_all of store '{st.name}'")
