"""How a change made under GatheredParameters(modifier_rank=...) reaches the fp32 master copy.

[Note: changes made under GatheredParameters reach the fp32 master]
In bf16/fp16 training (and at stages 0-2 in any precision) the optimizer
keeps an fp32 master of each unit's shard apart from the parameters the
module computes with, and every step writes the parameters from it. A value
changed in the parameters alone would be overwritten by the next step, so
the owner of the parameters (Stage3Partitioner, ResidentParams) hands the
change on: when the gather starts it keeps this rank's slice of the unit as
the master shard lays it out (``ShardSnapshot``); at the end, once the
modifier rank's values have been broadcast, the elements whose bits differ
from that copy are the change, and the master takes their new values
(upcast, so the master and the 16-bit parameter agree exactly). Elements the
change left alone keep their fp32 master bits, so they train on as if
nothing had happened. Adam's moments and the accumulated gradient are left
as they are, as DeepSpeed leaves them.

Where the parameter shard is its own master (fp32 stage 3) there is nothing
to hand on: writing the shard is writing the master.

Threading: the training thread. A stage-3 optimizer step may still be running
behind the forward when the context ends; the engine's MasterCopy waits for it
first (GatedMasters in engine/overlap.py).
"""

from __future__ import annotations

from typing import Protocol

import torch

from infinity.zero.unit import ParamUnit

_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class MasterCopy(Protocol):
    """Where the fp32 master of each unit's shard lives (the optimizer's state)."""

    def overwrite_master(self, index: int, values: torch.Tensor, changed: torch.Tensor) -> None:
        """Unit ``index``'s master takes ``values`` (fp32, one per shard element) where ``changed``
        (both may be on the compute device)."""
        ...


class ShardSnapshot:
    """One unit's slice of this rank's master shard as it was when a GatheredParameters context began."""

    def __init__(self, unit: ParamUnit, before: torch.Tensor):
        """``before``: a copy of the slice, which the snapshot keeps."""
        self.unit = unit
        self.before = before

    def commit(self, after: torch.Tensor, masters: MasterCopy) -> None:
        """``after``: the same slice now, on every rank the modifier rank's values."""
        int_dtype = _SAME_WIDTH_INT[after.element_size()]
        changed = after.view(int_dtype) != self.before.view(
            int_dtype
        )  # bits: NaN and -0.0 count too
        if bool(changed.any()):
            masters.overwrite_master(self.unit.index, after.to(torch.float32), changed)
