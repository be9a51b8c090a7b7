"""The pipeline the checkpoint movers share: store keys held from fetch until their I/O completes.

A Job is one group of keys (a unit's shards) with its aio request; a Window
keeps jobs in flight and completes them in order, releasing (and evicting)
their keys; a job may leave a FollowUp (a checksum running off-thread) that
is completed, in order too, before its keys are let go.

[Note: pool room]
Keys are held from their fetch until their I/O completes, so the pipeline
holds pool memory while writes are in flight. A fetch that would have to
wait for pool space is issued only when the pipeline holds nothing in that
store or the pool can serve it now; otherwise the oldest job is completed
(and its keys released and evicted) first. The pipeline so never waits for
room that it holds itself, and at most ``max_nbytes`` are in flight.

Threading: used by one thread; the store's reaper thread only resolves store futures.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Protocol

import torch

from infinity.aio import DIRECT_ALIGNMENT, AioRequest
from infinity.memory import round_up
from infinity.store import Residency, StoreFuture, TieredStore

DEFAULT_INFLIGHT_NBYTES = 64 << 20  # 1 MiB pieces at queue depth 32, twice over


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view."""
    return t.reshape(-1).view(torch.uint8)


@dataclasses.dataclass(frozen=True)
class StoreRef:
    store: TieredStore
    key: Hashable


def _by_store(refs: Sequence[StoreRef]) -> list[tuple[TieredStore, list[Hashable]]]:
    groups: dict[int, tuple[TieredStore, list[Hashable]]] = {}
    for r in refs:
        groups.setdefault(id(r.store), (r.store, []))[1].append(r.key)
    return list(groups.values())


def _room_needed(store: TieredStore, keys: Sequence[Hashable]) -> int:
    total = 0
    for k in keys:
        spec = store.spec(k)
        if spec.home == "nvme" and spec.state is Residency.AT_REST:
            total += round_up(spec.nbytes, DIRECT_ALIGNMENT)
    return total


class Holding:
    """The keys of one job, held in their stores from fetch until the job's I/O is over."""

    def __init__(self, refs: Sequence[StoreRef], *, overwrite: bool):
        self.refs = list(refs)
        self.overwrite = overwrite
        self.at_rest = [r.store.spec(r.key).state is Residency.AT_REST for r in self.refs]
        self._held = [False] * len(self.refs)
        self.futures: list[StoreFuture] = []
        self._order: list[int] = []  # ref index of each future
        by_store: dict[int, tuple[TieredStore, list[int]]] = {}
        for i, r in enumerate(self.refs):
            by_store.setdefault(id(r.store), (r.store, []))[1].append(i)
        try:
            for store, idx in by_store.values():
                self.futures.extend(
                    store.fetch_many([self.refs[i].key for i in idx], overwrite=overwrite)
                )
                self._order.extend(idx)
        except BaseException:
            self._settle()
            self.release([])
            raise

    def _settle(self) -> BaseException | None:
        """Waits for every fetch issued; marks the ones that succeeded as held; returns the first error."""
        first = None
        for fut, i in zip(self.futures, self._order, strict=True):
            if self._held[i]:
                continue
            try:
                fut.result()
                self._held[i] = True
            except Exception as e:  # every future must be awaited
                first = first or e
        return first

    def views(self) -> list[torch.Tensor]:
        """Waits for every fetch; on a failure releases the ones that succeeded and raises it."""
        first = self._settle()
        if first is not None:
            self.release([])
            raise first
        got: list[torch.Tensor | None] = [None] * len(self.refs)
        for fut, i in zip(self.futures, self._order, strict=True):
            got[i] = fut.result()
        return got  # type: ignore[return-value]

    def release(self, evictions: list[StoreFuture]) -> None:
        """Drops the holds; evicts keys that live on NVMe and were brought in (or overwritten) here."""
        held = [
            (r, rest) for r, rest, h in zip(self.refs, self.at_rest, self._held, strict=True) if h
        ]
        self._held = [False] * len(self.refs)
        for store, keys in _by_store([r for r, _ in held]):
            store.release_many(keys)
        for r, rest in held:
            spec = r.store.spec(r.key)
            if spec.home == "nvme" and spec.holds == 0 and (self.overwrite or rest):
                evictions.append(r.store.evict(r.key))


