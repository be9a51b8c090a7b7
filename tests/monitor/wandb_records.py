"""wandb's offline run file (``run-<id>.wandb``) read back: its records, as wandb's own protobuf.

wandb 0.31 ships no reader for the file it writes offline, only its record
type (``wandb.proto.wandb_internal_pb2.Record``). The file is a 7-byte header
(":W&B", a 2-byte magic, a version byte) and then LevelDB's log framing:
32 KiB blocks of chunks, each a 4-byte checksum, a 2-byte little-endian
length, a 1-byte type (1 full, 2 first, 3 middle, 4 last) and the data; a
block's tail too short for a chunk header is zero padding.
"""

from __future__ import annotations

import struct
from pathlib import Path

BLOCK = 32 * 1024
HEADER = 7
CHUNK_HEADER = 7


def records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb run file"
    out, pending, pos = [], b"", HEADER
    while pos + CHUNK_HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < CHUNK_HEADER:
            pos += left_in_block
            continue
        _, length, kind = struct.unpack_from("<IHB", data, pos)
        if kind == 0 and length == 0:
            pos += left_in_block  # padding
            continue
        chunk = data[pos + CHUNK_HEADER : pos + CHUNK_HEADER + length]
        pos += CHUNK_HEADER + length
        if kind in (1, 2):
            pending = chunk
        else:
            pending += chunk
        if kind in (1, 4):
            r = wandb_internal_pb2.Record()
            r.ParseFromString(pending)
            out.append(r)
            pending = b""
    return out


def history(path: Path) -> list[dict]:
    """Each ``run.log`` of the file as {key: value} ("_step" included), in order."""
    import json

    rows = []
    for r in records(path):
        if r.WhichOneof("record_type") == "history":
            rows.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in r.history.item
                }
            )
    return rows
