"""The safetensors file format: its dtype table, and the header every reader and writer here goes through.

A safetensors file is 8 bytes (little-endian u64: the header's length n),
then n bytes of JSON, then the tensor data. The JSON maps each tensor's name
to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to
the end of the header) and may hold ``"__metadata__"``, a map of strings to
strings. The header may end in spaces: ``build_header`` pads it so the data
starts at a chosen alignment (4096 makes O_DIRECT possible), which any
safetensors reader accepts.

``parse_header`` checks everything a reader trusts before a byte of data is
read: the length against the file's size, the JSON, every dtype, shape and
offset pair against the file's size. Errors are HeaderError (a ValueError)
naming the file and what is wrong. The safetensors package is not used to
read: it maps the whole file (see [Note: reading safetensors without mmap]
in reader.py), and its errors do not name the file.

Threading: none (pure functions and immutable records).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from collections.abc import Mapping, Sequence

import torch

from infinity.memory import round_up

MAX_HEADER_NBYTES = 100 << 20  # the safetensors package's own limit
METADATA_KEY = "__metadata__"
_LENGTH = struct.Struct("<Q")  # the header's length, the file's first 8 bytes

# safetensors dtype codes (the safetensors package's table, less the sub-byte float types torch cannot hold).
DTYPE_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.complex64: "C64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint64: "U64",
    torch.uint32: "U32",
    torch.uint16: "U16",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}


class HeaderError(ValueError):
    """A safetensors header that cannot be trusted; the message names the file and what is wrong."""

    def __init__(self, path: str, what: str):
        super().__init__(f"'{path}' {what}")
        self.path = path


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: ``begin``/``end`` are absolute byte offsets in the file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class Header:
    """A safetensors file's header, parsed: its tensors in file order, its metadata, where data starts."""

    entries: dict[str, Entry]
    metadata: dict[str, str]
    data_start: int
    file_nbytes: int  # what the header implies: data_start + the end of the last tensor


def dtype_code(dtype: torch.dtype) -> str:
    code = DTYPE_CODES.get(dtype)
    if code is None:
        raise ValueError(
            f"{dtype} cannot be stored in a safetensors file (it holds {', '.join(map(str, DTYPE_CODES))}); "
            "convert the tensor to one of them"
        )
    return code


