"""export_merged: a LoRA run's checkpoint with its adapters merged into the base, written in the Hugging
Face layout without the training script's engine (``infinity export --merge-adapters``).

[Note: merging from a checkpoint]
A checkpoint of a PEFT model keeps what rebuilding its wrapping needs (model_files.py): the base's
``config.json`` (its class in ``architectures``), the active adapter's ``adapter_config.json`` (PEFT's
LoraConfig as ``save_pretrained`` writes it) and, in the manifest, the adapter's name and PEFT type;
its units hold the adapters' fp32 masters and the frozen base as a reference to its pretrained files,
quantised or not, or its saved shards ([Note: frozen units in a checkpoint] in sources.py). The base
class is built from that config on the meta device and wrapped by ``peft.get_peft_model`` with that
LoraConfig, so PEFT itself says which layers carry LoRA, their scaling (``lora_alpha``, ``use_rslora``,
the rank and alpha patterns) and ``fan_in_fan_out``, and its names must be the checkpoint's. Then the
merge is [Note: merged export]'s (merged.py), fed from the checkpoint's files instead of gathers: the
adapters (megabytes) are read first, their masters rounded to the dtype training computed in (the
values the live model held: this export equals ``engine.save_merged`` at the step it was saved), then
each unit's values in turn (a quantised base dequantised, as training saw it), each LoRA layer's weight
with its delta added by PEFT's formula in the dtype it trained in, then converted to ``dtype`` (default:
that dtype: nothing converted) and written under the base model's names, and dropped. Host memory holds the adapters and one unit. Needs
transformers and peft; every tensor read is checked against its CRC32C or its file's fingerprint.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from infinity.aio import AioConfig, AioHandle
from infinity.engine.checkpoint.collective_write import Planned, rank0_weight_files
from infinity.engine.checkpoint.errors import CheckpointMismatchError
from infinity.engine.checkpoint.export import (
    DEFAULT_MAX_SHARD_SIZE,
    FP32,
    checkpoint_shapes,
    export_gathered,
    hf_name,
    quantised_partition,
    write_module_config_files,
)
from infinity.engine.checkpoint.files import Check, read_tensors
from infinity.engine.checkpoint.format import parse_dtype_name
from infinity.engine.checkpoint.merged import base_name, is_adapter, lora_layers, merge
from infinity.engine.checkpoint.model import UnitInfo
from infinity.engine.checkpoint.model_files import ADAPTER_CONFIG_NAME
from infinity.engine.checkpoint.progress import Progress
from infinity.engine.checkpoint.reader import CheckpointReader
from infinity.engine.checkpoint.sources import SourceFiles, check_files
from infinity.engine.checkpoint.threads import torch_threads
from infinity.engine.checkpoint.weights_out import Segment
from infinity.weights.hf_layout import CONFIG_NAME, WEIGHTS_NAME, HfNames, parse_size
from infinity.zero.collectives import DataParallelGroup

log = logging.getLogger("infinity.checkpoint")

CALLER = "export --merge-adapters"


def export_merged(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    *,
    tag: str | None = None,
    dtype: torch.dtype | None = None,
    aio: AioConfig | None = None,
    progress: bool | None = None,
    max_shard_size: int | str | None = None,
    gather_nodes: bool = False,
) -> Path:
    """Writes the base model of a PEFT LoRA run's checkpoint with its adapter merged in
    ([Note: merging from a checkpoint]) to the directory ``out`` as ``from_pretrained`` reads it
    (``config.json``, ``model.safetensors`` or shards of ``max_shard_size`` with their index): what
    PEFT's ``merge_and_unload()`` then ``save_pretrained`` give on the model at that step. ``dtype``:
    of the weights written (default: the dtype it trained in). ``checkpoint``: a checkpoint directory,
    or a root with ``latest`` (or ``tag``). ``gather_nodes``: every rank of the initialized process
    group calls it, for a node-local checkpoint (as ``export_checkpoint``'s); rank 0 writes."""
    out = Path(out)
    if out.suffix == ".safetensors" or (out.exists() and not out.is_dir()):
        raise ValueError(
            f"the merged model is a Hugging Face directory; '{out}' is a file: give a directory "
            "(a path without a suffix)"
        )

    def write(reader: CheckpointReader) -> Path:
        with AioHandle.from_config(aio or AioConfig()) as handle:
            return _export_merged(reader, handle, out, dtype, progress, max_shard_size)

    if gather_nodes:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "export_merged(gather_nodes=True) is a collective of a process group, and none is "
                "initialized: run it on every rank under torchrun, or drop gather_nodes"
            )
        return export_gathered(DataParallelGroup(), checkpoint, out, tag, max_shard_size, write)
    with CheckpointReader(checkpoint, tag) as reader:
        return write(reader)


