"""GradHooks: hands each parameter's grad to the GradReducer as autograd produces it (stages 2, 3).

A grad is taken in the parameter's post-accumulate hook (``p.grad`` is then
dropped, so no full-model gradient accumulates); when a unit's last grad of
this backward has arrived the unit is reduced, and ``on_unit_done`` runs (the
stage-3 partitioner releases the unit there). A callback queued on the
autograd engine finishes what is left at the end of backward: units with
parameters that got no grad, in unit order (every rank reduces in the same
order).

[Note: grads of released parameters]
AccumulateGrad lays the grad out like the parameter's *current* data; a
released stage-3 parameter's data is an empty placeholder, which would fail.
A grad pre-hook therefore points a released parameter at a zero-stride NaN
tensor of the right shape (so the grad is stolen, not copied), and the
post-accumulate hook restores the placeholder.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from infinity.zero.grads import GradReducer
from infinity.zero.unit import ParamUnit, UnitState
from infinity.zero.units import UnitMap


class GradHooks:
    def __init__(
        self,
        unit_map: UnitMap,
        reducer: GradReducer,
        *,
        partitioned: bool,
        on_unit_done: Callable[[ParamUnit], None] | None = None,
    ):
        """``on_unit_done(unit)``: the unit's grads of this backward are reduced (the stage-3
        partitioner lets go of the unit there)."""
        self.unit_map = unit_map
        self.reducer = reducer
        self.partitioned = partitioned
        self.on_unit_done = on_unit_done
        self._handles: list[Any] = []
        self._queued = False

    def install(self) -> None:
        for p, (unit, slot) in self.unit_map.unit_of.items():
            if p.requires_grad:
                self._handles.append(p.register_hook(self._prehook(unit, slot)))
                self._handles.append(p.register_post_accumulate_grad_hook(self._hook(unit, slot)))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _queue_end_of_backward(self) -> None:
        """Idempotent within one backward; must be called while backward runs."""
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _prehook(self, unit: ParamUnit, slot: int):
        def prehook(grad: torch.Tensor) -> None:
            self._queue_end_of_backward()
            if self.partitioned and unit.state is UnitState.RELEASED:
                unit.params[slot].data = unit.shape_placeholder(slot)

        return prehook

    def _hook(self, unit: ParamUnit, slot: int):
        def hook(p: nn.Parameter) -> None:
            grad = p.grad
            p.grad = None
            if self.partitioned and unit.state is UnitState.RELEASED:
                p.data = unit.placeholder
            if grad is None:
                return
            self.reducer.add(unit, slot, grad)
            unit.grads_arrived += 1
            if unit.grads_arrived == unit.grad_params:
                self.reducer.finish(unit)
                if self.on_unit_done is not None:
                    self.on_unit_done(unit)

        return hook

    def _end_of_backward(self) -> None:
        self._queued = False
        self.reducer.finish_all()
        for unit in self.unit_map.units:
            unit.grads_arrived = 0

    def abort_backward(self) -> bool:
        """After a backward that raised: autograd drops the callbacks queued for its end, so the
        next backward would queue none. Settles what it left instead: the reducer keeps what reached
        the gradient (GradReducer.abort_micro), counts start afresh, and released parameters a
        grad pre-hook had pointed at its NaN stand-in get their placeholder back. Returns whether
        part of the backward's gradient had to be dropped (see abort_micro)."""
        self._queued = False
        dropped = self.reducer.abort_micro()
        for unit in self.unit_map.units:
            unit.grads_arrived = 0
            if self.partitioned and unit.state is UnitState.RELEASED:
                for p in unit.params:
                    p.data = unit.placeholder
        return dropped
