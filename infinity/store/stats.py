"""StoreStats: what a store moved, how fast, and how long its callers waited — cheap enough to leave on.

Counters are plain integers updated under the store lock at submit and
completion. GB/s per direction is bytes / busy time, where busy time is the
union of the intervals with at least one request of that direction in flight
(so overlapping requests are not double counted). Completion is stamped when
the store notices it (a waiting caller at once, the reaper within a few ms),
so busy time can run slightly long: GB/s errs low, never high.

Cost: the counters are updated at submit and completion only; ``stats()``
itself walks the keys for the resident/dirty/held totals (O(keys): 0.3 ms
per 10^4 keys here), so poll it per step rather than per fetch.

Threading: Traffic is mutated under the store lock; snapshots are immutable.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Hashable, Mapping
from typing import Any

from infinity.memory import PoolStats


@dataclasses.dataclass(frozen=True)
class TierTraffic:
    """Bytes moved in one direction between two tiers."""

    nbytes: int
    requests: int
    busy_s: float

    @property
    def gbps(self) -> float:
        """GB/s (10^9 bytes per second of busy time); 0 when nothing moved."""
        return self.nbytes / self.busy_s / 1e9 if self.busy_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "gbps": self.gbps}


class Traffic:
    __slots__ = ("nbytes", "requests", "busy_s", "_active", "_since")

    def __init__(self) -> None:
        self.nbytes = 0
        self.requests = 0
        self.busy_s = 0.0
        self._active = 0
        self._since = 0.0

    def start(self) -> None:
        if self._active == 0:
            self._since = time.monotonic()
        self._active += 1
        self.requests += 1

    def end(self, nbytes: int) -> None:
        self._active -= 1
        self.nbytes += nbytes
        if self._active == 0:
            self.busy_s += time.monotonic() - self._since

    def snapshot(self) -> TierTraffic:
        busy = self.busy_s + (time.monotonic() - self._since if self._active else 0.0)
        return TierTraffic(self.nbytes, self.requests, busy)


@dataclasses.dataclass(frozen=True)
class KeyTraffic:
    """NVMe bytes moved per key (``TieredStore.key_traffic``): a key that never moved has no row."""

    read: Mapping[Hashable, int]
    """NVMe → host, per key."""
    written: Mapping[Hashable, int]
    """Host → NVMe (write, flush, write-back), per key."""

    def since(self, earlier: KeyTraffic) -> KeyTraffic:
        """What moved after ``earlier`` (a snapshot of the same store), keys that moved nothing left out."""

        def diff(now: Mapping[Hashable, int], then: Mapping[Hashable, int]) -> dict[Hashable, int]:
            return {k: n - then.get(k, 0) for k, n in now.items() if n != then.get(k, 0)}

        return KeyTraffic(diff(self.read, earlier.read), diff(self.written, earlier.written))


@dataclasses.dataclass(frozen=True)
class StoreStats:
    name: str
    keys: int
    resident_nbytes: int
    """Bytes of keys resident in pool regions (held or cached)."""
    dirty_nbytes: int
    held_keys: int
    read: TierTraffic
    """NVMe → host."""
    write: TierTraffic
    """Host → NVMe (write, flush, write-back)."""
    h2d: TierTraffic
    """Host → device (CUDA)."""
    d2h: TierTraffic
    """Device → host (CUDA, dirty device copies)."""
    in_flight: int
    """Requests submitted and not yet completed."""
    wait_s: float
    """Seconds callers spent blocked in StoreFuture.result()."""
    pool_wait_s: float
    """Seconds the store's own calls spent waiting for pool space."""
    fetches: int
    hits: int
    """Fetches served from resident memory (no I/O)."""
    shared: int
    """Fetches that joined a read or write already in flight."""
    misses: int
    """Keys read from NVMe (or given a region for overwrite)."""
    evictions: int
    writebacks: int
    """Keys written home by flush, evict or the pool's need for room."""
    writes: int
    """write() calls."""
    integrity_checks: int
    checksum_nbytes: int
    """Bytes checksummed (integrity): every byte written home and read back."""
    checksum_s: float
    """CPU seconds spent computing those checksums, in any thread."""
    checksum_caller_s: float
    """The part of ``checksum_s`` spent in callers' threads waiting on the op (the rest ran in the
    store's reaper, behind the caller's back): the most integrity can add to a caller's time."""
    swap_capacity: int
    swap_used: int
    pool: PoolStats

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k in ("read", "write", "h2d", "d2h"):
            d[k] = getattr(self, k).as_dict()
        return d
