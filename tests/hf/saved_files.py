"""What a saved safetensors file claims to hold, read from its header with struct and json only (an
oracle independent of the writers under test and of the safetensors library)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

ITEMSIZE = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}


def claimed_nbytes(path: Path) -> int:
    """The sum of numel * itemsize of the tensors ``path``'s header lists, after checking that each
    tensor's byte range has exactly that size and that the file holds every byte the header claims."""
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__", None)
    total = 0
    for name, t in header.items():
        nbytes = math.prod(t["shape"]) * ITEMSIZE[t["dtype"]]
        begin, end = t["data_offsets"]
        assert end - begin == nbytes, (
            f"{path}: {name} spans {end - begin} bytes for {nbytes} bytes of values"
        )
        assert 8 + n + end <= len(data), f"{path}: {name} ends past the end of the file"
        total += nbytes
    assert total <= len(data), f"{path}: claims {total} bytes in a file of {len(data)}"
    return total


def folder_nbytes(folder: Path) -> int:
    """claimed_nbytes summed over every .safetensors file of ``folder``."""
    return sum(claimed_nbytes(f) for f in sorted(Path(folder).glob("*.safetensors")))
