"""The on-disk layout of a checkpoint: its directory, file names, and manifest with its checksum.

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
checkpoint (no pickle). The safetensors files are read and written through
infinity.weights.header (offsets validated against the file size before a
byte of data is read).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

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
