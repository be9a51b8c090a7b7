"""load_pretrained: a Hugging Face ``save_pretrained`` directory into a model built under zero.Init, one module at a time.

The model is made from the directory's config.json under ``infinity.zero.Init``
(its parameters rest in the init store from the start: never whole in host
memory), then every module's own parameters and persistent buffers are read
from the safetensors files (``model.safetensors`` or the shards its index
names) and written under ``GatheredParameters(modifier_rank=0)``, so at most
one module's tensors exist whole at once. ``infinity.initialize`` then takes
the parameters from the init store as it would any zero.Init model (and
quantises them there when the config asks: [Note: quantised shards] in
infinity/zero/quant.py). Tied parameters (GPT-2's lm_head and wte) are one
parameter and are written once; a checkpoint may name either copy.

Only safetensors are read (never pickle). Threading: the caller's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from infinity.zero import GatheredParameters, Init

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def checkpoint_files(model_dir: str | Path) -> dict[str, Path]:
    """Each tensor name in the directory's safetensors checkpoint and the file that holds it."""
    from safetensors import safe_open

    d = Path(model_dir)
    if (d / INDEX).is_file():
        weight_map = json.loads((d / INDEX).read_text())["weight_map"]
        return {name: d / f for name, f in weight_map.items()}
    if (d / SINGLE).is_file():
        with safe_open(d / SINGLE, framework="pt") as f:
            return dict.fromkeys(f.keys(), d / SINGLE)
    raise FileNotFoundError(
        f"{d} has no {SINGLE} or {INDEX}: load_pretrained reads Hugging Face safetensors checkpoints "
        "(save_pretrained writes them by default); .bin (pickle) checkpoints are not read"
    )


def load_pretrained(model_dir: str | Path, config: Any, *, dtype: torch.dtype | None = None) -> nn.Module:
    """The causal LM in ``model_dir`` (config.json and safetensors), built under ``infinity.zero.Init(config)``
    with the checkpoint's weights written in; ready for ``infinity.initialize(model, config)``.
    ``dtype``: the parameters' dtype (default: the config.json's ``dtype``, else fp32)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    if dtype is None:
        dtype = getattr(hf_config, "dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
    with Init(config):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    load_state(model, checkpoint_files(model_dir))
    return model.eval()


def load_state(model: nn.Module, files: dict[str, Path]) -> None:
    """Writes the tensors of ``files`` (name → safetensors file) into ``model``'s parameters and persistent
    buffers, one module at a time. Raises KeyError naming what the checkpoint lacks or has over."""
    from safetensors import safe_open

    handles: dict[Path, Any] = {}

    def read(name: str) -> torch.Tensor:
        path = files[name]
        if path not in handles:
            handles[path] = safe_open(path, framework="pt")
        return handles[path].get_tensor(name)

    names = _names_by_tensor(model)
    missing = [n for p, aliases in names.items() if not any(a in files for a in aliases)
               for n in aliases[:1]]
    if missing:
        raise KeyError(f"the checkpoint has no tensor for {', '.join(missing)}")
    used = {a for aliases in names.values() for a in aliases if a in files}
    extra = sorted(set(files) - used)
    if extra:
        raise KeyError(f"the checkpoint has tensors the model does not: {', '.join(extra)}")
    for params, buffers in _own_tensors(model, names):
        with GatheredParameters(params, modifier_rank=0), torch.no_grad():
            for p in params:
                _copy(p, read(_present(names[p], files)), names[p][0])
        for b in buffers:
            with torch.no_grad():
                _copy(b, read(_present(names[b], files)), names[b][0])


def _names_by_tensor(model: nn.Module) -> dict[torch.Tensor, list[str]]:
    """Every parameter and persistent buffer with all the names it goes by (tied ones have several)."""
    names: dict[torch.Tensor, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(p, []).append(name)
    for mname, m in model.named_modules(remove_duplicate=False):
        for bname, b in m.named_buffers(recurse=False):
            if b is not None and bname not in m._non_persistent_buffers_set:
                names.setdefault(b, []).append(f"{mname}.{bname}" if mname else bname)
    return names


def _own_tensors(model: nn.Module, names: dict) -> Iterator[tuple[list, list]]:
    """Each module with its own (not its children's) parameters and persistent buffers, each once."""
    seen: set[int] = set()
    for m in model.modules():
        params = [p for p in m.parameters(recurse=False) if id(p) not in seen]
        buffers = [b for b in m.buffers(recurse=False) if b in names and id(b) not in seen]
        seen.update(id(t) for t in (*params, *buffers))
        if params or buffers:
            yield params, buffers


def _present(aliases: list[str], files: dict[str, Path]) -> str:
    return next(a for a in aliases if a in files)


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{name}: the checkpoint's tensor has shape {tuple(src.shape)}, the model's "
                         f"{tuple(dst.shape)}")
    dst.copy_(src)
