"""ParamUnit: the unit of fetch — one module's own parameters of one dtype, flattened and sharded.

Invariants:
- RELEASED: only this rank's shard exists (at rest in its home tier); every
  parameter's ``.data`` is an empty placeholder of its dtype and device.
- GATHERED: ``full`` holds the whole flat buffer on the compute device and
  each parameter's ``.data`` is a view of its slot in it.
A persistent unit (parameters below stage3_param_persistence_threshold) is
gathered once and stays so.

Threading: a unit is touched by the forward thread and autograd's backward
thread, never at the same time (backward starts after forward returns).
"""

from __future__ import annotations

import enum

import torch
from torch import nn

from infinity.zero.layout import UnitLayout


class UnitState(enum.Enum):
    RELEASED = "released"
    """Only this rank's shard exists, at rest; the parameters are empty placeholders."""
    GATHERED = "gathered"
    """The full flat parameters are materialised on the compute device; the parameters view them."""


class ParamUnit:
    """One record per unit: its parameters, layout, state and holds."""

    def __init__(
        self,
        index: int,
        module_name: str,
        params: list[nn.Parameter],
        names: list[str],
        layout: UnitLayout,
        *,
        persistent: bool,
        device: torch.device,
    ):
        self.index = index
        self.module_name = module_name
        self.params = params
        self.names = names
        self.layout = layout
        self.persistent = persistent
        self.device = device
        self.key = f"p{index}"  # this rank's shard in the parameter store
        self.state = UnitState.RELEASED
        self.full: torch.Tensor | None = None
        self.holds = 0  # forward frames and the backward pass holding the gathered buffer
        self.backward_held = False
        self.grads_arrived = 0  # parameters whose grad was reduced in the current backward
        self.grad_params = sum(1 for p in params if p.requires_grad)
        # Every parameter's ``.data`` while the unit is released (one shared empty tensor).
        self.placeholder = torch.empty(0, dtype=layout.dtype, device=device)

    @property
    def trainable(self) -> bool:
        """Whether the unit's parameters train (build_units never mixes trainable and frozen ones)."""
        return self.grad_params > 0

    @property
    def full_nbytes(self) -> int:
        return self.layout.padded_numel * self.layout.itemsize

    def slot_views(self, full: torch.Tensor) -> list[torch.Tensor]:
        return [full[s.offset : s.offset + s.numel].view(s.shape) for s in self.layout.slots]

    def to_gathered(self, full: torch.Tensor) -> None:
        if self.state is not UnitState.RELEASED:
            raise RuntimeError(
                f"unit {self.module_name!r} gathered twice (state {self.state.name})"
            )
        if full.numel() < self.layout.numel or full.dtype != self.layout.dtype:
            raise RuntimeError(
                f"unit {self.module_name!r}: buffer of {full.numel()} {full.dtype} cannot hold "
                f"{self.layout.numel} {self.layout.dtype}"
            )
        for p, v in zip(self.params, self.slot_views(full), strict=True):
            p.data = v
        self.full = full
        self.state = UnitState.GATHERED

    def gathered(self) -> torch.Tensor:
        """The gathered buffer the parameters view; the unit must be GATHERED."""
        if self.state is not UnitState.GATHERED or self.full is None:
            raise RuntimeError(
                f"unit {self.module_name!r} used as gathered while {self.state.name}"
            )
        return self.full

    def to_released(self) -> torch.Tensor:
        """Points the parameters back at the placeholder; returns the buffer they viewed."""
        if self.state is not UnitState.GATHERED or self.full is None:
            raise RuntimeError(f"unit {self.module_name!r} released while {self.state.name}")
        for p in self.params:
            p.data = self.placeholder
        full, self.full = self.full, None
        self.state = UnitState.RELEASED
        return full

    def shape_placeholder(self, slot: int) -> torch.Tensor:
        """A zero-stride NaN tensor of the slot's shape: gives AccumulateGrad the parameter's
        layout while the unit is released (see [Note: grads of released parameters])."""
        shape = self.layout.slots[slot].shape
        one = torch.full(
            (1,) * len(shape), float("nan"), dtype=self.layout.dtype, device=self.device
        )
        return one.expand(shape)

    def __repr__(self) -> str:
        return (
            f"ParamUnit({self.module_name!r}, numel={self.layout.numel}, shard={self.layout.shard_numel}, "
            f"{'persistent, ' if self.persistent else ''}{self.state.name}, holds={self.holds})"
        )
