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

Names are those save_pretrained writes (hf_layout.HfNames: renamings, the
base-model prefix, tied weights written once). What is missing or unexpected
is reported as ``nn.Module.load_state_dict`` reports it (the same NamedTuple;
``strict`` raises naming them); a tied parameter loaded under one of its names
is not missing under the others. Everything is checked (names, shapes, dtypes,
offsets against the file sizes, the index against the files) before the first
byte is written: a refused load leaves the model as it was.

[Note: reading safetensors without mmap]
``safetensors.safe_open`` maps the whole file, and every page a tensor read
touches stays in the process's resident set until the file is closed: loading
a model that way makes the peak RSS the file's size, which is what this
function exists to avoid. So the header (8 bytes of length, then JSON) is
parsed here and tensors are read with ``preadv`` into their destination (or,
when the dtype changes, through one small staging buffer): the page cache
holds the file, not the process.

Threading: the training thread; every rank calls it with the same files.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from infinity.zero.collectives import DataParallelGroup
from infinity.zero.gathered import PARAM_OWNERS, GatheredParameters, ModelHolder
from infinity.zero.hf_layout import HfNames, checkpoint_files
from infinity.zero.init import InitStore
from infinity.zero.unit import ParamUnit

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER_NBYTES = 100 << 20  # the safetensors package's own limit
_STAGE_NBYTES = 8 << 20  # converting reads go through this much at a time


