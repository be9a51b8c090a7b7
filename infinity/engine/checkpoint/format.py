"""The on-disk format: file names and the safetensors files every tensor of a checkpoint is stored in.

A checkpoint is a directory ``<root>/<tag>/`` holding

- ``manifest.json``: what the checkpoint is (format version, world size,
  stage, partitions, the units with their parameters' names, shapes and
  dtypes, counters, the resolved config) and every other file's size, plus
  the CRC32C of the rank files. Its last field, ``manifest_crc32c``, is the
  CRC32C of every byte before it (see ``manifest_bytes``). Written last, by
  rank 0.
- ``part-RRRRR-of-PPPPP.safetensors``, one per partition: that partition's
  flat fp32 shards of every trainable unit (``u<i>.master``, ``u<i>.exp_avg``,
  ``u<i>.exp_avg_sq``) and of every frozen unit not saved as a reference to
  its files (``u<i>.param``, in its training dtype: [Note: frozen units in a
  checkpoint] in sources.py), written by the rank owning it with the aio engine.
  The header is padded with spaces (allowed by the safetensors format) so the
  data starts on a 4 KiB boundary, and every shard is a multiple of 4 KiB:
  each tensor can be read or written with O_DIRECT straight into pool memory.
- ``rank-RRRRR.safetensors``, one per rank: that rank's small state (RNG,
  step counts per parameter, client state, module buffers, the CRC32C of each
  tensor of its part file and of that file's header; rank 0's also the
  scheduler, loss scaler and hyperparameters) as JSON in ``__metadata__``
  plus small tensors.

So every byte a load trusts is under a checksum: the manifest's own, which
covers the rank files' CRC32C, which cover the part files' headers and
tensors. (Format version 1 had no manifest or header checksums; it is still
read, with a warning.)

Only JSON and safetensors are ever parsed: loading executes nothing from a
checkpoint (no pickle). Headers are parsed here rather than by the
safetensors package so that offsets can be validated against the file size
before a byte of data is read.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import struct
from collections.abc import Mapping, Sequence

import torch

from infinity.aio import crc32c

FORMAT = "infinity.checkpoint"
VERSION = 3
CHECKSUMMED_SINCE = 2  # the first version with manifest_crc32c and the part headers' CRC32C
# Version 3: frozen units (``u<i>.param`` or a reference to their files), config.json and adapter config.
MANIFEST = "manifest.json"
LATEST = "latest"
# Who may read a checkpoint: its owner only, as with the swap files (weights, moments, RNG, client state).
FILE_MODE = 0o600
DIR_MODE = 0o700
ALIGN = 4096
MAX_HEADER_NBYTES = 100 << 20  # the safetensors package's own limit

# safetensors dtype codes.
DTYPE_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

MANIFEST_CRC = "manifest_crc32c"
_MANIFEST_TRAILER = re.compile(rb',\n "manifest_crc32c": (\d+)\n\}\n?\Z')


def manifest_bytes(doc: Mapping[str, object]) -> bytes:
    """manifest.json: ``doc`` as indented JSON with one more, last field, ``manifest_crc32c``: the CRC32C of
    the file's bytes before that field. Any JSON reader reads it; ``manifest_crc`` checks it."""
    if MANIFEST_CRC in doc or not doc:
        raise ValueError(f"a manifest must be a non-empty mapping without {MANIFEST_CRC!r}")
    head = json.dumps(doc, indent=1).encode()[:-2]  # without the closing "\n}"
    return head + b',\n "%s": %d\n}\n' % (MANIFEST_CRC.encode(), crc32c(head))


def manifest_crc(raw: bytes) -> tuple[int, int] | None:
    """(saved, computed) CRC32C of manifest.json's bytes ``raw``, or None where it does not end in the
    field ``manifest_bytes`` writes."""
    m = _MANIFEST_TRAILER.search(raw, max(0, len(raw) - 64))
    if m is None:
        return None
    return int(m.group(1)), crc32c(raw[: m.start()])


def part_name(partition: int, partitions: int) -> str:
    return f"part-{partition:05d}-of-{partitions:05d}.safetensors"