class FollowUp(Protocol):
    """Work a job still has after its I/O, running off this thread (a checksum); ``complete`` finishes it
    on this thread (compare, derive) once ``done``."""

    def done(self) -> bool: ...

    def complete(self) -> None: ...

    def wait_quietly(self) -> None:
        """Waits until nothing runs over the job's memory any more (after a failure elsewhere)."""
        ...


@dataclasses.dataclass
class Job:
    request: AioRequest | None
    holding: Holding | None
    nbytes: int
    on_done: Callable[[], FollowUp | None] | None  # after the I/O; may hand back a follow-up
    what: str
    follow: FollowUp | None = None

    def done(self) -> bool:
        return self.request is None or self.request.done()

    def follow_done(self) -> bool:
        return self.follow is None or self.follow.done()


class Window:
    """Jobs in flight, completed in order (see [Note: pool room]). A job whose ``on_done`` hands back a
    FollowUp waits in ``checking``, keeping its keys, until that is done; follow-ups complete in order."""

    def __init__(self, max_nbytes: int):
        self.max_nbytes = max_nbytes
        self.jobs: collections.deque[Job] = collections.deque()
        self.checking: collections.deque[Job] = collections.deque()
        self.nbytes = 0
        self.holding_in: collections.Counter[int] = collections.Counter()
        self.evictions: list[StoreFuture] = []

    def make_room(self, refs: Sequence[StoreRef], nbytes: int) -> None:
        while self.jobs or self.checking:
            fits = self.nbytes + nbytes <= self.max_nbytes and all(
                not self.holding_in[id(store)] or store.pool.can_serve(_room_needed(store, keys))
                for store, keys in _by_store(refs)
            )
            if fits:
                return
            self._step()

    def _step(self) -> None:
        """Finishes the oldest follow-up if the oldest job has none to wait for, else retires that job."""
        if self.checking and (not self.jobs or self.checking[0].follow_done()):
            self._complete(self.checking.popleft())
        else:
            self.retire_oldest()

    def add(self, job: Job) -> None:
        self.jobs.append(job)
        self.nbytes += job.nbytes
        if job.holding is not None:
            for store, _ in _by_store(job.holding.refs):
                self.holding_in[id(store)] += 1

    def _forget(self, job: Job) -> None:
        self.nbytes -= job.nbytes
        if job.holding is not None:
            for store, _ in _by_store(job.holding.refs):
                self.holding_in[id(store)] -= 1
            job.holding.release(self.evictions)

    def retire_oldest(self) -> None:
        job = self.jobs.popleft()
        try:
            if job.request is not None:
                job.request.wait()
            job.follow = job.on_done() if job.on_done is not None else None
        except BaseException:
            self._forget(job)
            raise
        if job.follow is not None:
            self.checking.append(job)
        else:
            self._forget(job)

    def _complete(self, job: Job) -> None:
        try:
            if job.follow is not None:
                job.follow.complete()
        finally:
            self._forget(job)

    def retire_done(self) -> None:
        while True:
            if self.jobs and self.jobs[0].done():
                self.retire_oldest()
            elif self.checking and self.checking[0].follow_done():
                self._complete(self.checking.popleft())
            else:
                return

    def drain(self) -> None:
        while self.jobs:
            self.retire_oldest()
        while self.checking:
            self._complete(self.checking.popleft())
        for fut in self.evictions:
            fut.result()
        self.evictions.clear()

    def abort(self) -> None:
        """After a failure: waits for everything in flight (ignoring its errors) and releases every hold."""
        while self.jobs:
            job = self.jobs.popleft()
            if job.request is not None:
                try:
                    job.request.wait()
                except Exception:
                    pass
            self.checking.append(job)
        while self.checking:
            job = self.checking.popleft()
            if job.follow is not None:
                job.follow.wait_quietly()
            self._forget(job)
        for fut in self.evictions:
            try:
                fut.result()
            except Exception:
                pass
        self.evictions.clear()
