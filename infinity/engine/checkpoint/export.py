"""Full weights as safetensors: from a checkpoint directory (export) or from a live engine (save_16bit_model).

Both stream: a unit's flat values are read (or all-gathered) a chunk or a
unit at a time, converted, and appended to the output through a few aligned
buffers (weights_out.py), so a model larger than host memory exports. Two
layouts:

- ``"state_dict"``: one file holding every ``state_dict`` entry of the model
  (tied parameters under each of their names, persistent buffers included):
  ``safetensors.torch.load_file`` + ``model.load_state_dict(strict=True)``
  put it into the plain PyTorch model. The default for models that are not
  Hugging Face's.
- ``"hf"``: a directory ``from_pretrained`` reads: ``model.safetensors``, or
  shards of at most ``max_shard_size`` with ``model.safetensors.index.json``,
  under the names ``save_pretrained`` writes (infinity.weights.hf_layout: tied
  weights once, HF's renamings), and ``config.json`` (plus
  ``generation_config.json``) when there is a Hugging Face config. The
  default for transformers models.

The files appear atomically: written under temporary names, fsynced, renamed.

DeepSpeed's counterparts: ``zero_to_fp32.py`` (export, fp32 from the
masters) and ``save_16bit_model`` / ``stage3_gather_16bit_weights_on_model_save``.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

from infinity.aio import AioConfig, AioHandle, crc32c
from infinity.engine.checkpoint import atomic, nodes
from infinity.engine.checkpoint.collective import agree, collective_device
from infinity.engine.checkpoint.collective_write import Planned, rank0_weight_files
from infinity.engine.checkpoint.errors import CheckpointCorruptError, CheckpointMismatchError
from infinity.engine.checkpoint.files import CHUNK_NBYTES, Check, read_tensors
from infinity.engine.checkpoint.format import parse_dtype_name
from infinity.engine.checkpoint.model import describe_units, state_dict_names
from infinity.engine.checkpoint.model_files import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    adapter_file_name,
)
from infinity.engine.checkpoint.progress import Progress
from infinity.engine.checkpoint.quantised import dequantised, partition_format, spec_of
from infinity.engine.checkpoint.reader import CheckpointReader
from infinity.engine.checkpoint.sources import SourceFiles, check_files
from infinity.engine.checkpoint.target import CheckpointTarget, TrainingParts
from infinity.engine.checkpoint.threads import torch_threads
from infinity.engine.checkpoint.weights_out import Segment, WeightFiles
from infinity.weights.hf_layout import (
    CONFIG_NAME,
    GENERATION_CONFIG_NAME,
    WEIGHTS_NAME,
    HfNames,
    hf_config,
    names_from_config,
    parse_size,
)
from infinity.weights.quant import ShardFormat, quantize_into
from infinity.zero.collectives import DataParallelGroup

if TYPE_CHECKING:
    from infinity.store import TieredStore
    from infinity.zero.unit import ParamUnit

log = logging.getLogger("infinity.checkpoint")

FP32 = torch.float32
DEFAULT_MAX_SHARD_SIZE = "50GB"  # save_pretrained's default in transformers 5
Layout = Literal["hf", "state_dict"]


def _check_out_path(out: Path) -> None:
    if out.suffix != ".safetensors":
        raise ValueError(
            f"the output '{out}' must end in .safetensors (or, for the Hugging Face layout, be a "
            "directory: a path without a suffix): this writes safetensors, never pickle"
        )
    if not out.parent.is_dir():
        raise FileNotFoundError(f"the directory of '{out}' does not exist; create it first")


def _choose_layout(layout: str | None, is_hf: bool, max_shard_size: int | str | None) -> Layout:
    if layout is None:
        layout = "hf" if is_hf or max_shard_size is not None else "state_dict"
    if layout not in ("hf", "state_dict"):
        raise ValueError(
            f"layout={layout!r}: use 'hf' (a directory from_pretrained reads) or 'state_dict' (one "
            "file with every state_dict name)"
        )
    if layout == "state_dict" and max_shard_size is not None:
        raise ValueError(
            "max_shard_size shards the Hugging Face layout; the 'state_dict' layout is one file "
            "(pass layout='hf', or no max_shard_size)"
        )
    return layout  # type: ignore[return-value]


def _convert(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    buf: list[torch.Tensor] = [torch.empty(0, dtype=dtype)]

    def conv(src: torch.Tensor) -> torch.Tensor:
        if src.dtype == dtype:
            return src
        if buf[0].numel() < src.numel():
            buf[0] = torch.empty(src.numel(), dtype=dtype)
        out = buf[0][: src.numel()]
        out.copy_(src)
        return out

    return conv


def hf_name(names: HfNames, aliases: list[str] | tuple[str, ...]) -> str | None:
    kept = names.saved(list(aliases))
    return names.file_name(kept) if kept is not None else None


def _write_config_files(
    out: Path,
    config: Any,
    dtype: torch.dtype,
    *,
    architecture: str | None,
    generation: Any,
    nonce: str,
) -> None:
    """``config.json`` (and ``generation_config.json``) as save_pretrained writes them, atomically."""
    config = copy.deepcopy(config)
    config.dtype = str(dtype).removeprefix(
        "torch."
    )  # what the weights are, as save_pretrained records it
    if architecture is not None:
        config.architectures = [architecture]
    atomic.replace_durably(
        out / CONFIG_NAME, config.to_json_string(use_diff=True).encode(), "config.json", nonce
    )
    if generation is not None:
        atomic.replace_durably(
            out / GENERATION_CONFIG_NAME,
            generation.to_json_string(use_diff=True).encode(),
            "generation_config.json",
            nonce,
        )


def write_module_config_files(
    out: Path, module: Any, config: Any, dtype: torch.dtype, *, nonce: str
) -> None:
    """``config.json`` of a live model (and ``generation_config.json`` where it generates)."""
    can_generate = getattr(module, "can_generate", None)
    generation = (
        getattr(module, "generation_config", None)
        if callable(can_generate) and can_generate()
        else None
    )
    _write_config_files(
        out, config, dtype, architecture=type(module).__name__, generation=generation, nonce=nonce
    )


# -- from a checkpoint directory --------------------------------------------------


def export_checkpoint(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    *,
    tag: str | None = None,
    dtype: torch.dtype = FP32,
    aio: AioConfig | None = None,
    progress: bool | None = None,
    max_shard_size: int | str | None = None,
    config: str | os.PathLike | None = None,
    gather_nodes: bool = False,
) -> Path:
    """Writes the full weights of a checkpoint (the fp32 masters, converted to ``dtype``) and its buffers.
    ``checkpoint``: a checkpoint directory, or a root with ``latest`` (or ``tag``). ``out``: a
    ``.safetensors`` file (the "state_dict" layout), or a directory (an existing one, or a path without a
    suffix, created), which gets the Hugging Face layout
    (shards of ``max_shard_size``, default "50GB"). Its ``config.json`` comes from ``config`` (the file
    or its directory), else from the checkpoint (saved with it: model_files.py), else from beside it (the
    root: where the HF Trainer, or ``model.config.save_pretrained(root)``, puts it); with transformers
    installed the model class it names (built on the meta device) gives the names save_pretrained
    writes, and its shapes must be the checkpoint's (CheckpointMismatchError naming the tensor). A PEFT
    model's checkpoint exported to a directory gives the adapter folder (adapter_config.json,
    adapter_model.safetensors) that ``PeftModel.from_pretrained`` reads. Frozen units come from where the
    checkpoint keeps them ([Note: frozen units in a checkpoint] in sources.py).
    ``gather_nodes``: a collective of every rank of the initialized process group (what ``infinity
    export`` under torchrun does), for a node-local checkpoint: each rank serves what its node holds
    and rank 0 writes ([Note: node-local checkpoints] in nodes.py). Without it, one process reads
    the checkpoint alone, whatever process group it is in (e.g. rank 0 after training)."""
    out = Path(out)
    hf = out.is_dir() or out.suffix == ""

    def write(reader: CheckpointReader) -> Path:
        return _export(
            reader,
            out,
            dtype=dtype,
            aio=aio,
            progress=progress,
            max_shard_size=max_shard_size,
            config=config,
        )

    if gather_nodes:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "export_checkpoint(gather_nodes=True) is a collective of a process group, and none "
                "is initialized: run it on every rank under torchrun, or drop gather_nodes"
            )
        return export_gathered(DataParallelGroup(), checkpoint, out, tag, max_shard_size, write)
    if not hf:
        _check_out_path(out)
        _choose_layout("state_dict", False, max_shard_size)
    with CheckpointReader(checkpoint, tag) as reader:
        return write(reader)


def export_gathered(
    group: DataParallelGroup,
    checkpoint: str | os.PathLike,
    out: Path,
    tag: str | None,
    max_shard_size: int | str | None,
    write: Callable[[CheckpointReader], Path],
) -> Path:
    """Under torchrun, from node-local checkpoints ([Note: node-local checkpoints] in nodes.py): rank 0
    writes ``out`` on its node; first it fetches, from the ranks holding them, the saved weights its node
    lacks (the masters and frozen shards only, never the moments: a chunk of memory at a time, into a
    hidden copy beside the checkpoint, removed after), then it streams them as a single-node export
    does. Every rank must call it; every rank returns ``out`` or raises."""
    err: BaseException | None = None
    reader = None
    try:
        reader = nodes.open_checkpoint(group, checkpoint, tag, warn=group.rank == 0)
        if group.rank == 0:
            if not (out.is_dir() or out.suffix == ""):
                _check_out_path(out)
                _choose_layout("state_dict", False, max_shard_size)
            _want_weights(reader)
    except Exception as e:
        err = e
    try:
        agree(group, err, "opening the checkpoint to export")
        assert reader is not None  # agree() raised, had any rank failed to open it
        nodes.fetch_tensors(reader)
        err = None
        if group.rank == 0:
            try:
                write(reader)
            except Exception as e:
                err = e
        agree(group, err, f"exporting to '{out}' on rank 0")
    finally:
        if reader is not None:
            nodes.close(reader)
    return out


def _want_weights(reader: CheckpointReader) -> None:
    """Touches every saved tensor an export reads, so that those of other nodes are fetched."""
    if reader.manifest.get("optimizer") == "passthrough":
        for name, e in reader.part(0).entries.items():
            if name.startswith("param."):
                reader.entry(0, name, e.dtype, e.numel)
        return
    for u in reader.units:
        if u.source is None:
            for q in range(reader.partitions):
                reader.entry(q, u.saved_as, FP32 if u.trainable else u.dtype, u.shard_numel)


def _export(
    reader: CheckpointReader,
    out: Path,
    *,
    dtype: torch.dtype,
    aio: AioConfig | None,
    progress: bool | None,
    max_shard_size: int | str | None,
    config: str | os.PathLike | None,
) -> Path:
    hf = out.is_dir() or out.suffix == ""
    with AioHandle.from_config(aio or AioConfig()) as handle:
        adapter = reader.manifest.get("peft")
        if hf and adapter is not None:
            return _export_adapter(reader, handle, out, dtype, adapter, progress)
        names, hf_cfg, config_dir, arch = (
            _names_for_export(reader, config) if hf else (None, None, None, None)
        )
        segments, alias_of = _segments_from_checkpoint(reader, dtype, names)
        if hf:
            out.mkdir(parents=True, exist_ok=True)
            output = WeightFiles(
                out,
                handle,
                segments,
                weights_name=WEIGHTS_NAME,
                max_shard_nbytes=parse_size(max_shard_size or DEFAULT_MAX_SHARD_SIZE),
                replace_stale=True,
            )
        else:
            output = WeightFiles(out.parent, handle, segments, weights_name=out.name)
        try:
            with (
                Progress(output.total_nbytes, f"export {reader.tag}", progress) as bar,
                torch_threads(1),
            ):
                if reader.manifest.get("optimizer") == "passthrough":
                    _stream_passthrough(reader, handle, output, dtype, bar, aliases=not hf)
                else:
                    _stream_units(reader, handle, output, dtype, bar, reader.units)
                    _stream_aliases(reader, handle, output, dtype, alias_of)
                buffers = reader.rank(0)[1]
                for name, b in reader.manifest["buffers"].items():
                    bdt = parse_dtype_name(b["dtype"], f"buffer {name}")
                    output.append(
                        buffers[f"buffer.{name}"]
                        .to(dtype if bdt.is_floating_point else bdt)
                        .contiguous()
                    )
            files = output.commit()
        except BaseException:
            output.abort()
            raise
        if hf:
            _export_config(out, hf_cfg, config_dir, dtype, arch, output.nonce)
    size = sum(f.stat().st_size for f in files)
    log.info(
        "exported '%s' to '%s' (%d tensors in %d file(s), %.2f GB)",
        reader.dir,
        out,
        sum(s.name is not None for s in segments),
        len(files),
        size / 1e9,
    )
    return out


def _export_adapter(
    reader: CheckpointReader,
    handle: AioHandle,
    out: Path,
    dtype: torch.dtype,
    adapter: dict[str, Any],
    progress: bool | None,
) -> Path:
    """A PEFT checkpoint: the folder ``PeftModel.from_pretrained`` reads, ``adapter_config.json`` and
    ``adapter_model.safetensors`` with the trained parameters under PEFT's names (the base is the
    pretrained model's, which the checkpoint refers to)."""
    units = [u for u in reader.units if u.trainable]
    segments = [
        Segment(adapter_file_name(s.aliases[0], adapter["name"]), dtype, s.shape)
        for u in units
        for s in u.slots
    ]
    out.mkdir(parents=True, exist_ok=True)
    output = WeightFiles(
        out, handle, segments, weights_name=ADAPTER_WEIGHTS_NAME, replace_stale=True
    )
    try:
        with (
            Progress(output.total_nbytes, f"export {reader.tag}", progress) as bar,
            torch_threads(1),
        ):
            _stream_units(reader, handle, output, dtype, bar, units)
        files = output.commit()
    except BaseException:
        output.abort()
        raise
    atomic.replace_durably(
        out / ADAPTER_CONFIG_NAME,
        reader.model_file(ADAPTER_CONFIG_NAME),
        ADAPTER_CONFIG_NAME,
        output.nonce,
    )
    log.info(
        "exported the %s adapter %r of '%s' to '%s' (%d tensors, %.2f MB)",
        adapter.get("peft_type"),
        adapter["name"],
        reader.dir,
        out,
        len(segments),
        sum(f.stat().st_size for f in files) / 1e6,
    )
    return out


