"""Small safetensors files held whole in memory: tensors to the file's bytes and back.

For files read or written in one piece (a checkpoint's rank file: RNG state,
counters, buffers); large files are streamed (reader.py, and the engine's
writers over ``build_header``). The bytes are those of the safetensors
format (header.py): ``safetensors.torch.load`` reads what ``tensors_to_bytes``
writes, and ``tensors_from_bytes`` reads what ``safetensors.torch.save`` writes.

Threading: none.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from infinity.weights.header import Header, build_header


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's elements as flat uint8 (a view where it is contiguous and on the CPU)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def tensors_to_bytes(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> bytes:
    """A safetensors file holding ``tensors`` (in this order) and ``metadata``."""
    header, _ = build_header(
        [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()], metadata
    )
    return b"".join([header, *(tensor_bytes(t).numpy().tobytes() for t in tensors.values())])


def tensors_from_bytes(blob: bytes | bytearray, header: Header) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file held whole in ``blob`` (copies; never views of ``blob``)."""
    out = {}
    for name, e in header.entries.items():
        raw = bytearray(blob[e.begin : e.end])
        data = (
            torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        )
        out[name] = data.view(e.dtype).reshape(e.shape)
    return out
