"""ResidentParams: the ParamOwner of parameters that stay whole in the module (stages 0-2).

GatheredParameters has nothing to gather here, but its promise still holds: a
change made on the modifier rank reaches every rank's copy (a broadcast per
parameter) and the optimizer's fp32 master of this rank's shard, which
stages 0-2 keep in every precision and from which every step rewrites the
parameters (see [Note: changes made under GatheredParameters reach the fp32
master] in masters.py). With a passthrough torch optimizer (stage 0) the
module's parameters are all there is: the broadcast is the whole job.

DeepSpeed's context does nothing below stage 3, so there a change made
under it is lost at the next step in bf16/fp16; here it is kept.

Threading: the training thread only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from infinity.zero.collectives import DataParallelGroup
from infinity.zero.gathered import PARAM_OWNERS
from infinity.zero.masters import MasterCopy, ShardSnapshot
from infinity.zero.unit import ParamUnit
from infinity.zero.units import UnitMap


@dataclasses.dataclass
class _ResidentHold:
    """One GatheredParameters context over resident parameters (a UserGather)."""

    owner: ResidentParams
    params: list[nn.Parameter]
    modifier_rank: int | None
    snapshots: list[ShardSnapshot]

    def release(self, *, commit: bool) -> None:
        if commit and self.modifier_rank is not None:
            self.owner.write_back(self.params, src=self.modifier_rank, snapshots=self.snapshots)


class ResidentParams:
    def __init__(
        self,
        params: Sequence[nn.Parameter],
        unit_map: UnitMap,
        group: DataParallelGroup,
        *,
        masters: MasterCopy | None,
    ):
        """``params``: every parameter of the model; ``unit_map``: their units as the optimizer shards
        them (empty with a passthrough optimizer); ``masters``: the fp32 masters (None: there are none)."""
        self.members = dict.fromkeys(params)  # what this owner answers for, in model order
        self.unit_of = unit_map.unit_of
        self.group = group
        self.masters = masters

    def install(self) -> None:
        PARAM_OWNERS.add(self)

    def remove(self) -> None:
        PARAM_OWNERS.discard(self)

    def __contains__(self, p: object) -> bool:
        return p in self.members

    def gather_for_user(
        self, params: Sequence[nn.Parameter], *, modifier_rank: int | None
    ) -> _ResidentHold:
        snapshots = []
        if modifier_rank is not None and self.masters is not None:
            units: list[ParamUnit] = []
            for p in params:
                unit = self.unit_of[p][0]
                if all(unit is not u for u in units):
                    units.append(unit)
            snapshots = [
                ShardSnapshot(u, self._own_slice(u)) for u in sorted(units, key=lambda u: u.index)
            ]
        return _ResidentHold(self, list(params), modifier_rank, snapshots)

    def write_back(
        self, params: Sequence[nn.Parameter], *, src: int, snapshots: Sequence[ShardSnapshot]
    ) -> None:
        """Rank ``src``'s values of ``params`` become every rank's; what changed reaches the masters."""
        for p in params:
            self.group.broadcast(p.data, src=src)
        for snap in snapshots:
            if self.masters is None:
                raise RuntimeError(
                    "shard snapshots were taken for resident parameters without fp32 masters"
                )
            snap.commit(self._own_slice(snap.unit), self.masters)

    def _own_slice(self, unit: ParamUnit) -> torch.Tensor:
        """This rank's shard of the unit as the optimizer lays it out (stage 0: the whole unit),
        assembled from the module's parameters."""
        layout = unit.layout
        rank = self.group.rank if layout.world_size > 1 else 0
        out = torch.zeros(layout.shard_numel, dtype=layout.dtype, device=unit.device)
        for seg in layout.segments(rank):
            n = seg.shard_hi - seg.shard_lo
            out[seg.shard_lo : seg.shard_hi] = unit.params[seg.slot].data.reshape(-1)[
                seg.slot_lo : seg.slot_lo + n
            ]
        return out