def build_header(
    tensors: Sequence[tuple[str, torch.dtype, Sequence[int]]],
    metadata: Mapping[str, str] | None = None,
    *,
    align: int = 8,
) -> tuple[bytes, Header]:
    """A safetensors header for ``tensors`` laid end to end in this order, padded with spaces so the
    data starts at a multiple of ``align`` (8 is the format's own; 4096 makes O_DIRECT possible).
    The data that follows is each tensor's bytes, in this order, with nothing between them."""
    doc: dict[str, object] = {}
    if metadata:
        doc[METADATA_KEY] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    spans = []
    for name, dtype, shape in tensors:
        if name == METADATA_KEY or name in doc:
            raise ValueError(f"tensor name {name!r} is reserved or repeated")
        shape = tuple(int(d) for d in shape)
        nbytes = math.prod(shape) * dtype.itemsize
        doc[name] = {
            "dtype": dtype_code(dtype),
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        spans.append((name, dtype, shape, offset, offset + nbytes))
        offset += nbytes
    text = json.dumps(doc, separators=(",", ":")).encode()
    data_start = round_up(_LENGTH.size + len(text), max(8, align))
    text += b" " * (data_start - _LENGTH.size - len(text))
    entries = {n: Entry(n, dt, sh, data_start + b, data_start + e) for n, dt, sh, b, e in spans}
    meta = dict(doc.get(METADATA_KEY, {}))  # type: ignore[call-overload]
    return _LENGTH.pack(len(text)) + text, Header(entries, meta, data_start, data_start + offset)


def header_nbytes(prefix: bytes, *, file_nbytes: int, path: str) -> int:
    """From a file's first 8 bytes: how many bytes the whole header (those 8 included) takes, checked
    against the file's size."""
    if len(prefix) < _LENGTH.size:
        raise HeaderError(
            path, f"is not a safetensors file: {file_nbytes} bytes, too short for a header"
        )
    (n,) = _LENGTH.unpack_from(prefix)
    if n > min(MAX_HEADER_NBYTES, file_nbytes - _LENGTH.size):
        raise HeaderError(
            path,
            f"is not a safetensors file (or is truncated): its header claims {n} bytes of a {file_nbytes}-byte file",
        )
    return _LENGTH.size + n


def parse_header(blob: bytes | bytearray | memoryview, *, file_nbytes: int, path: str) -> Header:
    """Parses and validates a safetensors header (``blob`` holds at least the whole header) of a file of
    ``file_nbytes`` bytes. Raises HeaderError naming ``path`` when it is malformed or points past the file."""
    data_start = header_nbytes(bytes(blob[: _LENGTH.size]), file_nbytes=file_nbytes, path=path)
    if len(blob) < data_start:
        raise HeaderError(
            path, f"has a header of {data_start - _LENGTH.size} bytes, only {len(blob) - 8} read"
        )
    try:
        doc = json.loads(bytes(blob[_LENGTH.size : data_start]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HeaderError(
            path, f"has a corrupt safetensors header: not valid JSON ({err})"
        ) from None
    if not isinstance(doc, dict):
        raise HeaderError(path, "has a corrupt safetensors header: not a JSON object")
    meta = doc.pop(METADATA_KEY, None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise HeaderError(
            path, f"has a corrupt safetensors header: {METADATA_KEY} must map strings to strings"
        )
    entries = {}
    end_max = 0
    for name, d in doc.items():
        rel = _entry(name, d, path)  # offsets relative to data_start
        if data_start + rel.end > file_nbytes:
            raise HeaderError(
                path,
                f"is truncated or corrupt: tensor {name!r} ({DTYPE_CODES[rel.dtype]} {list(rel.shape)}) lies at "
                f"bytes {rel.begin}..{rel.end} after the header, in a file of {file_nbytes} bytes",
            )
        entries[name] = dataclasses.replace(
            rel, begin=data_start + rel.begin, end=data_start + rel.end
        )
        end_max = max(end_max, rel.end)
    return Header(entries, meta, data_start, data_start + end_max)


def _entry(name: str, d: object, path: str) -> Entry:
    """One header entry, offsets relative to the data's start, its extent checked against dtype x shape."""
    try:
        code, shape, offsets = d["dtype"], d["shape"], d["data_offsets"]  # type: ignore[index]
        ints = [*shape, *offsets]
        if (
            not all(isinstance(x, int) and not isinstance(x, bool) for x in ints)
            or len(offsets) != 2
        ):
            raise TypeError
    except (KeyError, TypeError):
        raise HeaderError(
            path, f"has a malformed header entry for tensor {name!r}: {d!r}"
        ) from None
    dtype = CODE_DTYPES.get(code)
    if dtype is None:
        raise HeaderError(
            path,
            f"holds tensor {name!r} of dtype {code!r}, which is not read here (one of {', '.join(CODE_DTYPES)}); "
            "convert the checkpoint to one of them",
        )
    begin, end = offsets
    if any(x < 0 for x in shape):
        raise HeaderError(path, f"holds tensor {name!r} with a negative dimension {shape}")
    numel = math.prod(shape)
    if not 0 <= begin <= end or end - begin != numel * dtype.itemsize:
        raise HeaderError(
            path, f"holds tensor {name!r} at bytes [{begin}, {end}), not {numel} x {dtype}"
        )
    return Entry(name, dtype, tuple(shape), begin, end)


def read_header_bytes(path: str | os.PathLike) -> tuple[bytes, int]:
    """(the whole header of the safetensors file at ``path``, the file's size); buffered reads, small.
    Raises HeaderError naming ``path`` where the header's length does not fit the file."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(_LENGTH.size)
        need = header_nbytes(prefix, file_nbytes=size, path=str(path))
        return prefix + f.read(need - _LENGTH.size), size


def read_header(path: str | os.PathLike) -> Header:
    """Reads and validates the header of the safetensors file at ``path`` (buffered reads; small)."""
    blob, size = read_header_bytes(path)
    return parse_header(blob, file_nbytes=size, path=str(path))
