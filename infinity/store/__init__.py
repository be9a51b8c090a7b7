"""The tiered tensor store: keys at rest on NVMe or in host memory, made resident in pool memory and on the device.

Imports only infinity.memory, infinity.aio, infinity.host and infinity.timeline (and torch). See
docs/ARCHITECTURE.md and [Note: residency] in record.py.
"""

from infinity.store.device import Tier
from infinity.store.errors import (
    IntegrityError,
    StoreError,
    StoreIOError,
    StoreStateError,
    SwapSpaceError,
)
from infinity.store.futures import StoreFuture
from infinity.store.record import KeySpec, Residency
from infinity.store.stats import KeyTraffic, StoreStats, TierTraffic
from infinity.store.store import Home, TieredStore
from infinity.store.swapdir import reclaim_stale
from infinity.store.tracked import StateEnum, TrackedRecord

__all__ = [
    "Home",
    "IntegrityError",
    "KeySpec",
    "KeyTraffic",
    "Residency",
    "StoreError",
    "StoreFuture",
    "StoreIOError",
    "StoreStateError",
    "StateEnum",
    "StoreStats",
    "SwapSpaceError",
    "Tier",
    "TierTraffic",
    "TieredStore",
    "TrackedRecord",
    "reclaim_stale",
]