def _names_for_export(
    reader: CheckpointReader, config: str | os.PathLike | None
) -> tuple[HfNames, Any, Path | None, str | None]:
    """The HF names to write, the transformers config (or None), the directory holding config.json and the
    model class it describes (or None)."""
    config_dir: Path | None
    if config is not None:
        config_dir = Path(config)
        if config_dir.is_file():
            config_dir = config_dir.parent
        if not (config_dir / CONFIG_NAME).is_file():
            raise FileNotFoundError(
                f"no {CONFIG_NAME} at '{config}'; give the file, or the directory save_pretrained "
                "wrote it to"
            )
    elif CONFIG_NAME in reader.files:  # saved with the checkpoint (model_files.py), checksummed
        reader.model_file(CONFIG_NAME)
        config_dir = reader.dir
    else:
        config_dir = next(
            (d for d in (reader.dir, reader.dir.parent) if (d / CONFIG_NAME).is_file()), None
        )
    plain = HfNames(frozenset())
    if config_dir is None:
        log.warning(
            "no %s beside the checkpoint '%s': the weights are written without it, and from_pretrained "
            "needs one (pass config=, or --config, naming the model's config.json)",
            CONFIG_NAME,
            reader.dir,
        )
        return plain, None, None, None
    try:
        names, hf_cfg, arch = names_from_config(config_dir, _checkpoint_names(reader))
    except ImportError:
        log.warning(
            "transformers is not installed: '%s' is copied as it is and the tensors keep their state_dict "
            "names (the model's tied weights once)",
            config_dir / CONFIG_NAME,
        )
        return plain, None, config_dir, None
    _check_shapes(reader, hf_cfg, arch, config_dir / CONFIG_NAME)
    return names, hf_cfg, config_dir, arch