def rank_name(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype_name(name: str, where: str) -> torch.dtype:
    dt = getattr(torch, str(name), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"{where}: unknown dtype {name!r}")
    return dt


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def round_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


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
    entries: dict[str, Entry]
    metadata: dict[str, str]
    data_start: int
    file_nbytes: int  # what the header implies: data_start + the end of the last tensor


def build_header(
    tensors: Sequence[tuple[str, torch.dtype, Sequence[int]]],
    metadata: Mapping[str, str] | None = None,
    *,
    align: int = 8,
) -> tuple[bytes, Header]:
    """A safetensors header for ``tensors`` laid end to end in this order, padded with spaces so the
    data starts at a multiple of ``align`` (8 is the format's own; 4096 makes O_DIRECT possible)."""
    doc: dict[str, object] = {}
    if metadata:
        doc["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    rel = []
    for name, dtype, shape in tensors:
        if name == "__metadata__" or name in doc:
            raise ValueError(f"tensor name {name!r} is reserved or repeated")
        shape = tuple(int(d) for d in shape)
        n = 1
        for d in shape:
            n *= d
        nbytes = n * itemsize(dtype)
        doc[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        rel.append((name, dtype, shape, offset, offset + nbytes))
        offset += nbytes
    text = json.dumps(doc, separators=(",", ":")).encode()
    data_start = round_up(8 + len(text), max(8, align))
    text += b" " * (data_start - 8 - len(text))
    blob = struct.pack("<Q", len(text)) + text
    entries = {n: Entry(n, dt, sh, data_start + b, data_start + e) for n, dt, sh, b, e in rel}
    return blob, Header(entries, dict(doc.get("__metadata__", {})), data_start, data_start + offset)


def header_nbytes_needed(prefix: bytes) -> int:
    """From a file's first 8 bytes: how many bytes the whole header (prefix included) takes."""
    (n,) = struct.unpack("<Q", prefix[:8])
    return 8 + n


def parse_header(blob: bytes, *, file_nbytes: int, path: str) -> Header:
    """Parses and validates a safetensors header (``blob`` holds at least the whole header).

    Raises ValueError naming ``path`` when the header is malformed or points past ``file_nbytes``.
    """
    if len(blob) < 8:
        raise ValueError(f"{path}: {len(blob)} bytes, too short for a safetensors header")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > MAX_HEADER_NBYTES or 8 + n > file_nbytes:
        raise ValueError(f"{path}: header length {n} does not fit a file of {file_nbytes} bytes")
    if len(blob) < 8 + n:
        raise ValueError(f"{path}: header of {n} bytes, only {len(blob) - 8} read")
    try:
        doc = json.loads(blob[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: header is not a JSON object")
    data_start = 8 + n
    meta = doc.pop("__metadata__", {}) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError(f"{path}: __metadata__ must map strings to strings")
    entries = {}
    end_max = 0
    for name, d in doc.items():
        try:
            dtype = CODE_DTYPES[d["dtype"]]
            shape = tuple(int(x) for x in d["shape"])
            b, e = (int(x) for x in d["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: malformed entry for tensor {name!r}: {d!r}") from None
        numel = 1
        for x in shape:
            if x < 0:
                raise ValueError(f"{path}: tensor {name!r} has a negative dimension {shape}")
            numel *= x
        if b < 0 or e - b != numel * itemsize(dtype):
            raise ValueError(f"{path}: tensor {name!r} spans bytes [{b}, {e}), not {numel} x {dtype}")
        entries[name] = Entry(name, dtype, shape, data_start + b, data_start + e)
        end_max = max(end_max, e)
    if data_start + end_max > file_nbytes:
        raise ValueError(
            f"{path}: tensors reach byte {data_start + end_max} but the file has {file_nbytes} bytes "
            "(truncated)"
        )
    return Header(entries, meta, data_start, data_start + end_max)


def read_header_bytes(path: str) -> tuple[bytes, int]:
    """(the whole header of the safetensors file at ``path``, the file's size); buffered reads, small.
    Raises ValueError naming ``path`` where the header's length does not fit the file."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path}: {size} bytes, too short for a safetensors header")
        need = header_nbytes_needed(prefix)
        if need > min(size, MAX_HEADER_NBYTES + 8):
            raise ValueError(f"{path}: header length {need - 8} does not fit a file of {size} bytes")
        return prefix + f.read(need - 8), size


def read_header(path: str) -> Header:
    """Reads and validates the header of the safetensors file at ``path`` (buffered reads; small)."""
    blob, size = read_header_bytes(path)
    return parse_header(blob, file_nbytes=size, path=path)


def tensors_from_bytes(blob: bytes | bytearray, header: Header) -> dict[str, torch.Tensor]:
    """The tensors of a small safetensors file held whole in memory (copies; never views of ``blob``)."""
    out = {}
    for name, e in header.entries.items():
        raw = bytearray(blob[e.begin : e.end])
        t = torch.frombuffer(raw, dtype=e.dtype) if raw else torch.empty(0, dtype=e.dtype)
        out[name] = t.reshape(e.shape)
    return out
