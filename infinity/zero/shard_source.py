"""StoreShardSource: unit shards straight from a TieredStore, fetched when used (no read-ahead).

The ShardSource the partitioner uses when no prefetch scheduler is
configured; the scheduler (infinity.schedule) offers the same two calls.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from infinity.store import TieredStore


class StoreShardSource:
    def __init__(self, store: TieredStore):
        self.store = store

    def acquire(self, key: Hashable) -> torch.Tensor:
        return self.store.fetch(key, tier="device").result()

    def release(self, key: Hashable) -> None:
        self.store.release(key)

    def mark_dirty(self, key: Hashable) -> None:
        self.store.mark_dirty(key)

    def begin_step(self) -> None:
        pass

    def end_step(self) -> None:
        pass