@dataclasses.dataclass(frozen=True)
class FileTensor:
    """One tensor of a safetensors file: where its bytes are."""

    path: Path
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_header(path: Path) -> dict[str, FileTensor]:
    """The tensors of a safetensors file, every offset checked against the file's size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"'{path}' is not a safetensors file: {size} bytes, shorter than its header length")
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER_NBYTES, size - 8):
            raise ValueError(f"'{path}' is not a safetensors file (or is truncated): its header claims {n} bytes "
                             f"of a {size}-byte file")
        try:
            doc = json.loads(f.read(n))
        except ValueError as e:
            raise ValueError(f"'{path}' has a corrupt safetensors header: {e}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"'{path}' has a corrupt safetensors header: not a JSON object")
    data_start = 8 + n
    out = {}
    for name, d in doc.items():
        if name == "__metadata__":
            continue
        try:
            code, shape, (lo, hi) = d["dtype"], tuple(int(x) for x in d["shape"]), d["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"'{path}': the header entry of tensor {name!r} is malformed: {d!r}") from None
        if code not in _DTYPES:
            raise ValueError(f"'{path}': tensor {name!r} has dtype {code}, which is not read here (one of "
                             f"{', '.join(_DTYPES)}); convert the checkpoint to one of them")
        t = FileTensor(path, name, _DTYPES[code], shape, data_start + lo, hi - lo)
        if not 0 <= lo <= hi or data_start + hi > size or t.nbytes != t.numel * t.dtype.itemsize:
            raise ValueError(f"'{path}' is truncated or corrupt: tensor {name!r} ({code} {list(shape)}) lies at "
                             f"bytes {lo}..{hi} after the header, in a file of {size} bytes")
        out[name] = t
    return out


class TensorFiles:
    """The open files of a checkpoint; reads a tensor's elements, converted, into a given tensor."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}
        self._stage = torch.empty(0, dtype=torch.uint8)

    def read(self, t: FileTensor, lo: int, hi: int, out: torch.Tensor) -> None:
        """Elements [lo, hi) of ``t``, flat, into ``out`` (contiguous, ``hi - lo`` elements, any dtype)."""
        if out.dtype == t.dtype:
            self._pread(t, lo, out)
            return
        step = max(1, _STAGE_NBYTES // t.dtype.itemsize)
        flat = out.view(-1)
        for a in range(lo, hi, step):
            b = min(hi, a + step)
            nbytes = (b - a) * t.dtype.itemsize
            if self._stage.numel() < nbytes:
                self._stage = torch.empty(max(nbytes, min(_STAGE_NBYTES, t.nbytes)), dtype=torch.uint8)
            stage = self._stage[:nbytes].view(t.dtype)
            self._pread(t, a, stage)
            flat[a - lo : b - lo].copy_(stage)

    def _pread(self, t: FileTensor, lo: int, out: torch.Tensor) -> None:
        fd = self._fds.get(t.path)
        if fd is None:
            fd = self._fds[t.path] = os.open(t.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        view = memoryview(out.view(-1).view(torch.uint8).numpy())
        offset, done = t.offset + lo * t.dtype.itemsize, 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:
                raise OSError(f"'{t.path}' ended at byte {offset + done} while reading tensor {t.name!r}: the file "
                              "changed or was truncated while loading")
            done += n

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


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
            mismatched.append(f"size mismatch for {name}: copying a param with shape {list(t.shape)} from "
                              f"checkpoint ('{t.path.name}'), the shape in current model is {list(shape)}.")
        elif t.dtype.is_floating_point != target.dtype.is_floating_point:
            mismatched.append(f"dtype mismatch for {name}: the checkpoint ('{t.path.name}') holds {t.dtype}, "
                              f"the model {target.dtype}.")
        loaded[name] = t
    if mismatched:
        raise RuntimeError(f"Error(s) in loading state_dict for {type(module).__name__}:\n\t" + "\n\t".join(mismatched)
                           + "\nNothing was loaded: the checkpoint is of another model or configuration; build the "
                           "model from the config saved with the weights")
    params: list[tuple[nn.Parameter, FileTensor]] = []
    buffers: list[tuple[torch.Tensor, FileTensor]] = []
    done: set[int] = set()  # by id: a tied parameter is written once, under the first of its names in the file
    for name, target in targets.items():
        t = loaded.get(name)
        if t is None or id(target) in done:
            continue
        done.add(id(target))
        (params if isinstance(target, nn.Parameter) else buffers).append((target, t))  # type: ignore[arg-type]
    missing = [n for n, target in targets.items()
               if id(target) not in done and not names.is_ignored_missing(n)]
    return _Plan(params, buffers, missing, unexpected)


def _read_tensors(path: str | os.PathLike) -> dict[str, FileTensor]:
    files, weight_map = checkpoint_files(path)
    tensors: dict[str, FileTensor] = {}
    for f in files:
        for name, t in read_header(f).items():
            if name in tensors:
                raise ValueError(f"tensor {name!r} is in both '{tensors[name].path}' and '{f}': a checkpoint holds "
                                 "each tensor once; remove the stale shard")
            tensors[name] = t
    if weight_map is not None:
        for name, file in weight_map.items():
            t = tensors.get(name)
            if t is None or t.path.name != file:
                where = f"'{t.path.name}'" if t is not None else "no shard"
                raise ValueError(f"the index of '{path}' puts tensor {name!r} in '{file}', but {where} holds it: the "
                                 "checkpoint is incomplete or mixes two saves; save it again")
    return tensors


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
        raise TypeError(f"load_pretrained needs an nn.Module or an engine, got {type(model).__name__}")
    plan = _plan(module, _read_tensors(path), HfNames.of(module))
    if strict and (plan.missing or plan.unexpected):
        lines = []
        if plan.missing:
            lines.append("Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in plan.missing) + ".")
        if plan.unexpected:
            lines.append("Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in plan.unexpected) + ".")
        raise RuntimeError(f"Error(s) in loading state_dict for {type(module).__name__}:\n\t" + "\n\t".join(lines)
                           + f"\nNothing was loaded from '{path}'; pass strict=False to load the tensors that match "
                           "and get these lists back")
    files = TensorFiles()
    try:
        with torch.no_grad():
            _load_params(module, plan.params, files)
            for b, t in plan.buffers:
                _read_whole(files, t, b)
    finally:
        files.close()
    return _IncompatibleKeys(plan.missing, plan.unexpected)


def _load_params(module: nn.Module, params: list[tuple[nn.Parameter, FileTensor]], files: TensorFiles) -> None:
    at_rest: list[tuple[nn.Parameter, FileTensor, InitStore]] = []
    gathered: list[tuple[nn.Parameter, FileTensor]] = []
    for p, t in params:
        owner = PARAM_OWNERS.owner_of(p)
        if isinstance(owner, InitStore):
            if owner.building:
                raise RuntimeError("load_pretrained was called inside infinity.zero.Init; call it after the context "
                                   "(the model is complete then), before or after infinity.initialize")
            at_rest.append((p, t, owner))
        else:
            gathered.append((p, t))
    for p, t, store in at_rest:
        store.fill(p, lambda lo, hi, out, t=t: files.read(t, lo, hi, out), source=t)
    rank = DataParallelGroup().rank
    for group in _by_module(module, gathered):
        owned = [(p, t) for p, t in group if PARAM_OWNERS.owner_of(p) is not None]
        for p, t in group:
            if PARAM_OWNERS.owner_of(p) is None:  # whole on every rank and no one else's: read in place
                _read_whole(files, t, p.data)
        if owned:
            _load_owned(owned, files, rank)


def _load_owned(group: list[tuple[nn.Parameter, FileTensor]], files: TensorFiles, rank: int) -> None:
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


def _by_module(module: nn.Module, params: list[tuple[nn.Parameter, FileTensor]]
               ) -> Iterator[list[tuple[nn.Parameter, FileTensor]]]:
    """``params`` grouped by the first module that holds each, in module order (the same on every rank)."""
    pending = {id(p): (p, t) for p, t in params}
    for _, m in module.named_modules():
        group = [pending.pop(id(p)) for p in m.parameters(recurse=False) if id(p) in pending]
        if group:
            yield group


def _read_whole(files: TensorFiles, t: FileTensor, dest: torch.Tensor) -> None:
    if dest.is_contiguous() and dest.device.type == "cpu":
        files.read(t, 0, t.numel, dest)
        return
    tmp = torch.empty(t.shape, dtype=dest.dtype)
    files.read(t, 0, t.numel, tmp)
    dest.copy_(tmp)