def _check_shapes(reader: CheckpointReader, hf_cfg: Any, arch: str, path: Path) -> None:
    """The model ``hf_cfg`` describes (built on the meta device) has the checkpoint's shapes, else a
    config.json that would not load the export (e.g. written before ``resize_token_embeddings``) is
    refused naming the tensor and both shapes."""
    import transformers

    with torch.device("meta"):
        model = getattr(transformers, arch)(copy.deepcopy(hf_cfg))
    saved = checkpoint_shapes(reader)
    for name, t in model.state_dict(keep_vars=True).items():
        if name in saved and tuple(t.shape) != saved[name]:
            raise CheckpointMismatchError(
                f"'{path}' does not describe the checkpoint's model: tensor {name!r} has shape "
                f"{list(saved[name])} in the checkpoint and {list(t.shape)} in the {arch} that config builds; "
                "export without --config (the checkpoint's own config.json), or give the config saved with it"
            )


def checkpoint_shapes(reader: CheckpointReader) -> dict[str, tuple[int, ...]]:
    m = reader.manifest
    if m.get("optimizer") == "passthrough":
        out = {a: tuple(p["shape"]) for p in m["params"] for a in [p["name"], *p["aliases"]]}
    else:
        out = {a: tuple(s.shape) for u in reader.units for s in u.slots for a in s.aliases}
    return out | {n: tuple(b["shape"]) for n, b in m["buffers"].items()}