def _export_merged(
    reader: CheckpointReader,
    handle: AioHandle,
    out: Path,
    dtype: torch.dtype | None,
    progress: bool | None,
    max_shard_size: int | str | None,
) -> Path:
    layers: dict[str, Any] = {}

    def plan() -> tuple[Planned, tuple[Any, list[Any], torch.dtype]]:
        peft_model = _rebuilt(reader)
        layers.update(lora_layers(peft_model, CALLER))  # DoRA and the like refused first
        _check_rebuilt(reader, peft_model)
        base = peft_model.get_base_model()
        names = HfNames.of(base)
        trained = next((u.dtype for u in reader.units if u.trainable), FP32)
        out_dtype = dtype or trained
        segments = []
        for u in reader.units:
            for s in u.slots:
                if not is_adapter(s.name, layers):
                    aliases = [base_name(a) for a in s.aliases]
                    segments.append(Segment(hf_name(names, aliases), out_dtype, s.shape))
        for n, b in reader.manifest["buffers"].items():
            bdt = parse_dtype_name(b["dtype"], f"buffer {n}")
            segments.append(Segment(hf_name(names, [base_name(n)]), bdt, tuple(b["shape"])))
        max_nbytes = parse_size(max_shard_size or DEFAULT_MAX_SHARD_SIZE)
        return Planned(out, segments, WEIGHTS_NAME, max_nbytes, replace_stale=True), (
            base,
            segments,
            out_dtype,
        )

    with rank0_weight_files(None, handle, f"'{out}'", plan) as (
        (base, segments, out_dtype),
        output,
    ):
        assert output is not None  # one process writes
        with (
            Progress(output.total_nbytes, f"merge {reader.tag}", progress) as bar,
            torch_threads(1),
            contextlib.closing(SourceFiles()) as files,
        ):
            adapters = _adapters(reader, handle, files, layers)
            for t in _merged_values(reader, handle, files, layers, adapters, out_dtype):
                output.append(t)
                bar.update(t.numel() * t.element_size())
            buffers = reader.rank(0)[1]
            for n in reader.manifest["buffers"]:
                output.append(buffers[f"buffer.{n}"].contiguous())
        output.commit()
        write_module_config_files(out, base, base.config, out_dtype, nonce=output.nonce)
    log.info(
        "merged the LoRA adapter of '%s' into its base: '%s' (%d LoRA layers, %d tensors)",
        reader.dir,
        out,
        len(layers),
        sum(s.name is not None for s in segments),
    )
    return out


def _rebuilt(reader: CheckpointReader) -> Any:
    """The checkpoint's PEFT model rebuilt on the meta device from its config.json and adapter config."""
    adapter = reader.manifest.get("peft")
    if adapter is None:
        raise ValueError(
            f"the checkpoint '{reader.dir}' holds no PEFT adapters: nothing to merge; write its "
            "weights with infinity export (without --merge-adapters)"
        )
    if adapter.get("peft_type") != "LORA":
        raise ValueError(
            f"--merge-adapters merges LoRA adapters; the checkpoint '{reader.dir}' holds a "
            f"{adapter.get('peft_type')} adapter: write its adapter folder with infinity export and "
            "merge it with PEFT's merge_and_unload() on a model that fits in memory"
        )
    if CONFIG_NAME not in reader.files or ADAPTER_CONFIG_NAME not in reader.files:
        raise ValueError(
            f"the checkpoint '{reader.dir}' was saved without the base's {CONFIG_NAME} (its base is "
            "not a transformers model, or infinity saved no config then): rebuilding the PEFT "
            "model needs it; merge on the live engine with engine.save_merged()"
        )
    try:
        import peft
        import transformers
    except ImportError as e:
        raise ImportError(
            f"merging adapters from a checkpoint rebuilds the PEFT model: {e.name} is not installed "
            "(pip install transformers peft)"
        ) from e
    with tempfile.TemporaryDirectory() as d:
        for name in (CONFIG_NAME, ADAPTER_CONFIG_NAME):
            (Path(d) / name).write_bytes(reader.model_file(name))
        config = transformers.AutoConfig.from_pretrained(d)
        lora = peft.LoraConfig.from_pretrained(d)
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        raise ValueError(
            f"the checkpoint's {CONFIG_NAME} names the model class {arch!r}, which transformers "
            f"{transformers.__version__} lacks: merge on the live engine with engine.save_merged()"
        )
    with warnings.catch_warnings(), torch.device("meta"):
        # peft 0.21 reads transformers 5's deprecated is_gradient_checkpointing as it wraps a model
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
        model = peft.get_peft_model(cls(config), lora, adapter_name=adapter["name"])
    return model


