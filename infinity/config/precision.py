"""The ``fp16`` and ``bf16`` sections: 16-bit training and fp16's dynamic loss scaling.

``bfloat16`` is DeepSpeed's old name of the ``bf16`` section and is accepted
as an alias (the parser merges them). Defaults are DeepSpeed's code defaults
(``deepspeed/runtime/precision_config.py``).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from infinity.config.values import check_section, knob


@dataclasses.dataclass(frozen=True)
class FP16Config:
    """``fp16``: fp16 compute with fp32 master weights and (by default) dynamic loss scaling."""

    PATH: ClassVar[str] = "fp16"

    enabled: bool = knob(False)
    """Train in fp16."""
    auto_cast: bool = knob(False)
    """Cast floating-point inputs of the model to fp16."""
    loss_scale: float = knob(0.0, ge=0.0)
    """Static loss scale; 0 selects dynamic loss scaling."""
    initial_scale_power: int = knob(16, ge=0, le=127)
    """Dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: int = knob(1000, ge=1)
    """Steps without overflow before the scale is doubled."""
    hysteresis: int = knob(2, ge=1)
    """Overflows tolerated before the scale is halved."""
    consecutive_hysteresis: bool = knob(False)
    """Refill the hysteresis after every step without overflow."""
    min_loss_scale: float = knob(1.0, gt=0.0)
    """The dynamic scale never drops below this (DeepSpeed types it int; 1e-4 style values are accepted)."""
    fp16_master_weights_and_grads: bool = knob(False)
    """DeepSpeed: keep master weights in fp16 (stages 1-3 only)."""
    fused_mode: bool = knob(True)
    """DeepSpeed (legacy): fused fp16 optimizer."""

    def __post_init__(self) -> None:
        check_section(self)

    def initial_dynamic_scale(self) -> float:
        """The scale dynamic loss scaling starts from."""
        return float(2**self.initial_scale_power)


@dataclasses.dataclass(frozen=True)
class BF16Config:
    """``bf16`` (alias ``bfloat16``): bf16 compute with fp32 master weights."""

    PATH: ClassVar[str] = "bf16"

    enabled: bool = knob(False)
    """Train in bf16."""
    immediate_grad_update: bool = knob(False)
    """DeepSpeed: apply gradient updates immediately (code default false; its constants say true)."""
    check_grad_overflow: bool = knob(False)
    """DeepSpeed: check bf16 gradients for overflow."""
    bf16_master_weights_and_grads: bool = knob(False)
    """DeepSpeed: keep master weights and gradients in bf16 (stages 1-3 only)."""
    bf16_optimizer_states: bool = knob(False)
    """DeepSpeed: keep optimizer states in bf16 (needs bf16_master_weights_and_grads)."""

    def __post_init__(self) -> None:
        check_section(self)