def _checkpoint_names(reader: CheckpointReader) -> set[str]:
    """Every state_dict name of the model the checkpoint was saved from."""
    m = reader.manifest
    if m.get("optimizer") == "passthrough":
        params = {a for p in m["params"] for a in [p["name"], *p["aliases"]]}
    else:
        params = {a for u in reader.units for s in u.slots for a in s.aliases}
    return params | set(m["buffers"])


def _export_config(
    out: Path,
    hf_cfg: Any,
    config_dir: Path | None,
    dtype: torch.dtype,
    arch: str | None,
    nonce: str,
) -> None:
    if config_dir is None:
        return
    if hf_cfg is None:  # no transformers: the files as they are
        for name in (CONFIG_NAME, GENERATION_CONFIG_NAME):
            if (config_dir / name).is_file() and config_dir.resolve() != out.resolve():
                atomic.replace_durably(out / name, (config_dir / name).read_bytes(), name, nonce)
        return
    generation = None
    if (config_dir / GENERATION_CONFIG_NAME).is_file():
        import transformers

        generation = transformers.GenerationConfig.from_pretrained(config_dir)
    _write_config_files(out, hf_cfg, dtype, architecture=arch, generation=generation, nonce=nonce)


def _segments_from_checkpoint(reader: CheckpointReader, dtype: torch.dtype, names: HfNames | None):
    """The stream's tensors: each parameter under its first name (in unit order), then (state_dict layout)
    the other names of tied parameters, then the buffers. ``names``: the HF layout's naming (one name per
    parameter), or None."""
    segments: list[Segment] = []
    alias_of: list[tuple[str, tuple[int, int]]] = []  # (alias, (unit, slot)) to write again
    m = reader.manifest

    def name(aliases: list[str]) -> str | None:
        return aliases[0] if names is None else hf_name(names, aliases)

    if m.get("optimizer") == "passthrough":
        for p in m["params"]:
            segments.append(Segment(name(p["aliases"] or [p["name"]]), dtype, tuple(p["shape"])))
        if names is None:
            for p in m["params"]:
                segments += [Segment(a, dtype, tuple(p["shape"])) for a in p["aliases"][1:]]
    else:
        for u in reader.units:
            segments += [Segment(name(list(s.aliases)), dtype, s.shape) for s in u.slots]
        if names is None:
            for u in reader.units:
                for k, s in enumerate(u.slots):
                    for a in s.aliases[1:]:
                        segments.append(Segment(a, dtype, s.shape))
                        alias_of.append((a, (u.index, k)))
    for bname, b in m["buffers"].items():
        bdt = parse_dtype_name(b["dtype"], f"buffer {bname}")
        segments.append(
            Segment(name([bname]), dtype if bdt.is_floating_point else bdt, tuple(b["shape"]))
        )
    return segments, alias_of


