"""Python values to JSON and back, with tensors set aside for a safetensors file: never pickle.

Accepted: None, bool, int, float (inf and nan too), str, lists, tuples, dicts
(keys of those scalar types or tuples of them), and torch tensors (stored in the rank's safetensors file and
returned on CPU). numpy scalars and arrays become Python numbers and tensors.
Anything else is refused, naming where it sits, so a checkpoint never holds
something that only code could rebuild.

Encoding: tuples become ``{"__tuple__": [...]}``, tensors ``{"__tensor__":
name}``, dicts with other than str keys ``{"__items__": [[key, value], ...]}``,
and a user dict that happens to have one of those keys alone is wrapped as
``{"__dict__": {...}}``, so decoding is unambiguous.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

_MARKERS = ("__tuple__", "__tensor__", "__dict__", "__items__")


class TensorSink:
    """Collects the tensors met while encoding, each under a fresh name with ``prefix``."""

    def __init__(self, prefix: str, *, copy: bool = True):
        self.prefix = prefix
        self.copy = copy
        self.tensors: dict[str, torch.Tensor] = {}

    def add(self, t: torch.Tensor) -> str:
        name = f"{self.prefix}{len(self.tensors)}"
        # copy=True: safetensors refuses tensors sharing memory, and the caller may keep changing t.
        # copy=False: the tensor is written out by the caller before it can change (large state).
        self.tensors[name] = (
            t.detach().to("cpu", copy=True).contiguous() if self.copy else t.detach()
        )
        return name


def encode(value: Any, sink: TensorSink | None, where: str) -> Any:
    """``value`` as JSON-ready data; ``where`` names it in errors (e.g. ``client_state``)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, np.generic):
        return encode(value.item(), sink, where)
    if isinstance(value, np.ndarray):
        if value.dtype == np.uint32:
            value = value.astype(np.int64)
        return encode(torch.from_numpy(np.ascontiguousarray(value)), sink, where)
    if isinstance(value, torch.Tensor):
        if sink is None:
            raise TypeError(
                f"{where} is a tensor, which cannot be stored here; store a number or list instead"
            )
        return {"__tensor__": sink.add(value)}
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v, sink, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, sink, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if not all(
            isinstance(k, str) for k in value
        ):  # e.g. torch optimizers' {param index: state}
            return {
                "__items__": [
                    [encode(k, None, f"a key of {where}"), encode(v, sink, f"{where}[{k!r}]")]
                    for k, v in value.items()
                ]
            }
        out = {k: encode(v, sink, f"{where}[{k!r}]") for k, v in value.items()}
        if len(out) == 1 and next(iter(out)) in _MARKERS:
            return {"__dict__": out}
        return out
    raise TypeError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}, which a checkpoint cannot hold: "
        "checkpoints store JSON values (None, bool, int, float, str, list, tuple, dict) and torch tensors, "
        "never pickled objects; store its state instead (e.g. obj.state_dict())"
    )


def decode(data: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    if isinstance(data, list):
        return [decode(v, tensors, where) for v in data]
    if isinstance(data, dict):
        if len(data) == 1:
            ((k, v),) = data.items()
            if k == "__tuple__":
                return tuple(decode(x, tensors, where) for x in v)
            if k == "__tensor__":
                if v not in tensors:
                    raise KeyError(f"{where}: tensor {v!r} is missing from the rank file")
                return tensors[v]
            if k == "__dict__":
                return {kk: decode(vv, tensors, where) for kk, vv in v.items()}
            if k == "__items__":
                return {decode(kk, tensors, where): decode(vv, tensors, where) for kk, vv in v}
        return {k: decode(v, tensors, where) for k, v in data.items()}
    return data