def _check_rebuilt(reader: CheckpointReader, model: Any) -> None:
    """The rebuilt model has the checkpoint's tensors, by name and shape."""
    saved = checkpoint_shapes(reader)
    built = {n: tuple(t.shape) for n, t in model.state_dict(keep_vars=True).items()}
    for name in sorted(set(saved) | set(built)):
        if saved.get(name) != built.get(name):
            raise CheckpointMismatchError(
                f"the checkpoint's {CONFIG_NAME} and {ADAPTER_CONFIG_NAME} do not rebuild its model: "
                f"tensor {name!r} is {_shape(saved.get(name))} in the checkpoint and "
                f"{_shape(built.get(name))} in the {type(model.get_base_model()).__name__} with "
                "LoRA they describe; merge on the live engine with engine.save_merged()"
            )


def _shape(shape: tuple[int, ...] | None) -> str:
    return "absent" if shape is None else f"of shape {list(shape)}"


def _adapters(
    reader: CheckpointReader, handle: AioHandle, files: SourceFiles, layers: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """Every adapter tensor by its PEFT name, as the live model held it."""
    out: dict[str, torch.Tensor] = {}
    for u in reader.units:
        slots = [s for s in u.slots if is_adapter(s.name, layers)]
        if slots:
            values = unit_values(reader, handle, u, files)
            for s in slots:
                out[s.name] = values[s.offset : s.offset + s.numel].view(s.shape).clone()
    return out


def _merged_values(
    reader: CheckpointReader,
    handle: AioHandle,
    files: SourceFiles,
    layers: dict[str, Any],
    adapters: dict[str, torch.Tensor],
    dtype: torch.dtype,
) -> Iterator[torch.Tensor]:
    """Each base tensor in unit order, a LoRA layer's weight with its delta added in the dtype it
    trained in (PEFT's merge on the model as it was), then converted to ``dtype``."""
    for u in reader.units:
        kept = [s for s in u.slots if not is_adapter(s.name, layers)]
        if not kept:
            continue
        values = unit_values(reader, handle, u, files)
        for s in kept:
            slot = values[s.offset : s.offset + s.numel].view(s.shape)
            name = base_name(s.name)
            layer = layers.get(name.removesuffix(".weight")) if name.endswith(".weight") else None
            if layer is not None:
                slot = merge(layer, name.removesuffix(".weight"), slot, adapters)
            yield slot.reshape(-1).to(dtype)


def unit_values(
    reader: CheckpointReader, handle: AioHandle, u: UnitInfo, files: SourceFiles
) -> torch.Tensor:
    """Unit ``u``'s flat values [0, numel) in its dtype, as training saw them: a trainable unit's fp32
    masters rounded to it, a frozen unit's saved shards, its files' values, or its quantised shards
    dequantised; each checked (CRC32C, or the files' fingerprints)."""
    s = u.shard_numel
    out = torch.empty(u.numel, dtype=u.dtype)
    if u.quant is not None:
        for q in range(reader.partitions):
            n = max(0, min(s, u.numel - q * s))
            if n:
                out[q * s : q * s + n] = quantised_partition(reader, handle, u, q, files)[:n]
        return out
    if u.source is not None:
        tensors = [(str(p), str(n)) for p, n in u.source["tensors"]]
        saved = reader.manifest.get("source_files") or {}
        check_files({p: saved[p] for p, _ in tensors}, u.name)
        files.read_unit(tensors, u.slots, 0, u.numel, out)
        return out
    dt = FP32 if u.trainable else u.dtype
    raw = torch.empty(u.numel, dtype=dt)
    checks = []
    for q in range(reader.partitions):
        e = reader.entry(q, u.saved_as, dt, s)
        checks.append(
            Check(
                reader.part_path(q), reader.open_part(q, handle), e, reader.part_crc(q, u.saved_as)
            )
        )

    def on_chunk(q: int, off: int, data: torch.Tensor) -> None:
        lo = q * s + off // dt.itemsize
        n = min(data.numel() // dt.itemsize, u.numel - lo)
        if n > 0:
            raw[lo : lo + n] = data[: n * dt.itemsize].view(dt)

    read_tensors(handle, checks, progress=Progress(0, "", False), on_chunk=on_chunk)
    out.copy_(raw)
    return out
