"""load_pretrained: Hugging Face safetensors weights streamed into a partitioned model, a tensor at a time.

The model is never whole. Built under ``zero.Init`` and not yet given to
``initialize``, each parameter's slice is written from the file straight into
zero.Init's store, a store chunk at a time through its pool (every rank reads
only its own slice: no collective), in the model's dtype: the fp32 masters
``initialize`` makes start from the file's values. After ``initialize`` the
parameters of one module at a time are loaded inside
``GatheredParameters(..., modifier_rank=0)``, which carries them to every
rank's shard and to the optimizer's fp32 masters (see [Note: loading into an
engine's masters]). Parameters no one partitions, and buffers, are read in
place on every rank.

Names are those save_pretrained writes (infinity.weights.hf_layout.HfNames: renamings, the
base-model prefix, tied weights written once). What is missing or unexpected
is reported as ``nn.Module.load_state_dict`` reports it (the same NamedTuple;
``strict`` raises naming them); a tied parameter loaded under one of its names
is not missing under the others. Everything is checked (names, shapes, dtypes,
offsets against the file sizes, the index against the files) before the first
byte is written: a refused load leaves the model as it was.

Files are read by infinity.weights: the checkpoint's tensors and index checked
(``hf_layout.checkpoint_tensors``), then read with ``preadv`` into their
destination, never mapped ([Note: reading safetensors without mmap] in
infinity/weights/reader.py).

Threading: the training thread; every rank calls it with the same files.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Iterator, Mapping
from typing import Protocol, runtime_checkable

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from infinity.weights.hf_layout import HfNames, checkpoint_tensors
from infinity.weights.reader import FileTensor, TensorFiles
from infinity.zero.collectives import DataParallelGroup
from infinity.zero.gathered import PARAM_OWNERS, GatheredParameters, ModelHolder
from infinity.zero.init import InitStore
from infinity.zero.unit import ParamUnit


@runtime_checkable
class _UnitOwner(Protocol):
    """An engine's owner (Stage3Partitioner, ResidentParams): each parameter's unit and slot."""

    unit_of: Mapping[nn.Parameter, tuple[ParamUnit, int]]


def _true_shape(p: nn.Parameter) -> torch.Size:
    """A parameter's shape, also while its ``.data`` is a placeholder (zero.Init, stage 3)."""
    owner = PARAM_OWNERS.owner_of(p)
    if isinstance(owner, InitStore):
        return owner.shape(p)
    if isinstance(owner, _UnitOwner):
        unit, slot = owner.unit_of[p]
        return unit.layout.slots[slot].shape
    return p.shape


@dataclasses.dataclass
class _Plan:
    """What a load writes: each target (parameter or buffer) once, with the file tensor it takes."""

    params: list[tuple[nn.Parameter, FileTensor]]
    buffers: list[tuple[torch.Tensor, FileTensor]]
    missing: list[str]
    unexpected: list[str]


def _plan(module: nn.Module, tensors: dict[str, FileTensor], names: HfNames) -> _Plan:
    targets = module.state_dict(keep_vars=True)
    loaded: dict[str, FileTensor] = {}
    unexpected: list[str] = []
    mismatched: list[str] = []
    for file_name, t in tensors.items():
        name = names.model_name(file_name)
        if name is None:
            if not names.is_ignored_unexpected(file_name):
                unexpected.append(file_name)
            continue
        target = targets[name]
        shape = _true_shape(target) if isinstance(target, nn.Parameter) else target.shape
        if tuple(shape) != t.shape:
            mismatched.append(
                f"size mismatch for {name}: copying a param with shape {list(t.shape)} from "
                f"checkpoint ('{t.path.name}'), the shape in current model is {list(shape)}."
            )
        elif t.dtype.is_floating_point != target.dtype.is_floating_point:
            mismatched.append(
                f"dtype mismatch for {name}: the checkpoint ('{t.path.name}') holds {t.dtype}, "
                f"the model {target.dtype}."
            )
        loaded[name] = t
    if mismatched:
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(module).__name__}:\n\t"
            + "\n\t".join(mismatched)
            + "\nNothing was loaded: the checkpoint is of another model or configuration; build the "
            "model from the config saved with the weights"
        )
    params: list[tuple[nn.Parameter, FileTensor]] = []
    buffers: list[tuple[torch.Tensor, FileTensor]] = []
    done: set[int] = (
        set()
    )  # by id: a tied parameter is written once, under the first of its names in the file
    for name, target in targets.items():
        found = loaded.get(name)
        if found is None or id(target) in done:
            continue
        done.add(id(target))
        if isinstance(target, nn.Parameter):
            params.append((target, found))
        else:
            buffers.append((target, found))
    missing = [
        n
        for n, target in targets.items()
        if id(target) not in done and not names.is_ignored_missing(n)
    ]
    return _Plan(params, buffers, missing, unexpected)


