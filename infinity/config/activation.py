"""The ``activation_checkpointing`` section: where DeepSpeed-style checkpoints keep their inputs.

Read by ``infinity.checkpointing`` (infinity/zero/checkpointing.py,
[Note: checkpoint inputs]): an engine built from a config that has this
section keeps it as its own (``engine.activation_checkpointing``, [Note: whose
checkpoint settings]), and ``infinity.checkpointing.configure(
deepspeed_config=...)`` sets the process-wide settings from any config. Defaults and key names are
DeepSpeed's (``deepspeed/runtime/activation_checkpointing/config.py``).
Which keys have no effect, and why, is in infinity.config.support.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from infinity.config.values import check_section, knob


@dataclasses.dataclass(frozen=True)
class ActivationCheckpointingConfig:
    """``activation_checkpointing``: DeepSpeed's checkpointing.checkpoint settings."""

    PATH: ClassVar[str] = "activation_checkpointing"

    partition_activations: bool = knob(False)
    """Split each checkpoint's inputs across the model-parallel group (configure(mpu_=...))."""
    cpu_checkpointing: bool = knob(False)
    """Keep each checkpoint's inputs in (pinned) host memory until the recomputation."""
    contiguous_memory_optimization: bool = knob(False)
    """DeepSpeed: copy partitioned checkpoints into preallocated contiguous buffers."""
    number_checkpoints: int | None = knob(None, ge=1)
    """DeepSpeed: checkpoints per forward, to size those buffers."""
    synchronize_checkpoint_boundary: bool = knob(False)
    """DeepSpeed: synchronize the device at each checkpoint's start and end."""
    profile: bool = knob(False)
    """DeepSpeed: log each checkpoint's forward and backward time."""

    def __post_init__(self) -> None:
        check_section(self)
