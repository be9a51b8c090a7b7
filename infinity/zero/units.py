"""Cutting a module tree into ParamUnits.

Each module's own (direct) parameters form its unit, split by dtype, and —
for stage 3 — into a partitioned unit and a persistent one (parameters with
fewer than ``persistence_threshold`` elements, which stay resident as
DeepSpeed's stage3_param_persistence_threshold says), and into trainable and
frozen parameters (``requires_grad`` as it is when the units are cut), so a
unit either trains whole or not at all: only trainable units get optimizer
state (see [Note: frozen units] in infinity/estimate/runtime_plan.py). A parameter shared by
several modules (tied weights) belongs to the first module that lists it;
the others *use* its unit, so their forward fetches it too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
from torch import nn

from infinity.zero.layout import make_layout
from infinity.zero.unit import ParamUnit


@dataclasses.dataclass
class UnitMap:
    units: list[ParamUnit]
    uses: dict[nn.Module, list[ParamUnit]]  # units a module's forward needs (own and shared)
    unit_of: dict[nn.Parameter, tuple[ParamUnit, int]]  # parameter -> (unit, slot)

    def param_names(self) -> dict[nn.Parameter, str]:
        return {p: u.names[i] for u in self.units for i, p in enumerate(u.params)}


def build_units(
    module: nn.Module,
    *,
    world_size: int,
    persistence_threshold: int,
    device: torch.device,
    dtype: torch.dtype | None = None,
    shape_of: Callable[[nn.Parameter], torch.Size] | None = None,
) -> UnitMap:
    """``dtype``: the precision floating-point parameters train in (default: their own).
    ``shape_of``: a parameter's true shape (zero.Init leaves placeholders in ``.data``)."""
    shape_of = shape_of or (lambda p: p.shape)
    units: list[ParamUnit] = []
    unit_of: dict[nn.Parameter, tuple[ParamUnit, int]] = {}
    uses: dict[nn.Module, list[ParamUnit]] = {}
    for mod_name, mod in module.named_modules():
        new: list[tuple[str, nn.Parameter]] = []
        own = list(mod.named_parameters(recurse=False, remove_duplicate=False))
        for pname, p in own:
            if p not in unit_of and all(p is not q for _, q in new):
                new.append((f"{mod_name}.{pname}" if mod_name else pname, p))
        groups: dict[tuple[torch.dtype, bool, bool], list[tuple[str, nn.Parameter]]] = {}
        for name, p in new:
            pdt = dtype if dtype is not None and p.is_floating_point() else p.dtype
            numel = math.prod(shape_of(p))
            groups.setdefault((pdt, numel < persistence_threshold, p.requires_grad), []).append(
                (name, p)
            )
        for (unit_dtype, small, trains), members in groups.items():
            names = [n for n, _ in members]
            params = [p for _, p in members]
            layout = make_layout(names, [shape_of(p) for p in params], unit_dtype, world_size)
            label = mod_name or "<root>"
            if len(groups) > 1:
                label += (
                    f"[{str(unit_dtype).removeprefix('torch.')}{', persistent' if small else ''}"
                    f"{'' if trains else ', frozen'}]"
                )
            unit = ParamUnit(
                len(units), label, params, names, layout, persistent=small, device=device
            )
            units.append(unit)
            for i, p in enumerate(params):
                unit_of[p] = (unit, i)
        used: list[ParamUnit] = []
        for _, p in own:
            u = unit_of[p][0]
            if all(u is not v for v in used):
                used.append(u)
        if used:
            uses[mod] = used
    return UnitMap(units, uses, unit_of)
