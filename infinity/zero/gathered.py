"""GatheredParameters: DeepSpeed's context for reading (or changing) partitioned parameters whole.

Inside the context the units holding the given parameters are gathered, so
``p`` has its full shape and values on every rank. With ``modifier_rank``
set, that rank's values at exit are broadcast and written back to every
rank's shard (and to the fp32 master copy). Under stages 0-2 parameters are
already whole and the context does nothing. Every rank must enter it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

# Installed partitioners, by parameter (set by Stage3Partitioner.install).
_partitioner_of: WeakIdKeyDictionary = WeakIdKeyDictionary()


def register_partitioner(params: Iterable[nn.Parameter], partitioner: Any) -> None:
    for p in params:
        _partitioner_of[p] = partitioner


def unregister_partitioner(params: Iterable[nn.Parameter]) -> None:
    for p in params:
        _partitioner_of.pop(p, None)


class GatheredParameters:
    def __init__(self, params: Any, modifier_rank: int | None = None, enabled: bool = True):
        if isinstance(params, nn.Parameter):
            params = [params]
        elif isinstance(params, nn.Module):
            params = list(params.parameters())
        elif hasattr(params, "module") and isinstance(params.module, nn.Module):  # an Engine
            params = list(params.module.parameters())
        self.params = [p for p in params if p is not None]
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._held: list[tuple[Any, list[Any]]] = []

    def __enter__(self) -> GatheredParameters:
        if not self.enabled:
            return self
        by_partitioner: dict[int, tuple[Any, list[Any]]] = {}
        for p in self.params:
            part = _partitioner_of.get(p)
            if part is None:
                continue
            unit = part.unit_of[p][0]
            entry = by_partitioner.setdefault(id(part), (part, []))
            if all(unit is not u for u in entry[1]):
                entry[1].append(unit)
        for part, units in by_partitioner.values():
            units.sort(key=lambda u: u.index)  # the same order on every rank
            part.hold_for_user(units)
            self._held.append((part, units))
        return self

    def __exit__(self, *exc: object) -> None:
        held, self._held = self._held, []
        for part, units in held:
            if self.modifier_rank is not None and exc[0] is None:
                with torch.no_grad():
                    part.write_back(units, src=self.modifier_rank)
            part.unhold_for_user(units)
