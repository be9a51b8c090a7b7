"""What checkpointing reads and writes of an engine: the CheckpointTarget protocol and its TrainingParts.

[Note: the checkpoint's view of an engine]
save_checkpoint, load_checkpoint and save_16bit_model take any object with
the CheckpointTarget surface and use nothing else of it:
- public attributes that DeepSpeed's engine has too (module, optimizer,
  lr_scheduler, loss_scaler, the step counters, ...); a load writes the
  counters back and restores the scheduler and loss scaler through their
  ``load_state_dict``;
- ``synchronize()``: waits for an optimizer step still running;
- ``checkpoint_parts()``: a frozen TrainingParts naming the runtime pieces a
  checkpoint moves (units, stores, the partitioned optimizer, the stage-3
  partitioner and prefetch trace). The engine builds it by keyword from
  wherever it keeps them, so nothing here depends on that.

Threading: the target is used by the thread that called save or load.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from infinity.config import InfinityConfig
    from infinity.engine.checkpoint.sources import UnitSource
    from infinity.store import TieredStore
    from infinity.weights.quant import ShardFormat
    from infinity.zero.collectives import DataParallelGroup
    from infinity.zero.unit import ParamUnit


class HasState(Protocol):
    """A loss scaler or lr scheduler: saved by ``state_dict()``, restored by ``load_state_dict``."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ShardOptimizer(Protocol):
    """The partitioned Adam: hyperparameters per param group, a step count per parameter, and a hook
    that derives a unit's parameters from its updated master (stages 0-2)."""

    param_groups: list[dict[str, Any]]
    param_steps: list[int]
    on_updated: Callable[[int, torch.Tensor], None] | None


class Partitioner(Protocol):
    """Stage 3: which units are gathered now; persistent units let go of and gathered again."""

    def gathered_units(self) -> Sequence[Any]: ...

    def release_persistent(self) -> None: ...

    def gather_persistent(self) -> None: ...


class PrefetchTrace(Protocol):
    """Stage 3's prefetch scheduler: a step left open by a forward without backward, or the gap before
    the next step, holds read-ahead (abort_step gives it back)."""

    @property
    def step_open(self) -> bool: ...

    def abort_step(self) -> object: ...


@dataclasses.dataclass(frozen=True)
class TrainingParts:
    """The runtime pieces a checkpoint moves, as the engine has them now."""

    units: Sequence[ParamUnit]
    """Every unit (a module's own parameters, flattened and sharded), in order; empty with ``passthrough``."""
    params: Sequence[nn.Parameter]
    """Every trained parameter, in the optimizer's order."""
    param_store: TieredStore | None
    """Stage 3: this rank's parameter shards, under ``unit.key`` (the fp32 master too when training in fp32)."""
    state_store: TieredStore | None
    """The optimizer's fp32 shards: ``(unit.index, "master" | "m" | "v")``."""
    optimizer: ShardOptimizer | None
    """The partitioned Adam; None with ``passthrough``."""
    passthrough: torch.optim.Optimizer | None
    """Stage 0 without offload: the user's torch optimizer, stepping whole parameters."""
    partitioner: Partitioner | None
    """Stage 3's partitioner, else None."""
    trace: PrefetchTrace | None
    """Stage 3's prefetch scheduler, else None."""
    sources: Mapping[int, UnitSource] = dataclasses.field(default_factory=dict)
    """Frozen units whose weights are a pretrained file's, by unit index ([Note: frozen units in a
    checkpoint] in sources.py)."""
    formats: Mapping[int, ShardFormat] = dataclasses.field(default_factory=dict)
    """Frozen units resting quantised (stage 3): this rank's shard format, by unit index ([Note: a
    quantised base in a checkpoint] in quantised.py)."""


class CheckpointTarget(Protocol):
    """Everything checkpointing reads and writes of an engine (see [Note: the checkpoint's view of an engine])."""

    # Read only (properties, so that an engine's narrower types match): checkpointing never sets these.
    @property
    def module(self) -> nn.Module: ...

    @property
    def config(self) -> InfinityConfig: ...

    @property
    def group(self) -> DataParallelGroup: ...

    @property
    def stage(self) -> int: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def gradient_accumulation_steps(self) -> int: ...

    @property
    def optimizer(self) -> Any:
        """What the user steps and schedulers change: ``param_groups`` with lr, betas, eps,
        weight_decay."""

    @property
    def lr_scheduler(self) -> HasState | None: ...

    @property
    def loss_scaler(self) -> HasState: ...

    # Written back by a load.
    global_steps: int
    micro_steps: int
    skipped_steps: int

    def synchronize(self) -> None: ...

    def checkpoint_parts(self) -> TrainingParts: ...
