"""PrefetchScheduler: a ShardSource that learns the order of unit fetches and reads ahead of it.

The partitioner asks for units with ``acquire(key)`` / ``release(key)``
(``mark_dirty`` for in-place changes), exactly as it asks StoreShardSource;
the engine brackets each micro-batch's forward + backward with
``begin_step()`` / ``end_step()`` (``abort_step()`` when it raised). Step 0
records the order of acquires (cursor.py); later steps replay it: each
acquire makes sure its unit is resident (waiting only if it is not) and the
scheduler issues store fetches for the units after it, within the budgets
(lookahead.py). Divergence handling is [Note: divergence] in cursor.py.

[Note: budgets]
All in bytes of the keys' data (DeepSpeed's element counts × itemsize; the
pool rounds each region up to 4 KiB, which the budgets do not count).
- ``ahead`` = bytes of PREFETCHED units (fetched for a use not yet reached)
  whose data had to move — read from NVMe, or copied to a separate device —
  in flight or arrived, ≤ prefetch_bucket_nbytes, always. As in DeepSpeed,
  where only parameters that are not available count against the bucket, a
  unit already resident where it is needed (a cache hit on the CPU) costs no
  transfer: it is held ahead within max_live but not counted here.
- ``live`` = bytes of every unit the scheduler holds a store hold for (in use
  by callers, prefetched, kept) ≤ max_live_nbytes, except in one case: the
  units callers hold (``in_use``) are not the scheduler's to give back, so
  when a caller asks for a unit that does not fit, the scheduler first gives
  up everything it holds on its own judgement (furthest next use first) and
  then serves the unit anyway — a unit larger than max_live, or callers
  holding more than max_live between them, is the minimum to make progress.
  Waiting instead would deadlock: only the waiting caller could release what
  is in the way. So ``live ≤ max(max_live, in_use)``, and while ``in_use``
  exceeds max_live the scheduler holds nothing of its own (no prefetch, no
  keep); each such fetch is counted in ``over_budget_demands``. The
  engine-facing ``for_engine``/``for_budget`` refuse budgets that would let this happen
  (ScheduleBudget.check_serves), so under the engine max_live is never
  exceeded.
- a unit is kept at its last release only if it is used again within
  max_reuse_distance_nbytes bytes of trace; keeping never raises ``live``.
A fetch given up while its read is in flight is released to the store at
once; the read ends into a cache entry the pool can reclaim.

[Note: across the step boundary]
A step's end no longer has to stop the reading: the next step replays the
newest trace from its start, so the scheduler can read ahead for it while the
current one finishes.
- ``end_step(keep_for_next=True)`` (a micro-step inside an accumulation
  window: nothing changes the parameters before the next forward) keeps what
  it holds on its own judgement for the next step's uses within max_live of
  its start — the backward's last units are the next forward's first — and
  goes on prefetching from the next trace's start.
- ``prefetch_next_step()`` (after an optimizer step has been started, which
  changes the parameters: the engine calls it once the step's per-unit gate
  is in place) prefetches from the next trace's start as ``ready`` allows:
  each unit once its update is in place (with the step's fresh copy still
  resident, a hold with no read).
Between steps the walk follows the next trace from position 0, within the
same budgets and pool rules; ``begin_step`` takes over what is held then, and
a next step that leaves the trace gives it back as any divergence does.
``abort_step`` and a plain ``end_step()`` give everything back, as before.

[Note: pool room]
Store fetches of units at rest take pool memory, and ``store.fetch`` waits
(FIFO) when the pool is full. A speculative fetch must never wait there: a
caller's on-demand fetch would queue behind it. So a prefetch starts only
when the pool can serve it now (nobody queued, a large enough free run),
after evicting idle cache entries needed later than it (Belady); otherwise
it is deferred to the next event (``pool_deferrals``). An on-demand fetch
that finds no room evicts idle cache entries, then gives up the scheduler's
own holds (furthest next use first, ``pressure_drops``) until the pool can
serve it, and only then lets the store wait — for write-backs in flight or
for memory held by others, never for the scheduler. The same holds for
everyone else on the pool: the scheduler is one of its reclaimers, so a
fetch that waits for room (the engine's overlapped optimizer step, a write)
takes the idle cache entries the scheduler knows, then what it holds on its
own judgement, furthest next use first (``reclaimed``) — even while the
model's thread is blocked elsewhere (at the optimizer's gate) and makes no
scheduler calls.

This file is over the ~500-line soft cap: one lock guards one state (the
records, the byte totals, the cursor), and the step, hold, fetch and pool
rules all change it together; the pure decisions live in lookahead.py,
cursor.py and trace.py.

Threading: every method may be called from any thread (forward and backward
run on different threads on CUDA). ``_lock`` (a Condition) guards all
records, the cursor, the counters and the byte totals; it is never held
while waiting, and the store calls made under it never block (release,
spec, mark_dirty, evict of a clean entry).
``_fetch_lock`` serialises the scheduler's calls that may take pool memory
(``store.fetch``): lock order is ``_fetch_lock`` → ``_lock`` → the store's
lock. Only an on-demand fetch waits for ``_fetch_lock``; prefetch work from
``release`` and from acquire hits only tries it and otherwise leaves a
``_replan`` flag that the holder honours before letting go, so a release
never waits for another thread's I/O.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any

import torch

from infinity.aio import DIRECT_ALIGNMENT
from infinity.aio.waits import wait_until
from infinity.memory import round_up
from infinity.schedule import lookahead
from infinity.schedule.budget import ScheduleBudget
from infinity.schedule.cursor import Seen, TraceCursor
from infinity.schedule.errors import ScheduleError
from infinity.schedule.record import DISCRETIONARY, HoldState, UnitRecord
from infinity.schedule.stats import SchedulerStats, StepCounters, StepStats, total
from infinity.schedule.trace import Trace
from infinity.store import Residency, StoreStateError, Tier, TieredStore
from infinity.timeline import Timeline

log = logging.getLogger("infinity.schedule")


def _failed(exc: BaseException) -> concurrent.futures.Future:
    f: concurrent.futures.Future = concurrent.futures.Future()
    f.set_exception(exc)
    return f


def _failed_done(fut: Any) -> bool:
    """Whether ``fut`` ended in an error (the store then holds nothing for whoever fetched)."""
    return fut is not None and fut.done() and fut.exception(0) is not None


class PrefetchScheduler:
    """Reads units ahead of use on a warm trace; a drop-in ShardSource for the stage-3 partitioner.

    ``store``: the TieredStore holding the units (one key each, registered).
    Budgets in bytes (see [Note: budgets]). ``tier``: where acquire returns
    the unit ("device": on the store's compute device). ``max_traces``: traces
    remembered for models that alternate between paths. ``history``: ended
    steps kept in ``stats().history``. ``ready(key)``: whether ``key`` may be
    prefetched now (e.g. the engine's overlapped optimizer step has updated
    it); the walk stops at the first key that is not, until ``poke()`` or the
    next acquire/release. It is called under the scheduler's lock: it must
    not block or call the scheduler.
    """

    def __init__(
        self,
        store: TieredStore,
        *,
        prefetch_bucket_nbytes: int,
        max_live_nbytes: int,
        max_reuse_distance_nbytes: int,
        tier: Tier = "device",
        max_traces: int = 4,
        history: int = 64,
        name: str = "prefetch",
        budget_itemsize: int = 1,
        ready: Callable[[Hashable], bool] | None = None,
    ):
        if not isinstance(store, TieredStore):
            raise TypeError(
                f"store must be an infinity.store.TieredStore, got {type(store).__name__}"
            )
        if tier not in ("host", "device"):
            raise ValueError(f"tier must be 'host' or 'device', got {tier!r}")
        self.budget = ScheduleBudget(
            prefetch_bucket_nbytes,
            max_live_nbytes,
            max_reuse_distance_nbytes,
            itemsize=budget_itemsize,
        )
        self.store = store
        self.tier: Tier = tier
        self.name = name
        self._pool = store.pool
        # On a separate device every prefetch moves data (at least the copy to the device).
        self._copies_to_device = tier == "device" and store.device.type != "cpu"
        self._lock = threading.Condition(threading.Lock())
        self._fetch_lock = threading.Lock()
        self._fetch_holder: threading.Thread | None = (
            None  # the thread in _fetch_lock, for messages
        )
        self._records: dict[Hashable, UnitRecord] = {}
        self._held: dict[Hashable, UnitRecord] = {}  # records not IDLE
        self._cached: dict[Hashable, UnitRecord] = {}  # IDLE records the store may still cache
        self._cursor = TraceCursor(max_traces=max_traces)
        self._live = 0
        self._ahead = 0
        self._in_use = 0
        self._frontier = 0  # first trace position the lookahead has not examined in this step
        self._bridging = (
            False  # between steps, reading ahead for the next ([Note: across the step boundary])
        )
        self._replan = False
        self._step: StepCounters | None = None
        self._steps = 0
        self._untraced = StepCounters(-1, time.monotonic())
        self._untraced_uses = 0
        self._history: deque[StepStats] = deque(maxlen=max(1, history))
        self._totals: StepStats | None = None
        self._closed = False
        self._ready = ready
        store.pool.add_reclaimer(self._reclaim)  # held weakly by the pool

    @classmethod
    def for_engine(
        cls,
        store: TieredStore,
        *,
        prefetch_bucket_size: float,
        max_live_parameters: float,
        max_reuse_distance: float,
        itemsize: int,
        **kw: Any,
    ) -> PrefetchScheduler:
        """From DeepSpeed's element counts (stage3_prefetch_bucket_size, stage3_max_live_parameters,
        stage3_max_reuse_distance) and the parameters' itemsize; the rest as ``for_budget``."""
        budget = ScheduleBudget.from_deepspeed(
            prefetch_bucket_size=prefetch_bucket_size,
            max_live_parameters=max_live_parameters,
            max_reuse_distance=max_reuse_distance,
            itemsize=itemsize,
        )
        return cls.for_budget(store, budget, **kw)

    @classmethod
    def for_budget(
        cls,
        store: TieredStore,
        budget: ScheduleBudget,
        *,
        largest_unit_nbytes: int,
        working_set_nbytes: int | None = None,
        pool_working_set_nbytes: int | None = None,
        largest_unit: str = "the largest unit",
        tier: Tier = "device",
        **kw: Any,
    ) -> PrefetchScheduler:
        """The engine's scheduler under ``budget`` (bytes); refuses a budget it could not keep
        (ScheduleConfigError naming the key to raise, see ScheduleBudget.check_serves).

        ``working_set_nbytes``: the most unit bytes the partitioner holds at once;
        ``pool_working_set_nbytes``: the part of it on NVMe, which needs the store's pool
        (default: all of it if the store has swap directories, else none)."""
        budget.check_serves(
            largest_unit_nbytes=largest_unit_nbytes,
            working_set_nbytes=working_set_nbytes,
            pool_capacity=store.pool.capacity,
            pool_working_set_nbytes=(
                pool_working_set_nbytes
                if pool_working_set_nbytes is not None
                else (None if store.directories else 0)
            ),
            largest_unit=largest_unit,
        )
        return cls(
            store,
            prefetch_bucket_nbytes=budget.prefetch_bucket_nbytes,
            max_live_nbytes=budget.max_live_nbytes,
            max_reuse_distance_nbytes=budget.max_reuse_distance_nbytes,
            tier=tier,
            budget_itemsize=budget.itemsize,
            **kw,
        )

    # -- the ShardSource calls ---------------------------------------------------

    def acquire(self, key: Hashable) -> torch.Tensor:
        """The unit, resident in ``tier`` (waits if it must); one hold until ``release(key)``."""
        t0 = time.monotonic()
        with self._lock:
            self._check_open()
            rec = self._record(key)
            c = self._counters()
            c.add("uses")
            if self._step is None:
                self._untraced_uses += 1
            self._observe(rec, c)
            fut = None
            if rec.state is not HoldState.IDLE:
                self._classify_hit(rec, c)
                self._use(rec)
                fut = self._submitted_future(rec)
        if fut is None:
            fut = self._under_fetch_lock(lambda: self._demand(rec, c), block=True)
        else:
            self._under_fetch_lock(None, block=False)
        return self._result(rec, fut, c, t0)

    def release(self, key: Hashable) -> None:
        """Drops one hold; the unit is kept if the trace reuses it soon, else given back to the store."""
        with self._lock:
            self._check_open()
            rec = self._records.get(key)
            if rec is None or rec.state is not HoldState.IN_USE or rec.users == 0:
                raise ScheduleError(
                    f"release of key {key!r}, which is not acquired from scheduler '{self.name}' "
                    f"(state {rec.state.value if rec else 'unknown'}): every release must follow an acquire"
                )
            self._unuse(rec)
        self._under_fetch_lock(None, block=False)

    def mark_dirty(self, key: Hashable) -> None:
        """The held unit was changed in place: the store writes it home before dropping it."""
        with self._lock:
            self._check_open()
            rec = self._records.get(key)
            if rec is None or rec.state is not HoldState.IN_USE:
                raise ScheduleError(
                    f"mark_dirty of key {key!r}, which is not acquired from scheduler '{self.name}': "
                    "acquire it, change it, mark it dirty, then release it"
                )
            self.store.mark_dirty(key)

    def begin_step(self) -> None:
        """Starts a step (one micro-batch's forward + backward): replays the trace, or records one."""
        with self._lock:
            self._check_open()
            if self._step is not None:
                log.debug(
                    "scheduler '%s': begin_step with step %d open; aborting it",
                    self.name,
                    self._step.step,
                )
                self._end(completed=False)
            self._step = StepCounters(self._steps, time.monotonic())
            self._cursor.begin()
            self._frontier = 0
            self._bridging = False
        self._under_fetch_lock(None, block=False)

    def end_step(self, *, keep_for_next: bool = False) -> StepStats:
        """Ends the step: gives back what was fetched or kept for it (``keep_for_next``: what the next
        step's start uses is kept and read ahead for, see [Note: across the step boundary]); a diverged
        step becomes the trace."""
        with self._lock:
            self._check_open()
            if self._step is None:
                raise ScheduleError(
                    f"end_step() of scheduler '{self.name}' without begin_step(): call begin_step() "
                    "before the forward and end_step() after the backward"
                )
            snap = self._end(completed=True, keep_for_next=keep_for_next)
        if keep_for_next:
            self._under_fetch_lock(None, block=False)
        return snap

    def prefetch_next_step(self) -> None:
        """Between steps: reads ahead for the next step from its trace's start, as ``ready`` allows
        (see [Note: across the step boundary]). A no-op inside a step or before a trace is known."""
        with self._lock:
            self._check_open()
            if self._step is not None or not self._cursor.library:
                return
            self._bridging = True
            self._frontier = 0
        self._under_fetch_lock(None, block=False)

    def abort_step(self) -> StepStats | None:
        """Ends the step after a failure: gives back everything held on the scheduler's judgement,
        records nothing. With no step open it gives back what it read ahead for the next one (someone
        is about to change the shards behind its back: a checkpoint load) and returns None."""
        with self._lock:
            if self._closed:
                return None
            if self._step is None:
                self._bridging = False
                for rec in list(self._held.values()):
                    if rec.state in DISCRETIONARY:
                        self._drop(rec, "end")
                return None
            return self._end(completed=False)

    def poke(self) -> None:
        """Plans again now: call it when ``ready`` may have changed (it never waits)."""
        with self._lock:
            self._check_open()
        self._under_fetch_lock(None, block=False)

    # -- queries --------------------------------------------------------------------

    @property
    def trace(self) -> Trace | None:
        """The trace the next step will replay (None before the first step ends)."""
        with self._lock:
            lib = self._cursor.library
            return lib[0] if lib else None

    @property
    def step_open(self) -> bool:
        with self._lock:
            return self._step is not None

    def stats(self) -> SchedulerStats:
        with self._lock:
            # Untraced uses count in the totals, their time since construction does not.
            untraced = dataclasses.replace(self._untraced.snapshot("untraced", 0.0), wall_s=0.0)
            parts = [s for s in (self._totals, untraced) if s is not None]
            return SchedulerStats(
                name=self.name,
                steps=self._steps,
                last=self._history[-1] if self._history else None,
                history=tuple(self._history),
                total=total(parts),
                live_nbytes=self._live,
                in_use_nbytes=self._in_use,
                ahead_nbytes=self._ahead,
                traces=len(self._cursor.library),
                untraced_uses=self._untraced_uses,
            )

    def close(self) -> None:
        """Ends any open step and gives every hold back to the store. Idempotent."""
        self._take_fetch_lock()  # a fetch in progress finishes first
        try:
            self._close_locked()
        finally:
            self._fetch_lock.release()
        self._pool.remove_reclaimer(self._reclaim)

    def _close_locked(self) -> None:
        """close(), holding ``_fetch_lock``."""
        with self._lock:
            if self._closed:
                return
            if self._step is not None:
                self._end(completed=False)
            held = [r for r in self._held.values() if r.state is HoldState.IN_USE]
            if held:
                log.warning(
                    "scheduler '%s' closed with %d key(s) still acquired (%r…); their holds are given back",
                    self.name,
                    len(held),
                    held[0].key,
                )
            for rec in list(self._held.values()):
                if rec.state is HoldState.IN_USE:
                    self._in_use -= rec.nbytes
                self._drop(rec, "close")
            self._closed = True
            self._lock.notify_all()

    def __enter__(self) -> PrefetchScheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<PrefetchScheduler '{self.name}' live={self._live} ahead={self._ahead} "
            f"steps={self._steps}{' closed' if self._closed else ''}>"
        )

    # -- internals: steps and the cursor --------------------------------------------

    def _counters(self) -> StepCounters:
        return self._step if self._step is not None else self._untraced

    def _end(self, *, completed: bool, keep_for_next: bool = False) -> StepStats:
        assert self._step is not None
        kind = self._cursor.end(completed=completed)
        nxt = (
            self._cursor.library[0]
            if completed and keep_for_next and self._cursor.library
            else None
        )
        for rec in list(self._held.values()):
            if rec.state in DISCRETIONARY and not (nxt is not None and self._soon_in(nxt, rec.key)):
                self._drop(rec, "end")
        for rec in list(self._cached.values()):  # forget entries the store has evicted since
            if self.store.spec(rec.key).state is Residency.AT_REST:
                del self._cached[rec.key]
        snap = self._step.snapshot(kind.value, time.monotonic())
        self._step = None
        self._steps += 1
        self._frontier = 0
        self._bridging = nxt is not None
        self._history.append(snap)
        self._totals = snap if self._totals is None else total([self._totals, snap])
        return snap

    def _soon_in(self, trace: Trace, key: Hashable) -> bool:
        """Whether ``trace`` uses ``key`` within max_live bytes of its start (kept across the boundary)."""
        first = trace.next_use(key, 0)
        return first is not None and trace.bytes_between(0, first) < self.budget.max_live_nbytes

    def _view(self) -> tuple[Trace, int] | None:
        """The trace the lookahead follows and the position it starts from: the step's and its cursor;
        between steps, while reading ahead for the next one, the next trace from its start."""
        if self._step is not None:
            trace = self._cursor.trace  # set whenever the cursor replays (StepCursor.begin)
            if not self._cursor.replaying or trace is None:
                return None
            return trace, self._cursor.pos
        if self._bridging and self._cursor.library:
            return self._cursor.library[0], 0
        return None

    def _observe(self, rec: UnitRecord, c: StepCounters) -> None:
        """Follows the trace with this use; on a switch or a divergence, gives up what is no longer predicted."""
        obs = self._cursor.observe(rec.key, rec.nbytes)
        if obs.seen is Seen.SWITCH:
            c.add("trace_switches")
            self._frontier = self._cursor.pos
            trace, pos = self._cursor.trace, self._cursor.pos
            assert trace is not None
            for other in list(self._held.values()):
                if other is rec:
                    continue
                if other.state is HoldState.PREFETCHED and trace.next_use(other.key, pos) is None:
                    self._drop(other, "diverged")
                elif other.state is HoldState.KEPT and not lookahead.keep_for_reuse(
                    trace, pos, other.key, self.budget.max_reuse_distance_nbytes
                ):
                    self._drop(other, "diverged")
        elif obs.seen is Seen.MISMATCH:
            c.divergence_pos = self._cursor.divergence_pos
            for other in list(self._held.values()):
                if other is not rec and other.state in DISCRETIONARY:
                    self._drop(other, "diverged")

    # -- internals: holds -------------------------------------------------------------

    def _record(self, key: Hashable) -> UnitRecord:
        rec = self._records.get(key)
        if rec is None:
            rec = UnitRecord(
                key, self.store.spec(key).nbytes
            )  # KeyError names the store if unknown
            self._records[key] = rec
        return rec

    def _classify_hit(self, rec: UnitRecord, c: StepCounters) -> None:
        if rec.state is HoldState.PREFETCHED:
            ready = rec.future is not None and rec.future.done()
            c.add("prefetch_hits" if ready else "late_prefetches")
        else:
            c.add("reuse_hits")

    def _use(self, rec: UnitRecord) -> None:
        was = rec.state
        rec.to_in_use()
        if was is HoldState.IDLE:
            self._live += rec.nbytes
            self._held[rec.key] = rec
            self._cached.pop(rec.key, None)
        elif was is HoldState.PREFETCHED and rec.moves:
            self._ahead -= rec.nbytes
        if was is not HoldState.IN_USE:
            self._in_use += rec.nbytes
        self._peaks()

    def _unuse(self, rec: UnitRecord) -> None:
        """One caller's hold ends; at the last, keep the unit or give it back."""
        rec.users -= 1
        if rec.users:
            return
        self._in_use -= rec.nbytes
        trace = self._cursor.trace if self._cursor.replaying else None
        if (
            self._step is not None
            and self._live <= self.budget.max_live_nbytes
            and lookahead.keep_for_reuse(
                trace, self._cursor.pos, rec.key, self.budget.max_reuse_distance_nbytes
            )
        ):
            rec.to_kept()
            self._step.add("kept")
        else:
            self._drop(rec, "released")

    def _drop(self, rec: UnitRecord, why: str) -> None:
        """Gives the scheduler's hold back (the store keeps the data cached until it needs the room)."""
        c = self._counters()
        state, fut, submitting = rec.state, rec.future, rec.submitting
        if state is HoldState.PREFETCHED:
            if rec.moves:
                self._ahead -= rec.nbytes
            c.add("dropped_prefetches")
            c.add("dropped_nbytes", rec.nbytes)
        elif state is HoldState.KEPT and why == "displaced":
            c.add("displaced")
        if why == "pressure":
            c.add("pressure_drops")
        elif why == "reclaimed":
            c.add("reclaimed")
        self._live -= rec.nbytes
        rec.to_idle()
        del self._held[rec.key]
        self._cached[rec.key] = rec
        if not submitting and fut is not None:
            self._give_back(rec.key, fut)  # a submitting thread gives it back itself (gen changed)
        # The lookahead passed over this unit's next use while it was held: look again from the cursor.
        view = self._view()
        if view is not None:
            trace, pos = view
            nxt = trace.next_use(rec.key, pos)
            if nxt is not None and nxt < self._frontier:
                self._frontier = pos

    def _give_back(self, key: Hashable, fut: Any) -> None:
        if _failed_done(fut):
            return  # a failed fetch leaves no hold in the store
        try:
            self.store.release(key)
        except StoreStateError:
            if _failed_done(fut):
                return  # it failed between the check and the release
            raise

    def _submitted_future(self, rec: UnitRecord) -> Any:
        """The future of ``rec``'s fetch, waiting while another thread is still inside store.fetch for it
        (under ``_lock``, which the wait releases; [Note: no silent waits])."""
        if rec.submitting:
            wait_until(
                lambda s: self._lock.wait_for(lambda: not rec.submitting, s),
                what=f"scheduler '{self.name}': another thread to finish submitting the fetch of key {rec.key!r}",
                holder=self._fetch_holder_name,
                cause=self._fetch_holder_died,
                log=log,
            )
        if rec.future is None:
            raise ScheduleError(
                f"scheduler '{self.name}' was closed while key {rec.key!r} was being fetched"
            )
        return rec.future

    def _result(self, rec: UnitRecord, fut: Any, c: StepCounters, t0: float) -> torch.Tensor:
        try:
            return fut.result()
        except BaseException as e:
            with self._lock:
                self._unuse_failed(rec, fut)
            if isinstance(e, Exception) and hasattr(e, "add_note"):
                e.add_note(f"(while scheduler '{self.name}' served acquire of key {rec.key!r})")
            raise
        finally:
            now = time.monotonic()
            with self._lock:
                c.add("stall_s", now - t0)
            tl = Timeline.active
            if tl is not None:  # the span stall_s counts, to the clock read; formatted later
                tl.deferred(_acquire_span, (rec.key, t0, now, c.step))

    def _unuse_failed(self, rec: UnitRecord, fut: Any) -> None:
        """A caller's acquire raised: its hold ends (a failed fetch left no store hold to give back)."""
        if rec.state is not HoldState.IN_USE or rec.users == 0:
            return  # closed meanwhile
        if not _failed_done(fut) or rec.future is not fut:
            self._unuse(rec)  # interrupted while waiting: an ordinary release
            return
        rec.users -= 1
        if rec.users == 0:
            self._in_use -= rec.nbytes
            self._live -= rec.nbytes
            rec.to_idle()
            del self._held[rec.key]

    def _peaks(self) -> None:
        self._counters().peaks(self._live, self._ahead)

    def _check_open(self) -> None:
        if self._closed:
            raise ScheduleError(f"scheduler '{self.name}' is closed")

    # -- internals: fetching ------------------------------------------------------------

    def _under_fetch_lock(self, work: Callable[[], Any] | None, *, block: bool) -> Any:
        """Runs ``work`` (if any) then issues prefetches, holding ``_fetch_lock``; see the threading rules.

        Without ``block``, a busy lock only raises ``_replan``: its holder
        plans again before it lets go (it checks the flag after releasing, and
        whoever set the flag retried the lock after setting it).
        """
        got = self._take_fetch_lock() if block else self._fetch_lock.acquire(blocking=False)
        result = None
        while True:
            if not got:
                with self._lock:
                    self._replan = True
                if not self._fetch_lock.acquire(blocking=False):
                    return result
            self._fetch_holder = threading.current_thread()
            try:
                if work is not None:
                    w, work = work, None
                    result = w()
                self._issue_prefetches()
            finally:
                self._fetch_holder = None
                self._fetch_lock.release()
            with self._lock:
                if not self._replan:
                    return result
            got = self._fetch_lock.acquire(blocking=False)

    def _take_fetch_lock(self) -> bool:
        """Waits for ``_fetch_lock`` (an on-demand fetch), saying who holds it if that takes long."""
        return wait_until(
            lambda s: self._fetch_lock.acquire(timeout=s),
            what=f"scheduler '{self.name}''s fetch lock (another thread is fetching)",
            kind="lock",
            holder=self._fetch_holder_name,
            cause=self._fetch_holder_died,
            log=log,
        )

    def _fetch_holder_name(self) -> str:
        holder = self._fetch_holder
        return f"thread {holder.name}" if holder is not None else "a thread that is letting it go"

    def _fetch_holder_died(self) -> ScheduleError | None:
        """A cause for the waits above: the thread inside store.fetch died without letting go."""
        holder = self._fetch_holder
        if holder is None or holder.is_alive() or not self._fetch_lock.locked():
            return None
        return ScheduleError(
            f"scheduler '{self.name}': thread {holder.name} died while fetching (it held the fetch "
            "lock); its own error says why. Fetches from this scheduler cannot go on: close the engine"
        )

    def _demand(self, rec: UnitRecord, c: StepCounters) -> Any:
        """The caller's own fetch of an idle unit (holding ``_fetch_lock``); returns its future."""
        with self._lock:
            self._check_open()
            if rec.state is not HoldState.IDLE:  # fetched by another thread meanwhile
                self._classify_hit(rec, c)
                self._use(rec)
                return rec.future
            c.add("on_demand")
            self._room_for_demand(rec)
            self._use(rec)
            if self._live > self.budget.max_live_nbytes:
                c.add("over_budget_demands")
            reads = self._reads_from_disk(rec.key)
            rec.submitting = True
            gen = rec.gen
        t = time.monotonic()
        fut: Any  # a StoreFuture, or a failed concurrent Future when the store refused at once
        try:
            fut = self.store.fetch(rec.key, self.tier)
        except Exception as e:
            fut = _failed(e)
            reads = False
        waited = time.monotonic() - t
        with self._lock:
            if reads:
                c.add("demand_pool_wait_s", waited)
            self._attach(rec, gen, fut, reads)
        return fut

    def _room_for_demand(self, rec: UnitRecord) -> None:
        """Gives up the scheduler's own holds until ``rec`` fits max_live and the pool (see the notes)."""
        trace, pos = self._view() or (None, 0)
        over = self._live + rec.nbytes - self.budget.max_live_nbytes
        if over > 0:
            for victim in lookahead.furthest_first(self._discretionary(), trace, pos):
                self._drop(victim, "budget")
                over -= victim.nbytes
                if over <= 0:
                    break
        if not self._reads_from_disk(rec.key):
            return
        need = round_up(rec.nbytes, DIRECT_ALIGNMENT)
        if self._pool_can_serve(need):
            return
        for idle in lookahead.furthest_first(list(self._cached.values()), trace, pos):
            if self._evict_idle(idle) and self._pool_can_serve(need):
                return
        for victim in lookahead.furthest_first(self._discretionary(), trace, pos):
            self._drop(victim, "pressure")
            self._evict_idle(victim)
            if self._pool_can_serve(need):
                return

    def _discretionary(self) -> list[UnitRecord]:
        return [r for r in self._held.values() if r.state in DISCRETIONARY and not r.submitting]

    def _issue_prefetches(self) -> None:
        """Plans and submits prefetches until the budgets or the pool say stop (holding ``_fetch_lock``)."""
        while True:
            with self._lock:
                self._replan = False
                batch = self._plan()
            if not batch:
                return
            for rec, gen, reads in batch:
                try:
                    fut = self.store.fetch(rec.key, self.tier)
                except (
                    Exception
                ) as e:  # refused at once (never written, closed): raised at its acquire
                    with self._lock:
                        self._counters().add("prefetch_errors")
                        self._attach(rec, gen, _failed(e), False)
                    continue
                with self._lock:
                    self._attach(rec, gen, fut, reads)

    def _plan(self) -> list[tuple[UnitRecord, int, bool]]:
        """Marks the next units to prefetch (under ``_lock``): in trace order, within the budgets and the
        pool, ending at the first that needs pool memory (the next room check must see it taken)."""
        view = None if self._closed else self._view()
        if view is None:
            return []
        if self.budget.prefetch_bucket_nbytes == 0 or self._in_use > self.budget.max_live_nbytes:
            return []
        trace, pos = view
        batch: list[tuple[UnitRecord, int, bool]] = []
        j = max(self._frontier, pos)
        while j < len(trace):
            rec = self._records.get(trace.keys[j]) or self._record(trace.keys[j])
            if rec.state is not HoldState.IDLE:
                j += 1
                continue
            admitted = self._admit(rec, trace, pos, j)
            if admitted is None:
                break
            reads, moves = admitted
            rec.to_prefetched()
            rec.submitting = True
            rec.moves = moves
            self._held[rec.key] = rec
            self._cached.pop(rec.key, None)
            self._live += rec.nbytes
            if moves:
                self._ahead += rec.nbytes
            self._counters().add("prefetches")
            self._peaks()
            batch.append((rec, rec.gen, reads))
            j += 1
            if reads:
                break
        self._frontier = j
        return batch

    def _admit(self, rec: UnitRecord, trace: Trace, pos: int, at: int) -> tuple[bool, bool] | None:
        """(reads, moves) if ``rec``, used at trace position ``at`` (the walk starting at ``pos``), may be
        prefetched now (giving up kept units needed later if max_live asks it); None if the walk must
        stop here."""
        c = self._counters()
        b = self.budget
        if self._ready is not None and not self._ready(rec.key):
            c.add("not_ready")
            return None
        reads = self._reads_from_disk(rec.key)
        moves = reads or self._copies_to_device
        within_bucket, lacking = lookahead.fits(
            rec.nbytes,
            moves=moves,
            ahead=self._ahead,
            live=self._live,
            bucket=b.prefetch_bucket_nbytes,
            max_live=b.max_live_nbytes,
        )
        if not within_bucket:
            return None
        if lacking:
            kept = [r for r in self._held.values() if r.state is HoldState.KEPT]
            victims = lookahead.displace(kept, trace, pos, at, lacking)
            if victims is None:
                return None
            for v in victims:
                self._drop(v, "displaced")
        if reads and not self._pool_room_for_prefetch(rec, trace, pos, at):
            c.add("pool_deferrals")
            return None
        return reads, moves

    def _attach(self, rec: UnitRecord, gen: int, fut: Any, reads: bool) -> None:
        """Records the future of a fetch that just returned (under ``_lock``)."""
        rec.submitting = False
        if reads:
            c = self._counters()
            c.add("reads")
            c.add("read_nbytes", rec.nbytes)
            step = c.step
            if rec.read_step == step and step >= 0:
                c.add("rereads")
                if not rec.read_used:
                    c.add("duplicate_reads")
            rec.read_step = step
            rec.read_used = rec.state is HoldState.IN_USE
        if rec.gen != gen:
            self._give_back(rec.key, fut)  # given up while we were in store.fetch
        else:
            rec.future = fut
        self._lock.notify_all()

    # -- internals: the pool ----------------------------------------------------------

    def _reads_from_disk(self, key: Hashable) -> bool:
        """Whether a fetch of ``key`` now would read it into new pool memory."""
        spec = self.store.spec(key)
        return spec.home == "nvme" and spec.state is Residency.AT_REST and spec.nbytes > 0

    def _pool_can_serve(self, need: int) -> bool:
        return self._pool.waiting_nbytes() == 0 and self._pool.can_serve(need)

    def _pool_room_for_prefetch(self, rec: UnitRecord, trace: Trace, pos: int, at: int) -> bool:
        need = round_up(rec.nbytes, DIRECT_ALIGNMENT)
        if self._pool_can_serve(need):
            return True
        for idle in lookahead.needed_after(list(self._cached.values()), trace, pos, at):
            if self._evict_idle(idle) and self._pool_can_serve(need):
                return True
        # The pool, like max_live, is shared with kept units: those needed later give way.
        kept = [r for r in self._held.values() if r.state is HoldState.KEPT]
        for victim in lookahead.needed_after(kept, trace, pos, at):
            self._drop(victim, "displaced")
            if self._evict_idle(victim) and self._pool_can_serve(need):
                return True
        return False

    def _evict_idle(self, rec: UnitRecord) -> bool:
        """Evicts ``rec``'s clean, unheld cache entry from the store; True if that freed pool memory."""
        if rec.state is not HoldState.IDLE:
            return False
        spec = self.store.spec(rec.key)
        if spec.state is Residency.AT_REST:
            self._cached.pop(rec.key, None)
            return False
        if spec.state is not Residency.IN_HOST or spec.holds or spec.home != "nvme":
            return False  # dirty, in I/O, or held by someone else: not ours to evict now
        try:
            self.store.evict(rec.key)
        except StoreStateError:
            return False
        self._cached.pop(rec.key, None)
        self._counters().add("pool_evictions")
        return True

    def _reclaim(self, nbytes: int) -> None:
        """The pool's reclaimer: someone waits for ``nbytes`` of pool memory (see [Note: pool room]).

        Called by the waiting thread with no pool or store lock held. Idle cache
        entries the scheduler knows go first, then what it holds on its own
        judgement, furthest next use first, until the pool can serve the request.
        The units callers hold are theirs: they stay.
        """
        with self._lock:
            if self._closed:
                return
            need = round_up(nbytes, DIRECT_ALIGNMENT)
            trace, pos = self._view() or (None, 0)
            for idle in lookahead.furthest_first(list(self._cached.values()), trace, pos):
                if self._pool.can_serve(need):
                    return
                self._evict_idle(idle)
            for victim in lookahead.furthest_first(self._discretionary(), trace, pos):
                if self._pool.can_serve(need):
                    return
                self._drop(victim, "reclaimed")
                self._evict_idle(victim)


def _acquire_span(
    key: Hashable, start: float, end: float, step: int
) -> tuple[str, str, float, float, None, dict[str, Any]]:
    """An acquire's wait as a timeline span (``Timeline.deferred``'s fields), on the caller's track."""
    args = {"kind": "read", "key": repr(key), "source": "scheduler", "step": step}
    return f"unit {key!r}", "wait", start, end, None, args