def _stream_units(
    reader: CheckpointReader,
    handle: AioHandle,
    output: WeightFiles,
    dtype: torch.dtype,
    bar: Progress,
    units: list[Any],
) -> None:
    """Each unit's weights: a trainable unit's fp32 masters or a frozen unit's saved shards, partition
    after partition (flat elements [0, numel) are its slots end to end), or a frozen unit's slots read
    from the files the checkpoint refers to ([Note: frozen units in a checkpoint] in sources.py)."""
    conv = _convert(dtype)
    checks: list[Check] = []
    flat_start: list[
        tuple[int, int, torch.dtype]
    ] = []  # (first flat element of the check's tensor, numel, dtype)

    def on_chunk(i: int, off: int, data: torch.Tensor) -> None:
        first, numel, dt = flat_start[i]
        isz = dt.itemsize
        lo = first + off // isz
        n = min(data.numel() // isz, numel - lo)
        if n > 0:
            output.append(conv(data[: n * isz].view(dt)))

    def flush() -> None:
        if checks:
            read_tensors(handle, checks, progress=bar, on_chunk=on_chunk)
        checks.clear()
        flat_start.clear()

    files = SourceFiles()
    try:
        for u in units:
            if u.quant is not None:
                flush()
                for q in range(reader.partitions):
                    values = quantised_partition(reader, handle, u, q, files)
                    n = max(0, min(u.shard_numel, u.numel - q * u.shard_numel))
                    output.append(conv(values[:n]))
                    bar.update(n * u.dtype.itemsize)
                continue
            if u.source is not None:
                flush()
                _stream_source(reader, u, files, output, conv, bar)
                continue
            dt = FP32 if u.trainable else u.dtype
            for q in range(reader.partitions):
                e = reader.entry(q, u.saved_as, dt, u.shard_numel)
                checks.append(
                    Check(
                        reader.part_path(q),
                        reader.open_part(q, handle),
                        e,
                        reader.part_crc(q, u.saved_as),
                    )
                )
                flat_start.append((q * u.shard_numel, u.numel, dt))
        flush()
    finally:
        files.close()


def _stream_source(
    reader: CheckpointReader,
    unit: Any,
    files: SourceFiles,
    output: WeightFiles,
    conv: Callable[[torch.Tensor], torch.Tensor],
    bar: Progress,
) -> None:
    """A referenced frozen unit's slots from their files (checked unchanged first), a chunk at a time."""
    tensors = [(str(p), str(n)) for p, n in unit.source["tensors"]]
    saved = reader.manifest.get("source_files") or {}
    check_files({p: saved[p] for p, _ in tensors}, unit.name)
    for (path, name), slot in zip(tensors, unit.slots, strict=True):
        t = files.tensor(path, name, slot.shape)
        step = max(1, CHUNK_NBYTES // t.dtype.itemsize)
        buf = torch.empty(min(step, slot.numel), dtype=t.dtype)
        for lo in range(0, slot.numel, step):
            hi = min(slot.numel, lo + step)
            files.read_tensor(t, lo, hi, buf[: hi - lo])
            output.append(conv(buf[: hi - lo]))
            bar.update((hi - lo) * t.dtype.itemsize)


def quantised_partition(
    reader: CheckpointReader, handle: AioHandle, unit: Any, q: int, files: SourceFiles
) -> torch.Tensor:
    """Partition ``q`` of a frozen unit that rested quantised, dequantised: from its packed bytes in
    the part file (checked against their CRC32C), or from the files it refers to, quantised as it
    was ([Note: a quantised base in a checkpoint] in quantised.py)."""
    spec = spec_of(unit.quant)
    assert spec is not None  # called for the units the manifest says rested quantised
    s = unit.shard_numel
    fmt = partition_format(unit.slots, q, s, unit.dtype, spec)
    packed = torch.zeros(fmt.nbytes, dtype=torch.uint8)
    if unit.source is not None:
        tensors = [(str(p), str(n)) for p, n in unit.source["tensors"]]
        saved = reader.manifest.get("source_files") or {}
        check_files({p: saved[p] for p, _ in tensors}, unit.name)
        values = torch.empty(s, dtype=unit.dtype)
        files.read_unit(tensors, unit.slots, q * s, (q + 1) * s, values)
        quantize_into(fmt, values, packed, name=unit.name)
    else:
        e = reader.entry(q, unit.saved_as, torch.uint8, fmt.nbytes)
        handle.sync_pread(packed, reader.open_part(q, handle), e.begin)
        if crc32c(packed) != reader.part_crc(q, unit.saved_as):
            path = reader.part_path(q)
            raise CheckpointCorruptError(
                f"tensor {unit.saved_as!r} in '{path}' does not match its CRC32C: the file is corrupt; "
                "restore it or export another checkpoint",
                path=str(path),
            )
    return dequantised(fmt, packed)


def _read_flat(
    reader: CheckpointReader, handle: AioHandle, unit: Any, lo: int, hi: int
) -> Iterator[torch.Tensor]:
    """Flat elements [lo, hi) of a unit's saved weights, in chunks (already checksummed by _stream_units)."""
    if unit.quant is not None:
        files = SourceFiles()
        try:
            s = unit.shard_numel
            for q in range(lo // s, -(-hi // s)):
                values = quantised_partition(reader, handle, unit, q, files)
                yield values[max(lo, q * s) - q * s : min(hi, (q + 1) * s) - q * s]
        finally:
            files.close()
        return
    if unit.source is not None:
        files = SourceFiles()
        try:
            buf = torch.empty(hi - lo, dtype=unit.dtype)
            files.read_unit(
                [(str(p), str(n)) for p, n in unit.source["tensors"]], unit.slots, lo, hi, buf
            )
            yield buf
        finally:
            files.close()
        return
    s = unit.shard_numel
    dt = FP32 if unit.trainable else unit.dtype
    step = CHUNK_NBYTES // dt.itemsize
    buf = torch.empty(min(step, hi - lo), dtype=dt)
    pos = lo
    while pos < hi:
        q = pos // s
        e = reader.entry(q, unit.saved_as, dt, s)
        n = min(hi, (q + 1) * s, pos + step) - pos
        handle.sync_pread(
            buf[:n], reader.open_part(q, handle), e.begin + (pos - q * s) * dt.itemsize
        )
        yield buf[:n]
        pos += n


def _stream_aliases(
    reader: CheckpointReader,
    handle: AioHandle,
    output: WeightFiles,
    dtype: torch.dtype,
    alias_of: list[tuple[str, tuple[int, int]]],
) -> None:
    conv = _convert(dtype)
    for _alias, (ui, k) in alias_of:
        u = reader.units[ui]
        slot = u.slots[k]
        for chunk in _read_flat(reader, handle, u, slot.offset, slot.offset + slot.numel):
            output.append(conv(chunk))


def _stream_passthrough(
    reader: CheckpointReader,
    handle: AioHandle,
    output: WeightFiles,
    dtype: torch.dtype,
    bar: Progress,
    *,
    aliases: bool,
) -> None:
    conv = _convert(dtype)
    params = reader.manifest["params"]
    order = [p["name"] for p in params] + (
        [a for p in params for a in p["aliases"][1:]] if aliases else []
    )
    source = {a: p for p in params for a in [p["name"], *p["aliases"]]}
    checks, dtypes = [], []
    for name in order:
        p = source[name]
        pdt = parse_dtype_name(p["dtype"], name)
        numel = 1
        for d in p["shape"]:
            numel *= d
        e = reader.entry(0, f"param.{p['name']}", pdt, numel)
        checks.append(
            Check(reader.part_path(0), reader.open_part(0, handle), e, reader.part_crc(0, e.name))
        )
        dtypes.append(pdt)
    read_tensors(
        handle,
        checks,
        progress=bar,
        on_chunk=lambda i, off, data: output.append(conv(data.view(dtypes[i]))),
    )


# -- from a live engine -------------------------------------------------------------


def save_16bit_model(
    engine: CheckpointTarget,
    save_dir: str | os.PathLike,
    save_filename: str = WEIGHTS_NAME,
    *,
    layout: str | None = None,
    max_shard_size: int | str | None = None,
    progress: bool | None = None,
) -> Path:
    """Rank 0 writes the live parameters, in the dtype they train in, and the buffers; under stage 3 every
    rank takes part in the gathers (every rank must call it). ``layout`` "hf" (the default for a
    transformers model, or when ``max_shard_size`` is given) makes ``save_dir`` a directory
    ``from_pretrained`` reads and returns it; "state_dict" (the default otherwise) writes the one file
    ``save_dir/save_filename`` and returns its path."""
    module = engine.module
    hf_cfg = hf_config(module)
    out = Path(save_dir) / save_filename
    chosen: Layout = "state_dict"

    def plan() -> tuple[Planned, tuple[TrainingParts, list[tuple[Any, Any]]]]:
        nonlocal chosen
        chosen = _choose_layout(layout, hf_cfg is not None, max_shard_size)
        engine.synchronize()  # the live values are those after an optimizer step still in flight
        if chosen == "state_dict":
            if out.suffix == ".safetensors" and engine.group.rank == 0:
                out.parent.mkdir(parents=True, exist_ok=True)  # as DeepSpeed's save_16bit_model
            _check_out_path(out)
        elif not save_filename.endswith(".safetensors"):
            raise ValueError(
                f"save_filename={save_filename!r} must end in .safetensors: this writes safetensors, "
                "never pickle"
            )
        names = HfNames.of(module) if chosen == "hf" else None
        max_nbytes = (
            parse_size(max_shard_size or DEFAULT_MAX_SHARD_SIZE) if chosen == "hf" else None
        )
        parts = engine.checkpoint_parts()
        segments, slots = _segments_live(engine, parts, names)
        files = Planned(
            Path(save_dir), segments, save_filename, max_nbytes, replace_stale=chosen == "hf"
        )
        return files, (parts, slots)

    with rank0_weight_files(engine.group, engine.config.aio, f"'{out}'", plan) as (
        (parts, slots),
        output,
    ):
        bar = Progress(
            output.total_nbytes if output else 0, f"save {out.name}", progress if output else False
        )
        with bar, torch_threads(1):
            append = output.append if output is not None else (lambda t: None)
            for full in _live_values(engine, parts, slots):
                append(full)
                bar.update(full.numel() * full.element_size())
            if output is not None:
                _, buffers = state_dict_names(module)
                for b in buffers.values():
                    append(b.detach().cpu().contiguous())
                output.commit()
                if hf_cfg is not None and chosen == "hf":
                    write_module_config_files(
                        Path(save_dir), module, hf_cfg, engine.dtype, nonce=output.nonce
                    )
    return Path(save_dir) if chosen == "hf" else out


def _segments_live(engine: CheckpointTarget, parts: TrainingParts, names: HfNames | None):
    """The stream's tensors and, per parameter tensor, where its values come from: (unit index, slot) or
    (None, param). ``names``: the HF layout (one name per parameter; the values of a name it drops are
    still gathered: every rank runs the same gathers), or None for every state_dict name."""
    sd_names, buffers = state_dict_names(engine.module)
    segments: list[Segment] = []
    slots: list[tuple[Any, Any]] = []  # (unit or None, slot index or param) in output order

    def name(aliases: list[str]) -> str | None:
        return aliases[0] if names is None else hf_name(names, aliases)

    if parts.passthrough is not None:
        params = [(sd_names.get(id(p), [f"<unnamed {i}>"]), p) for i, p in enumerate(parts.params)]
        segments += [Segment(name(n), p.dtype, tuple(p.shape)) for n, p in params]
        slots += [(None, p) for _, p in params]
        if names is None:
            for n, p in params:
                segments += [Segment(a, p.dtype, tuple(p.shape)) for a in n[1:]]
                slots += [(None, p)] * (len(n) - 1)
    else:
        infos = describe_units(engine.module, parts.units)
        for info in infos:
            segments += [Segment(name(list(s.aliases)), engine.dtype, s.shape) for s in info.slots]
            slots += [(info.index, k) for k in range(len(info.slots))]
        if names is None:
            for info in infos:
                for k, s in enumerate(info.slots):
                    segments += [Segment(a, engine.dtype, s.shape) for a in s.aliases[1:]]
                    slots += [(info.index, k)] * (len(s.aliases) - 1)
    segments += [Segment(name([n]), b.dtype, tuple(b.shape)) for n, b in buffers.items()]
    return segments, slots


def _live_values(
    engine: CheckpointTarget, parts: TrainingParts, slots: list[tuple[Any, Any]]
) -> Iterator[torch.Tensor]:
    """Each output parameter's values on CPU in output order; under stage 3 a unit is gathered once for
    its run of consecutive slots (every rank runs the same gathers)."""
    units = parts.units
    full, held = torch.empty(0), None
    for ui, k in slots:
        if ui is None:
            yield k.detach().cpu().contiguous()
            continue
        unit = units[ui]
        if parts.param_store is None:  # stages 0-2: the module holds every parameter whole
            yield unit.params[k].detach().cpu().contiguous()
            continue
        if held != ui:
            full = gather_unit(engine.group, parts.param_store, unit, parts.formats.get(unit.index))
            held = ui
        s = unit.layout.slots[k]
        yield full[s.offset : s.offset + s.numel]


def gather_unit(
    group: DataParallelGroup, store: TieredStore, unit: ParamUnit, fmt: ShardFormat | None = None
) -> torch.Tensor:
    """Stage 3: ``unit``'s full flat values on CPU, every rank's shard of ``store`` gathered (a
    collective: every rank calls it for the same unit). ``fmt``: the format a quantised frozen unit
    rests in; its shard is dequantised first (the values training saw)."""
    device = collective_device(group)
    shard = store.fetch(unit.key).result()
    try:
        values = shard if fmt is None else dequantised(fmt, shard)
        full = torch.empty(unit.layout.padded_numel, dtype=unit.layout.dtype, device=device)
        group.all_gather(full, values.to(device))
    finally:
        store.release(unit.key)
    return full.cpu()
