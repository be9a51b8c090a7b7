"""QuantizedShards: the ShardSource of dequantised unit shards over one of quantised shards.

A unit's shard at rest is laid out by its ShardFormat ([Note: quantised
shards] in infinity/weights/quant.py); ``unit_shard_format`` makes it from the
unit's layout. QuantizedShards sits between the partitioner and the shard
source (the prefetch scheduler): ``acquire`` takes the packed shard (read
ahead like any other), dequantises it into a buffer of the unit's dtype from
the TensorCache and gives the packed hold back (a unit waiting for its use
stays in its packed bytes: NF4 is a quarter of bf16); ``release`` returns the
buffer to the cache, which reuses it once no saved tensor views it; ``mark_dirty`` (a change made under GatheredParameters) quantises the
held values back into the store. Keys without a format (a training run's
trainable units, beside its quantised frozen ones) pass through unchanged.

Threading: the forward thread (the partitioner's); the inner source is thread-safe.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import torch

from infinity.weights.quant import (
    QuantSpec,
    ShardFormat,
    dequantize_into,
    quantize_into,
    shard_format,
)
from infinity.zero.buffers import TensorCache
from infinity.zero.layout import UnitLayout


def unit_shard_format(layout: UnitLayout, rank: int, spec: QuantSpec) -> ShardFormat:
    """The at-rest format of rank ``rank``'s shard of a unit with ``layout``."""
    stretches = [
        (s.shard_lo, s.shard_hi, tuple(layout.slots[s.slot].shape)) for s in layout.segments(rank)
    ]
    return shard_format(stretches, layout.shard_numel, layout.dtype, spec)


class QuantizedShards:
    """A ShardSource of dequantised shards over one of packed shards (see [Note: quantised shards])."""

    def __init__(self, inner, formats: Mapping[Hashable, ShardFormat], cache: TensorCache):
        """``inner``: the ShardSource holding the packed shards (acquire / release / mark_dirty);
        ``formats``: each key's ShardFormat; ``cache``: where the dequantised buffers come from."""
        self.inner = inner
        self.formats = dict(formats)
        self.cache = cache
        self._held: dict[Hashable, tuple[torch.Tensor, int]] = {}  # key -> (values, holds)

    def acquire(self, key: Hashable) -> torch.Tensor:
        if key not in self.formats:
            return self.inner.acquire(key)
        held = self._held.get(key)
        if held is not None:
            self._held[key] = (held[0], held[1] + 1)
            return held[0]
        fmt = self.formats[key]
        packed = self.inner.acquire(key)
        try:
            values = self.cache.get(fmt.numel, fmt.dtype)
            dequantize_into(fmt, packed, values)
        finally:
            self.inner.release(key)
        self._held[key] = (values, 1)
        return values

    def serves_cache_buffer(self, key: Hashable) -> bool:
        """Whether ``key`` is served in a TensorCache buffer (dequantised), put back on release: a
        tensor may keep viewing it after ([Note: frozen units in backward] in partitioner.py)."""
        return key in self.formats

    def release(self, key: Hashable) -> None:
        if key not in self.formats:
            return self.inner.release(key)
        values, holds = self._held[key]
        if holds > 1:
            self._held[key] = (values, holds - 1)
            return
        del self._held[key]
        self.cache.put(values)

    def mark_dirty(self, key: Hashable) -> None:
        """The held values were changed: they are quantised again into the store."""
        if key not in self.formats:
            return self.inner.mark_dirty(key)
        values, _ = self._held[key]
        packed = self.inner.acquire(key)
        try:
            quantize_into(self.formats[key], values, packed, name=f"shard {key!r}")
            self.inner.mark_dirty(key)
        finally:
            self.inner.release(key)
