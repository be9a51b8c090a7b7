"""The read path: fetch (admit, find pool room, prepare, submit, complete a read) and release.

A fetch adds a hold to each key and returns a future per key. Keys already
resident, or on their way (READING, WRITING, COPYING), share what is there or
in flight: a key resident or being read is never read again. Keys AT_REST
become READING and are read in groups, each group one pool region (a Slot)
of at most the pool's buffer_size and one request (keys contiguous on disk
make one large read). ``overwrite=True`` fetches read nothing: the caller
fills the key, which becomes DIRTY.

Finding pool room is the only step that may wait, so it has two ways:
- fast, under the lock: one region serves every key and the pool has it now
  (or after evicting cache entries here: a full cache is the steady state);
- slow, after the lock is released: ``pool.acquire`` waits (FIFO, up to
  pool_timeout) while the pool's reclaimer evicts for it; a timeout or a
  store closed meanwhile fails the fetches of the keys not yet placed.
Either way the read is prepared (its op registered) under the lock and
submitted after it is released; the op completes through the facade's
``_finish`` ([Note: completing ops]) into ``complete_read``.

Threading: ``fetch``, ``release`` and the slow way (``_load``,
``_abort_loads``) take the store lock themselves; the functions whose
docstrings say "under the lock" are called with it held. Futures are settled
after the lock is released.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Iterable
from typing import Literal

from infinity.store.device import Tier, drop_device, serve, serve_waiters
from infinity.store.errors import StoreStateError
from infinity.store.futures import IoOp, Outcome, Settlement, StoreFuture, settle
from infinity.store.integrity import verify
from infinity.store.record import KeyRecord, Residency, Slot, key_label
from infinity.store.state import StoreState
from infinity.store.write_path import evict_until, feed_pool

Prepared = tuple[IoOp, list[tuple]]
"""A read registered under the lock, with its (buffer, file, offset) items, to submit after it."""


# -- fetch ---------------------------------------------------------------------


def fetch(st: StoreState, keys: list[Hashable], tier: Tier, overwrite: bool) -> list[StoreFuture]:
    """TieredStore.fetch_many: one future per key, returned once every key has pool memory."""
    if tier not in ("host", "device"):
        raise ValueError(f"tier must be 'host' or 'device', got {tier!r}")
    res: list[Settlement] = []
    futs: list[StoreFuture] = []
    to_load: list[KeyRecord] = []
    with st.lock:
        st.check_open()
        if st.fault is not None:  # [Note: failed write-backs] in write_path.py
            raise st.fault_error(
                f"fetch of key {keys[0]!r}" if len(keys) == 1 else f"fetch of {len(keys)} keys"
            )
        recs = [st.record(k) for k in keys]
        check_fetchable(st, recs, overwrite)
        st.counts["fetches"] += len(recs)
        for rec in recs:
            fut = st.new_future(rec.op, ("fetch of key", rec.key))
            futs.append(fut)
            if _admit(st, rec, fut, tier, overwrite, res):
                to_load.append(rec)
            st.sync_lru(rec)
        prepared = _load_now(st, to_load, overwrite, res) if to_load else None
        if prepared is not None:
            to_load = []
    if isinstance(prepared, tuple):
        submit_read(st, *prepared)
    settle(res)
    if to_load:
        _load(st, to_load, overwrite)
    return futs


def _admit(
    st: StoreState,
    rec: KeyRecord,
    fut: StoreFuture,
    tier: Tier,
    overwrite: bool,
    res: list[Settlement],
) -> bool:
    """Adds a hold on ``rec`` for ``fut``: serves it, or makes it wait for the transition in
    flight; True when the key is AT_REST and must be loaded (under the lock)."""
    rec.holds += 1
    state = rec.state
    if rec.home_tensor is not None:
        st.counts["hits"] += 1
        rec.written |= overwrite
        serve(st, rec, fut, tier, res)
    elif state is Residency.AT_REST:
        rec.to_reading()
        rec.waiters.append((fut, tier))
        return True
    elif state in (Residency.READING, Residency.WRITING, Residency.COPYING):
        st.counts["shared"] += 1
        rec.waiters.append((fut, tier))
        rec.pending_dirty |= overwrite and state is not Residency.COPYING
        if state is Residency.COPYING and overwrite:
            rec.device_dirty = True
    else:
        st.counts["hits"] += 1
        if overwrite and state is Residency.IN_HOST:
            rec.to_dirty()
        elif overwrite and state is Residency.ON_DEVICE:
            # the copy the caller overwrites is the one it fetched
            rec.device_dirty |= tier == "device"
            rec.dirty = True
        serve(st, rec, fut, tier, res)
    return False


def check_fetchable(st: StoreState, recs: list[KeyRecord], overwrite: bool) -> None:
    """Refuses (before any change, under the lock) a fetch of never-written keys or one the pool
    can never serve."""
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
            new += rec.disk_extent().nbytes
            if largest is None or rec.disk_extent().nbytes > largest.disk_extent().nbytes:
                largest = rec
    if largest is not None:
        st.pool.check_servable(
            largest.disk_extent().nbytes, f"key {largest.key!r} of store '{st.name}'"
        )
    if new > st.pool.capacity:
        st.pool.check_servable(
            new, f"fetch_many of {len(recs)} keys of store '{st.name}' (held at once)"
        )


def _load_now(
    st: StoreState, recs: list[KeyRecord], overwrite: bool, res: list[Settlement]
) -> Prepared | Literal[True] | None:
    """The fast way to pool room (under the lock): when one region serves every key and the pool
    has it free now, take it here. Returns the read to submit, True when nothing needs reading,
    or None to go the slow way (_load, outside the lock)."""
    total = sum(r.disk_extent().nbytes for r in recs)
    if len(recs) > 1 and total > st.pool.buffer_size:
        return None
    name = f"store '{st.name}': fetch of {key_label(recs)}"
    region = st.pool.try_acquire(total, name=name)
    if region is None and not st.pool.waiting_nbytes():
        evict_until(st, total)  # a full cache is the steady state: make room here
        region = st.pool.try_acquire(total, name=name)
    if region is None:
        return None
    slot = Slot(region)
    st.join_group(recs, slot)
    st.counts["misses"] += len(recs)
    if not overwrite:
        return prepare_read(st, recs, slot)
    _filled(st, recs, res)
    return True


def _load(st: StoreState, recs: list[KeyRecord], overwrite: bool) -> None:
    """The slow way: finds regions for keys now READING (outside the lock) and reads them in."""
    groups: list[list[KeyRecord]] = []
    size = 0
    for rec in recs:
        if not groups or size + rec.disk_extent().nbytes > st.pool.buffer_size:
            groups.append([])
            size = 0
        groups[-1].append(rec)
        size += rec.disk_extent().nbytes
    for i, group in enumerate(groups):
        label = f"store '{st.name}': fetch of {key_label(group)}"
        try:
            region = st.acquire(sum(r.disk_extent().nbytes for r in group), label)
        except BaseException as e:
            _abort_loads(st, [r for g in groups[i:] for r in g], e)
            if isinstance(e, Exception):
                return
            raise
        res: list[Settlement] = []
        prepared = None
        with st.lock:
            abort = st.closed or st.closing
            if abort:
                region.release()
            else:
                slot = Slot(region)
                st.join_group(group, slot)
                st.counts["misses"] += len(group)
                if overwrite:
                    _filled(st, group, res)
                else:
                    prepared = prepare_read(st, group, slot)
        if prepared is not None:
            submit_read(st, *prepared)
        if abort:
            _abort_loads(st, [r for g in groups[i:] for r in g], st.closed_error())
            return
        settle(res)


def _filled(st: StoreState, recs: list[KeyRecord], res: list[Settlement]) -> None:
    """Keys fetched with overwrite=True have their region: nothing to read, they are DIRTY now
    (under the lock)."""
    for rec in recs:
        rec.to_dirty()
        rec.pending_dirty = False
        serve_waiters(st, rec, res)
        st.sync_lru(rec)


def _abort_loads(st: StoreState, recs: list[KeyRecord], exc: BaseException) -> None:
    """Fails the fetches of keys that found no region (pool timeout, store closed): back AT_REST."""
    res: list[Settlement] = []
    with st.lock:
        for rec in recs:
            if rec.state is Residency.READING and rec.slot is None:
                rec.to_at_rest()
                rec.holds = 0
                rec.pending_dirty = False
                waiters, rec.waiters = rec.waiters, []
                res.extend((f, None, exc) for f, _t in waiters)
    settle(res)


# -- the read itself -----------------------------------------------------------


def prepare_read(st: StoreState, recs: list[KeyRecord], slot: Slot) -> Prepared:
    """Registers the read of ``recs`` into ``slot`` (under the lock); submit it after unlocking."""
    op = IoOp("read", None, recs, sum(r.disk_extent().nbytes for r in recs))
    st.track(op, st.read)
    return op, st.io_items(recs, slot)


def submit_read(st: StoreState, op: IoOp, items: list[tuple]) -> None:
    """Submits a prepared read, outside the store lock (submission takes microseconds that
    other threads, the reaper above all, should not spend waiting for the lock)."""
    try:
        op.attach(st.io.read.pread_many(items))
    except Exception as e:  # e.g. the handle was closed: the op fails like a failed read
        op.fail_submit(e)
    st.reaper.add(op)


def complete_read(st: StoreState, op: IoOp, ended: Outcome, res: list[Settlement]) -> None:
    """A read ended (under the lock): its keys become resident and their fetches are served, or
    it failed and they go back AT_REST, failing every fetch that waited for them."""
    for i, rec in enumerate(op.recs):
        rec.op = None
        exc: BaseException | None = None
        if ended.error is not None:
            exc = st.io_error(rec, "fetch", ended.error)
        elif ended.crcs is not None:
            exc = verify(st, rec, ended.crcs[i])
        if exc is not None:
            waiters, rec.waiters = rec.waiters, []
            rec.holds = 0
            rec.pending_dirty = False
            rec.to_at_rest()
            st.leave_slot(rec)
            res.extend((f, None, exc) for f, _t in waiters)
        else:
            if rec.pending_dirty:
                rec.to_dirty()
                rec.pending_dirty = False
            else:
                rec.to_in_host()
            serve_waiters(st, rec, res)
        st.sync_lru(rec)


# -- release -------------------------------------------------------------------


def release(st: StoreState, keys: Iterable[Hashable]) -> None:
    """Drops one hold per listed key (a key listed n times drops n); all or nothing."""
    with st.lock:
        st.check_open()
        recs = [st.record(k) for k in keys]
        counts = collections.Counter(id(r) for r in recs)
        for rec in recs:
            if rec.holds < counts[id(rec)]:
                raise StoreStateError(
                    f"release of key {rec.key!r}, which is not held (state {rec.state.value}): "
                    "every release must follow a fetch"
                )
        for rec in recs:
            rec.holds -= 1
            if rec.holds == 0 and rec.device is not None and rec.state is Residency.ON_DEVICE:
                drop_device(st, rec)
            st.sync_lru(rec)
        feed_pool(st)
