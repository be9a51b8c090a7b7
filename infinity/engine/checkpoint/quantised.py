"""A frozen unit that rests quantised, in a checkpoint: its format recorded, its packed bytes saved or
made again, and its values as training saw them (dequantised) for exports.

[Note: a quantised base in a checkpoint]
A frozen unit whose shard rests quantised (a QLoRA run's base: [Note: a quantised frozen base] in
infinity/engine/initialize.py, laid out as [Note: quantised shards] in infinity/weights/quant.py says)
is checkpointed by the rules of [Note: frozen units in a checkpoint] (sources.py), with its packed
shard where a 16-bit unit has its values:
- the manifest's unit records the format (``quant``: the QuantSpec's fields, ``double_quant``
  among them);
- the CRC32C that says the unit still holds its files' values is that of the packed shard as
  initialize quantised it from the files: a reference then means "these files, quantised so", and
  the checkpoint holds nothing of the base but the reference;
- saved once (a base not read from files), the shard is ``u<i>.param`` as its packed bytes (uint8,
  the format's size): a quarter of the 16-bit shard for NF4.
A load makes the packed shard again: from a reference, nothing when this engine's unit comes from the
same files in the same format with the same CRC32C, else the files read and quantised in this
engine's format (so a checkpoint of a 16-bit base loads under a quantised one, and the files are read
again under another world size); saved bytes are copied where the partitioning and the format are the
same, and refused otherwise (their 16-bit values were never stored: quantising the dequantised values
again would not give the bytes training used). Exports (``save_16bit_model``, ``export_checkpoint``)
write a quantised unit's dequantised values, the weights the adapters were trained against.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from infinity.engine.checkpoint.errors import CheckpointMismatchError
from infinity.weights.quant import QuantSpec, ShardFormat, dequantize_into, shard_format


def spec_json(spec: QuantSpec) -> dict[str, Any]:
    return dataclasses.asdict(spec)


def spec_of(d: dict[str, Any] | None) -> QuantSpec | None:
    """The QuantSpec a manifest's unit records (None: its weights rest in their dtype)."""
    if d is None:
        return None
    return QuantSpec(
        int(d["num_bits"]),
        int(d["group_size"]),
        bool(d["symmetric"]),
        str(d["quant_type"]),
        bool(d.get("double_quant", False)),  # absent from manifests written before it existed
    )


def describe(spec: QuantSpec | None) -> str:
    if spec is None:
        return "in its dtype"
    kind = spec.name
    return f"quantised ({kind}, groups of {spec.group_size})"


def partition_format(
    slots: Sequence[Any],
    q: int,
    shard_numel: int,
    dtype: torch.dtype,
    spec: QuantSpec,
) -> ShardFormat:
    """The at-rest format of partition ``q`` of a unit whose ``slots`` (offset, numel, shape: a live
    layout's or a manifest's) are cut into shards of ``shard_numel``: what zero's unit_shard_format gives
    the rank that holds it."""
    lo, hi = q * shard_numel, (q + 1) * shard_numel
    stretches = []
    for s in slots:
        a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
        if a < b:
            stretches.append((a - lo, b - lo, tuple(s.shape)))
    return shard_format(stretches, shard_numel, dtype, spec)


def dequantised(fmt: ShardFormat, packed: torch.Tensor) -> torch.Tensor:
    """The shard's values (``fmt.numel`` of ``fmt.dtype``) from its packed bytes."""
    out = torch.empty(fmt.numel, dtype=fmt.dtype)
    dequantize_into(fmt, packed, out)
    return out


def check_same_format(
    unit_name: str,
    saved: QuantSpec | None,
    live: QuantSpec | None,
    same_partitioning: bool,
) -> None:
    """Saved packed bytes load only into the same format and partitioning (see the Note)."""
    if saved is None:
        return
    if saved != live or not same_partitioning:
        why = (
            f"this engine keeps it {describe(live)}"
            if saved != live
            else "this engine partitions it differently (another world size)"
        )
        raise CheckpointMismatchError(
            f"the frozen weights of {unit_name!r} were saved {describe(saved)} as their packed bytes, "
            f"and {why}; load the checkpoint with the weight_quantization and world size it was saved "
            "with, or build the model from its pretrained files (load_pretrained) so that the "
            "checkpoint refers to them"
        )
