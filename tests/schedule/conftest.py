"""Fixtures for the scheduler tests: a real store instrumented to check the budgets at every event.

CheckedStore is a TieredStore whose fetch / release / evict also log the call
(key, the key's residency before it, the thread) and run Checker, which
asserts the scheduler's budgets from what the *store* sees, not from the
scheduler's own counters:
- live  = bytes of keys the store counts holds on,
- ahead = bytes of keys read from NVMe (fetched at rest, hold 0 → 1) while no
  thread was acquiring them, whose use has not begun since (no acquire of
  them has started): on the CPU a fetch of a resident key moves nothing,
- in_use = bytes of keys the consumer holds or is acquiring;
and at every event: ahead ≤ bucket and live ≤ max(max_live, in_use).
Violations are collected (an assertion inside the scheduler's lock would only
muddle the failure) and tests assert there are none, and that events were
checked at all.

Consumer plays the partitioner: it acquires units through the scheduler,
checks each tensor is that unit's data (never another unit's), and releases.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
import torch

from infinity.aio import AioConfig
from infinity.memory import BufferPool
from infinity.schedule import PrefetchScheduler
from infinity.store import Residency, TieredStore

ENGINES = ["io_uring", "threads"]
KiB = 1 << 10
UNIT = 16 * KiB  # bytes of a default unit (4096 float32)


class Checker:
    def __init__(self, store: TieredStore, sizes: dict[str, int]):
        self.store = store
        self.sizes = sizes
        self.lock = threading.Lock()
        self.acquiring_now: collections.Counter[str] = collections.Counter()  # acquires in progress
        self.bucket: int | None = None
        self.max_live: int | None = None
        self.ahead: set[str] = set()
        self.in_use: collections.Counter[str] = collections.Counter()
        self.outside: collections.Counter[str] = collections.Counter()  # holds taken by others
        self.violations: list[str] = []
        self.events = 0
        self.peak_live = 0
        self.peak_ahead = 0
        self.log: list[
            tuple
        ] = []  # ("fetch"|"release"|"evict"|"acquire"|"acquired"|"release_unit", key, extra)

    def reset(self) -> None:
        """Forgets everything seen (a new scenario on the same store)."""
        with self.lock:
            self.ahead.clear()
            self.in_use.clear()
            self.acquiring_now.clear()
            self.violations.clear()
            self.log.clear()
            self.events = self.peak_live = self.peak_ahead = 0

    def bind(self, sched: PrefetchScheduler) -> None:
        self.bucket = sched.budget.prefetch_bucket_nbytes
        self.max_live = sched.budget.max_live_nbytes

    # -- store events -----------------------------------------------------------
    def on_fetch(self, key, before: Residency) -> None:
        with self.lock:
            self.log.append(("fetch", key, before))
            if (
                self._holds(key) == 1
                and not self.acquiring_now[key]
                and before is Residency.AT_REST
            ):
                self.ahead.add(key)
            self._check(f"fetch of {key!r}")

    def on_release(self, keys) -> None:
        with self.lock:
            for key in keys:
                self.log.append(("release", key, None))
                if self._holds(key) == 0:
                    self.ahead.discard(key)
            self._check(f"release of {list(keys)!r}")

    def on_evict(self, key) -> None:
        with self.lock:
            self.log.append(("evict", key, None))

    # -- consumer events ------------------------------------------------------------
    def acquiring(self, key) -> None:
        with self.lock:
            self.acquiring_now[key] += 1
            self.log.append(("acquire", key, None))
            self.ahead.discard(key)  # its use has begun: no longer ahead of it
            self.in_use[key] += 1
            self._check(f"acquire of {key!r}")

    def acquired(self, key, ok: bool) -> None:
        with self.lock:
            self.acquiring_now[key] -= 1
            self.ahead.discard(key)
            if not ok:
                self.in_use[key] -= 1
            self.log.append(("acquired", key, ok))
            self._check(f"acquired {key!r}")

    def released(self, key) -> None:
        with self.lock:
            self.in_use[key] -= 1
            self.log.append(("release_unit", key, None))
            self._check(f"consumer release of {key!r}")

    def _holds(self, key) -> int:
        """Holds the scheduler has on ``key`` (the store's count less those taken by others)."""
        return self.store.spec(key).holds - self.outside[key]

    def _check(self, event: str) -> None:
        if self.bucket is None:
            return
        self.events += 1
        live = sum(n for k, n in self.sizes.items() if self._holds(k) > 0)
        ahead = sum(self.sizes[k] for k in self.ahead)
        in_use = sum(self.sizes[k] for k, c in self.in_use.items() if c > 0)
        self.peak_live = max(self.peak_live, live)
        self.peak_ahead = max(self.peak_ahead, ahead)
        if ahead > self.bucket:
            self.violations.append(
                f"after {event}: {ahead} bytes ahead > bucket {self.bucket} ({sorted(self.ahead)})"
            )
        if live > max(self.max_live, in_use):
            self.violations.append(
                f"after {event}: {live} bytes live > max(max_live {self.max_live}, in use {in_use})"
            )

    # -- queries ------------------------------------------------------------------------
    def fetches(self, key=None) -> list[tuple]:
        return [e for e in self.log if e[0] == "fetch" and (key is None or e[1] == key)]

    def reads(self) -> list[str]:
        """Keys whose fetch found them at rest (a read from NVMe), in the order the fetches were made."""
        return [
            k for kind, k, before in self.log if kind == "fetch" and before is Residency.AT_REST
        ]

    def clear(self) -> None:
        with self.lock:
            self.log.clear()


class CheckedStore(TieredStore):
    checker: Checker | None = None

    def fetch(self, key, tier="host", *, overwrite=False):
        before = self.spec(key).state
        fut = super().fetch(key, tier, overwrite=overwrite)
        if self.checker is not None:
            self.checker.on_fetch(key, before)
        return fut

    def release(self, key) -> None:
        super().release(key)
        if self.checker is not None:
            self.checker.on_release([key])

    def release_many(self, keys) -> None:
        keys = list(keys)
        super().release_many(keys)
        if self.checker is not None:
            self.checker.on_release(keys)

    def evict(self, key):
        fut = super().evict(key)
        if self.checker is not None:
            self.checker.on_evict(key)
        return fut


def unit_data(i: int, nbytes: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(nbytes // 4, generator=g)


@dataclass
class Env:
    store: CheckedStore
    keys: list[str]
    data: dict[str, torch.Tensor]
    checker: Checker
    aio: object = None
    scheds: list[PrefetchScheduler] = field(default_factory=list)

    def scheduler(self, *, bucket: int, live: int, reuse: int = 0, **kw) -> PrefetchScheduler:
        s = PrefetchScheduler(
            self.store,
            prefetch_bucket_nbytes=bucket,
            max_live_nbytes=live,
            max_reuse_distance_nbytes=reuse,
            tier=kw.pop("tier", "device"),
            **kw,
        )
        self.checker.bind(s)
        self.scheds.append(s)
        return s

    def cold(self) -> None:
        """Evicts every unheld key, so the next step reads from NVMe.

        A read still in flight (a prefetch given up at the end of a step) is
        waited for first: the store refuses to evict a key mid-read.
        """
        checker, self.store.checker = self.store.checker, None
        try:
            for k in self.keys:
                spec = self.store.spec(k)
                if spec.holds:
                    continue
                if spec.state in (Residency.READING, Residency.WRITING, Residency.COPYING):
                    self.store.fetch(k).result(30)
                    self.store.release(k)
                self.store.evict(k).result(30)
        finally:
            self.store.checker = checker

    def fetch_outside(self, key: str) -> torch.Tensor:
        """A hold taken on the store directly, not through the scheduler (an optimizer, a user)."""
        self.checker.outside[key] += 1
        checker, self.store.checker = self.store.checker, None
        try:
            return self.store.fetch(key).result(30)
        finally:
            self.store.checker = checker

    def release_outside(self, key: str) -> None:
        checker, self.store.checker = self.store.checker, None
        try:
            self.store.release(key)
        finally:
            self.store.checker = checker
        self.checker.outside[key] -= 1

    def holds(self) -> dict[str, int]:
        return {k: self.store.spec(k).holds for k in self.keys if self.store.spec(k).holds}


class Consumer:
    """Acquires and releases units like the partitioner, checking every tensor it gets."""

    def __init__(self, env: Env, sched: PrefetchScheduler):
        self.env = env
        self.sched = sched
        self.held: collections.Counter[str] = collections.Counter()

    def acquire(self, key: str) -> torch.Tensor:
        self.env.checker.acquiring(key)
        ok = False
        try:
            t = self.sched.acquire(key)
            ok = True
        finally:
            self.env.checker.acquired(key, ok)
        assert torch.equal(t, self.env.data[key]), f"acquire({key!r}) returned another unit's data"
        self.held[key] += 1
        return t

    def release(self, key: str) -> None:
        self.held[key] -= 1
        self.sched.release(key)
        self.env.checker.released(key)

    def use(self, key: str, work=None) -> None:
        t = self.acquire(key)
        try:
            if work is not None:
                work(t)
        finally:
            self.release(key)

    def release_all(self) -> None:
        for key, n in list(self.held.items()):
            for _ in range(n):
                self.release(key)

    def step(self, program: Sequence) -> None:
        """One step: ``program`` is a list of keys (acquire + release each) or ("acq"|"rel", key) pairs."""
        self.sched.begin_step()
        self.run(program)
        self.sched.end_step()

    def run(self, program: Sequence) -> None:
        for op in program:
            if isinstance(op, tuple):
                kind, key = op
                (self.acquire if kind == "acq" else self.release)(key)
            else:
                self.use(op)


def chain(keys: Sequence[str]) -> list[str]:
    """Forward then backward over a chain of units: 0 … n-1, n-1 … 0."""
    return list(keys) + list(reversed(keys))


@pytest.fixture
def make_env(nvme_dir):
    made: list[Env] = []

    def make(
        n_units: int = 12,
        *,
        sizes: Sequence[int] | None = None,
        pool_count: int = 16,
        pool_size: int = UNIT,
        engine: str = "io_uring",
        recording: bool = False,
        **store_kw,
    ) -> Env:
        sizes = list(sizes) if sizes is not None else [UNIT] * n_units
        keys = [f"u{i}" for i in range(len(sizes))]
        aio = None
        if recording:
            from tests.store.conftest import RecordingAio

            aio = RecordingAio(engine)
            store_kw["aio"] = aio
        else:
            store_kw["aio"] = AioConfig(engine=engine)
        pool = BufferPool(pool_count, pool_size, name="sched-test-pool")
        store = CheckedStore(nvme_dir, pool=pool, **store_kw)
        store.register_many(
            [(k, (n // 4,), torch.float32) for k, n in zip(keys, sizes, strict=True)]
        )
        data = {k: unit_data(i, n) for i, (k, n) in enumerate(zip(keys, sizes, strict=True))}
        for k in keys:
            store.write(k, data[k]).result(30)
        env = Env(store, keys, data, Checker(store, dict(zip(keys, sizes, strict=True))), aio)
        env.cold()
        store.checker = env.checker
        made.append(env)
        return env

    yield make
    for env in made:
        for s in env.scheds:
            s.close()
        env.store.close()
        if env.aio is not None:
            env.aio.close()
