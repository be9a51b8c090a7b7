"""What a checkpoint says about the model: its units, their parameters' names and shapes, its buffers.

The manifest lists every unit (a module's own parameters, flattened, see
infinity.zero.units) with its slots: name, shape, offset in the flat buffer,
and every ``state_dict`` name the parameter has (tied weights have several).
Loading compares this with the live engine's units before anything is read,
and export rebuilds full tensors from it without the model's code.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from infinity.engine.checkpoint.errors import CheckpointMismatchError
from infinity.engine.checkpoint.format import dtype_name, parse_dtype_name
from infinity.zero.unit import ParamUnit


@dataclasses.dataclass(frozen=True)
class SlotInfo:
    name: str
    shape: tuple[int, ...]
    offset: int
    aliases: tuple[str, ...]  # every state_dict name of the parameter, ``name`` first

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class UnitInfo:
    index: int
    name: str
    persistent: bool
    dtype: torch.dtype
    numel: int
    shard_numel: int
    slots: tuple[SlotInfo, ...]
    trainable: bool = True
    source: dict[str, Any] | None = None
    """A frozen unit's reference to the files holding its weights, None where its weights are saved
    ([Note: frozen units in a checkpoint] in sources.py)."""
    quant: dict[str, Any] | None = None
    """A frozen unit resting quantised: its QuantSpec's fields; its saved shard and CRC32C are of the
    packed bytes ([Note: a quantised base in a checkpoint] in quantised.py)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "persistent": self.persistent,
            "dtype": dtype_name(self.dtype),
            "numel": self.numel,
            "shard_numel": self.shard_numel,
            "trainable": self.trainable,
            "source": self.source,
            "quant": self.quant,
            "slots": [
                {
                    "name": s.name,
                    "shape": list(s.shape),
                    "offset": s.offset,
                    "aliases": list(s.aliases),
                }
                for s in self.slots
            ],
        }

    @property
    def saved_as(self) -> str:
        """The part files' tensor of this unit's weights: the fp32 master, or a frozen unit's shard."""
        return f"u{self.index}.master" if self.trainable else f"u{self.index}.param"

    @classmethod
    def from_json(cls, index: int, d: dict[str, Any]) -> UnitInfo:
        slots = tuple(
            SlotInfo(
                str(s["name"]),
                tuple(int(x) for x in s["shape"]),
                int(s["offset"]),
                tuple(str(a) for a in s.get("aliases") or [s["name"]]),
            )
            for s in d["slots"]
        )
        return cls(
            index,
            str(d["name"]),
            bool(d["persistent"]),
            parse_dtype_name(d["dtype"], f"unit {index}"),
            int(d["numel"]),
            int(d["shard_numel"]),
            slots,
            bool(d.get("trainable", True)),
            d.get("source"),
            d.get("quant"),
        )


def state_dict_names(module: nn.Module) -> tuple[dict[int, list[str]], dict[str, torch.Tensor]]:
    """(state_dict names of each parameter by id, the persistent buffers by name)."""
    names: dict[int, list[str]] = {}
    buffers: dict[str, torch.Tensor] = {}
    for name, value in module.state_dict(keep_vars=True).items():
        if isinstance(value, nn.Parameter):
            names.setdefault(id(value), []).append(name)
        elif isinstance(value, torch.Tensor):
            buffers[name] = value
    return names, buffers


def describe_units(
    module: nn.Module,
    units: Sequence[ParamUnit],
    sources: dict[int, dict[str, Any]] | None = None,
    quant: dict[int, dict[str, Any]] | None = None,
) -> list[UnitInfo]:
    """UnitInfo of every live ParamUnit; aliases from the module's state_dict; ``sources``: the references
    of the frozen units saved as one; ``quant``: the formats of the frozen units resting quantised."""
    names, _ = state_dict_names(module)
    out = []
    for u in units:
        slots = []
        for p, s in zip(u.params, u.layout.slots, strict=True):
            aliases = [s.name] + [n for n in names.get(id(p), []) if n != s.name]
            slots.append(SlotInfo(s.name, tuple(s.shape), s.offset, tuple(aliases)))
        out.append(
            UnitInfo(
                u.index,
                u.module_name,
                u.persistent,
                u.layout.dtype,
                u.layout.numel,
                u.layout.shard_numel,
                tuple(slots),
                u.trainable,
                (sources or {}).get(u.index),
                (quant or {}).get(u.index),
            )
        )
    return out


def check_units_match(
    saved: list[UnitInfo], live: list[UnitInfo], *, saved_threshold: Any, live_threshold: Any
) -> None:
    """Raises CheckpointMismatchError naming the first parameter that differs."""
    saved_params = {s.name: (u, s) for u in saved for s in u.slots}
    live_params = {s.name: (u, s) for u in live for s in u.slots}
    for name, (_u, s) in live_params.items():
        if name not in saved_params:
            raise CheckpointMismatchError(
                f"parameter {name!r} (shape {list(s.shape)}) of this model is not in the checkpoint: it was "
                "saved from a different model; load a checkpoint of this model"
            )
        su, ss = saved_params[name]
        if ss.shape != s.shape:
            raise CheckpointMismatchError(
                f"parameter {name!r} has shape {list(ss.shape)} in the checkpoint but {list(s.shape)} in this "
                "model: the checkpoint is of a different model (or configuration); load a matching checkpoint"
            )
    for name, (_u, s) in saved_params.items():
        if name not in live_params:
            raise CheckpointMismatchError(
                f"the checkpoint has parameter {name!r} (shape {list(s.shape)}), which this model lacks: it was "
                "saved from a different model; load a checkpoint of this model"
            )
    for u in live:
        if (
            u.index < len(saved)
            and saved[u.index].name == u.name
            and saved[u.index].trainable != u.trainable
        ):
            how = {True: "trains", False: "is frozen (requires_grad=False)"}
            raise CheckpointMismatchError(
                f"unit {u.name!r} {how[saved[u.index].trainable]} in the checkpoint but {how[u.trainable]} in this "
                "engine; set requires_grad on the same parameters as the saved run before initialize"
            )
    if len(saved) != len(live) or any(
        a.name != b.name or [s.name for s in a.slots] != [s.name for s in b.slots]
        for a, b in zip(saved, live, strict=True)
    ):
        raise CheckpointMismatchError(
            "the checkpoint groups the same parameters into different units than this engine does "
            f"(stage3_param_persistence_threshold: saved {saved_threshold}, now {live_threshold}); load it with "
            "the same zero_optimization.stage and stage3_param_persistence_threshold it was saved with"
        )


def check_buffers_match(
    saved: dict[str, tuple[torch.dtype, tuple[int, ...]]], live: dict[str, torch.Tensor]
) -> None:
    for name, t in live.items():
        if name not in saved:
            raise CheckpointMismatchError(
                f"buffer {name!r} of this model is not in the checkpoint: it was saved from a different model"
            )
        if tuple(saved[name][1]) != tuple(t.shape):
            raise CheckpointMismatchError(
                f"buffer {name!r} has shape {list(saved[name][1])} in the checkpoint but {list(t.shape)} in this "
                "model: the checkpoint is of a different model"
            )
    extra = sorted(set(saved) - set(live))
    if extra:
        raise CheckpointMismatchError(
            f"the checkpoint has buffer {extra[0]!r}, which this model lacks: it was saved from a different model"
        )
