"""UnitRecord: what the scheduler knows about one key, with its state and the transitions between states.

[Note: hold states]
    IDLE ──plan──▶ PREFETCHED ──acquire──▶ IN_USE ──last release──▶ KEPT
      ▲  ──acquire (on demand)──────────────▲  ▲                      │
      │                                        └──────acquire─────────┘
      └──── drop (PREFETCHED unused, KEPT, or IN_USE's last release) ──┘
The scheduler holds exactly one store hold for every record that is not
IDLE (callers' holds are counted in ``users``, not as more store holds), so
"live" bytes are the sizes of the non-IDLE records. A record whose store
fetch is still being submitted by another thread (``submitting``) has no
future yet; a drop then only bumps ``gen`` and the submitting thread gives
the hold back when its fetch returns.

Each ``to_*`` method asserts the states it may leave and raises
ScheduleError naming the key and both states otherwise (the TrackedRecord
pattern, infinity/store/tracked.py).

Threading: records are only touched under their scheduler's lock.
"""

from __future__ import annotations

from collections.abc import Hashable

from infinity.schedule.errors import ScheduleError
from infinity.store import StateEnum, StoreFuture, TrackedRecord


class HoldState(StateEnum):
    """Why the scheduler holds a key: not at all, ahead of a predicted use, for its callers, or for
    reuse soon (the store's side of the key is its Residency)."""

    IDLE = ("idle", "The scheduler holds nothing for it (the store may still cache it).")
    PREFETCHED = (
        "prefetched",
        "Fetched ahead of a predicted use that has not come yet (its read may still be in flight).",
    )
    IN_USE = ("in use", "Handed out by acquire and not yet released by every caller.")
    KEPT = (
        "kept",
        "Released by its callers but still held: the trace uses it again within the reuse distance.",
    )


LIVE = (HoldState.PREFETCHED, HoldState.IN_USE, HoldState.KEPT)
DISCRETIONARY = (HoldState.PREFETCHED, HoldState.KEPT)
"""Held on the scheduler's own judgement, so dropped first when room is needed."""


class UnitRecord(TrackedRecord):
    """What the scheduler knows about one key (see [Note: hold states])."""

    transition_error = ScheduleError
    transition_name = "scheduler transition"

    __slots__ = (
        "nbytes",
        "users",
        "future",
        "submitting",
        "gen",
        "read_step",
        "read_used",
        "moves",
    )

    def __init__(self, key: Hashable, nbytes: int):
        super().__init__(key, HoldState.IDLE)
        self.nbytes = nbytes
        self.users = 0  # callers holding it (acquires not yet released)
        self.future: StoreFuture | None = None  # the StoreFuture of the scheduler's hold
        self.submitting = False  # a thread is inside store.fetch for it; no future yet
        self.gen = 0  # bumped whenever it becomes live or is dropped
        self.read_step = -1  # the step in which our fetch last caused a read from NVMe
        self.read_used = True  # that read's data has been handed to a caller
        self.moves = False  # its prefetch moved data (counts against the bucket while PREFETCHED)

    def to_prefetched(self) -> None:
        self._move(HoldState.PREFETCHED, (HoldState.IDLE,))
        self.gen += 1

    def to_in_use(self) -> None:
        """One more caller; from IDLE this is an on-demand fetch (the caller submits it)."""
        if self.state is not HoldState.IN_USE:
            was = self.state
            self._move(HoldState.IN_USE, (HoldState.IDLE, HoldState.PREFETCHED, HoldState.KEPT))
            if was is HoldState.IDLE:
                self.gen += 1
        self.users += 1
        self.read_used = True

    def to_kept(self) -> None:
        if self.users:
            raise ScheduleError(f"key {self.key!r} kept while {self.users} caller(s) hold it")
        self._move(HoldState.KEPT, (HoldState.IN_USE,))

    def to_idle(self) -> None:
        self._move(HoldState.IDLE, LIVE)
        self.users = 0
        self.future = None
        self.gen += 1

    def __repr__(self) -> str:
        return (
            f"<UnitRecord {self.key!r} {self.state.value} users={self.users}"
            f"{' submitting' if self.submitting else ''}>"
        )