def load_pretrained(
    model: nn.Module | ModelHolder, path: str | os.PathLike, *, strict: bool = True
) -> _IncompatibleKeys:
    """Loads a Hugging Face safetensors checkpoint (a directory save_pretrained wrote: ``model.safetensors``
    or its shards with ``model.safetensors.index.json``; or one .safetensors file) into ``model``: built
    under ``infinity.zero.Init`` and not yet initialized, an engine (or its ``module``), or a plain model.
    fp32 / bf16 / fp16 tensors are converted to the model's dtype. Returns ``(missing_keys,
    unexpected_keys)`` as ``load_state_dict`` does; ``strict`` raises naming them, before anything is
    written. Every rank must call it."""
    module = model.module if isinstance(model, ModelHolder) else model
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"load_pretrained needs an nn.Module or an engine, got {type(model).__name__}"
        )
    plan = _plan(module, checkpoint_tensors(path), HfNames.of(module))
    if strict and (plan.missing or plan.unexpected):
        lines = []
        if plan.missing:
            lines.append(
                "Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in plan.missing) + "."
            )
        if plan.unexpected:
            lines.append(
                "Unexpected key(s) in state_dict: "
                + ", ".join(f'"{k}"' for k in plan.unexpected)
                + "."
            )
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(module).__name__}:\n\t"
            + "\n\t".join(lines)
            + f"\nNothing was loaded from '{path}'; pass strict=False to load the tensors that match "
            "and get these lists back"
        )
    with TensorFiles() as files, torch.no_grad():
        _load_params(module, plan.params, files)
        for b, t in plan.buffers:
            files.read_whole(t, b)
    return _IncompatibleKeys(plan.missing, plan.unexpected)


def _load_params(
    module: nn.Module, params: list[tuple[nn.Parameter, FileTensor]], files: TensorFiles
) -> None:
    at_rest: list[tuple[nn.Parameter, FileTensor, InitStore]] = []
    gathered: list[tuple[nn.Parameter, FileTensor]] = []
    for p, t in params:
        owner = PARAM_OWNERS.owner_of(p)
        if isinstance(owner, InitStore):
            if owner.building:
                raise RuntimeError(
                    "load_pretrained was called inside infinity.zero.Init; call it after the context "
                    "(the model is complete then), before or after infinity.initialize"
                )
            at_rest.append((p, t, owner))
        else:
            gathered.append((p, t))
    for p, t, store in at_rest:
        store.fill(p, functools.partial(files.read, t), source=t)
    rank = DataParallelGroup().rank
    for group in _by_module(module, gathered):
        owned = [(p, t) for p, t in group if PARAM_OWNERS.owner_of(p) is not None]
        for p, t in group:
            if (
                PARAM_OWNERS.owner_of(p) is None
            ):  # whole on every rank and no one else's: read in place
                files.read_whole(t, p.data)
        if owned:
            _load_owned(owned, files, rank)


def _load_owned(
    group: list[tuple[nn.Parameter, FileTensor]], files: TensorFiles, rank: int
) -> None:
    """One module's parameters held by an engine: under GatheredParameters(modifier_rank=0), rank 0
    reading, in two passes (see [Note: loading into an engine's masters])."""
    params = [p for p, _ in group]
    new: list[torch.Tensor] = []
    if rank == 0:
        for p, t in group:
            value = torch.empty(t.shape, dtype=p.dtype)
            files.read(t, 0, t.numel, value)
            new.append(value)
    with GatheredParameters(params, modifier_rank=0):
        if rank == 0:
            for p, value in zip(params, new, strict=True):
                p.data.copy_(_neither(p.data, value.to(p.device)))
    with GatheredParameters(params, modifier_rank=0):
        if rank == 0:
            for p, value in zip(params, new, strict=True):
                p.data.copy_(value)


# [Note: loading into an engine's masters]
# After initialize a load goes through GatheredParameters(modifier_rank=0), and
# in 16-bit training (or at stages 0-2) the optimizer's fp32 master takes the
# change only where the parameter's bits changed (see [Note: changes made
# under GatheredParameters reach the fp32 master] in masters.py). An element
# whose loaded 16-bit value happens to equal the old one would keep its old
# fp32 master, a fraction of an ulp away from the loaded weight. So the load
# writes every element twice: first a value that differs from both the old and
# the new one (the new value with its lowest bit, or its second-lowest, flipped),
# then the new value. Every element changes in both passes, and every master
# ends as the loaded value in the training dtype, upcast. (Loaded before
# initialize, into zero.Init's store, the masters start from the file's own
# values in the model's dtype, fp32 included.)


def _neither(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Per element, a value whose bits differ from both ``old``'s and ``new``'s."""
    int_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[new.element_size()]
    o, n = old.reshape(new.shape).view(int_dtype), new.view(int_dtype)
    one = n ^ 1
    return torch.where(one != o, one, n ^ 2).view(new.dtype)


def _by_module(
    module: nn.Module, params: list[tuple[nn.Parameter, FileTensor]]
) -> Iterator[list[tuple[nn.Parameter, FileTensor]]]:
    """``params`` grouped by the first module that holds each, in module order (the same on every rank)."""
    pending = {id(p): (p, t) for p, t in params}
    for _, m in module.named_modules():
        group = [pending.pop(id(p)) for p in m.parameters(recurse=False) if id(p) in pending]
        if group:
            yield group
