"""Where each parameter of a unit lives in its flat buffer, and which part of it each rank owns.

A unit's parameters are laid end to end in one flat buffer; the buffer is
padded so it splits into ``world_size`` equal shards whose size in bytes is a
multiple of 4 KiB (O_DIRECT alignment on disk, page alignment in the pools).
Rank r owns flat elements [r * shard_numel, (r + 1) * shard_numel).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from infinity.aio import DIRECT_ALIGNMENT


@dataclasses.dataclass(frozen=True)
class SlotLayout:
    """One parameter inside a unit's flat buffer."""

    name: str
    shape: torch.Size
    numel: int
    offset: int  # first flat element


@dataclasses.dataclass(frozen=True)
class Segment:
    """The part of one slot that falls inside one rank's shard."""

    slot: int  # index into UnitLayout.slots
    shard_lo: int  # element range inside the shard
    shard_hi: int
    slot_lo: int  # matching first element inside the parameter (flattened)


@dataclasses.dataclass(frozen=True)
class UnitLayout:
    slots: tuple[SlotLayout, ...]
    dtype: torch.dtype
    world_size: int
    numel: int  # sum of the slots' numels
    shard_numel: int  # per rank, padded

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def shard_nbytes(self) -> int:
        return self.shard_numel * self.itemsize

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def segments(self, rank: int) -> list[Segment]:
        """The slots (or parts of slots) that rank ``rank``'s shard holds, in flat order."""
        lo, hi = self.shard_range(rank)
        out = []
        for i, s in enumerate(self.slots):
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a < b:
                out.append(Segment(i, a - lo, b - lo, a - s.offset))
        return out


def make_layout(
    names: list[str], shapes: list[torch.Size], dtype: torch.dtype, world_size: int
) -> UnitLayout:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    slots = []
    offset = 0
    for name, shape in zip(names, shapes, strict=True):
        n = math.prod(shape)
        slots.append(SlotLayout(name, torch.Size(shape), n, offset))
        offset += n
    itemsize = torch.empty((), dtype=dtype).element_size()
    align = max(1, DIRECT_ALIGNMENT // itemsize)
    shard = max(align, -(-offset // world_size))
    shard = -(-shard // align) * align
    return UnitLayout(tuple(slots), dtype, world_size, offset, shard)
