"""Full-weight safetensors files: from a checkpoint directory (export) or from a live engine (save_16bit_model).

Both stream: a unit's flat values are read (or all-gathered) a chunk or a
unit at a time, converted, and appended to the output through a few aligned
buffers, so a model larger than host memory exports. The file is a standard
safetensors file holding every ``state_dict`` entry of the model (tied
parameters under each of their names, persistent buffers included): it loads
with ``safetensors.torch.load_file`` and ``model.load_state_dict(strict=True)``
into the plain PyTorch model. Like a checkpoint it appears atomically:
written under a temporary name, fsynced, renamed, directory fsynced.

DeepSpeed's counterparts: ``zero_to_fp32.py`` (export, fp32 from the
masters) and ``save_16bit_model`` / ``stage3_gather_16bit_weights_on_model_save``.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from infinity.aio import AioConfig, AioHandle
from infinity.engine.checkpoint import atomic
from infinity.engine.checkpoint.collective import agree, collective_device
from infinity.engine.checkpoint.files import CHUNK_NBYTES, Check, StreamWriter, read_tensors
from infinity.engine.checkpoint.format import build_header, parse_dtype_name
from infinity.engine.checkpoint.model import describe_units, state_dict_names
from infinity.engine.checkpoint.progress import Progress
from infinity.engine.checkpoint.reader import CheckpointReader
from infinity.engine.checkpoint.target import CheckpointTarget, TrainingParts
from infinity.engine.checkpoint.threads import torch_threads

log = logging.getLogger("infinity.checkpoint")

FP32 = torch.float32

# (name, dtype, shape) of each output tensor, in file order.
Layout = list[tuple[str, torch.dtype, tuple[int, ...]]]


def _check_out_path(out: Path) -> None:
    if out.suffix != ".safetensors":
        raise ValueError(f"the output '{out}' must end in .safetensors: this writes safetensors, never pickle")
    if not out.parent.is_dir():
        raise FileNotFoundError(f"the directory of '{out}' does not exist; create it first")


class _Output:
    """The output file under a temporary name until ``commit``."""

    def __init__(self, out: Path, handle: AioHandle, layout: Layout):
        self.out = out
        self.tmp = out.with_name(f".{out.name}{atomic.PARTIAL}{secrets.token_hex(8)}")
        blob, self.header = build_header(layout)
        self.writer = StreamWriter(handle, self.tmp)
        self.writer.append(blob)

    def commit(self) -> int:
        try:
            size = self.writer.close()
            if size != self.header.file_nbytes:
                raise RuntimeError(f"wrote {size} bytes to '{self.tmp}', the header implies {self.header.file_nbytes}")
            os.replace(self.tmp, self.out)
            atomic.fsync_path(self.out.parent, directory=True)
        except BaseException:
            self.abort()
            raise
        return size

    def abort(self) -> None:
        self.writer.abort()
        try:
            self.tmp.unlink()
        except FileNotFoundError:
            pass


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


# -- from a checkpoint directory --------------------------------------------------


def export_checkpoint(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    *,
    tag: str | None = None,
    dtype: torch.dtype = FP32,
    aio: AioConfig | None = None,
    progress: bool | None = None,
) -> Path:
    """Writes the full weights of a checkpoint (the fp32 masters, converted to ``dtype``) and its buffers to
    ``out`` (.safetensors). ``checkpoint``: a checkpoint directory, or a root with ``latest`` (or ``tag``)."""
    out = Path(out)
    _check_out_path(out)
    with CheckpointReader(checkpoint, tag) as reader, AioHandle.from_config(aio or AioConfig()) as handle:
        layout, units, alias_of = _layout_from_checkpoint(reader, dtype)
        output = _Output(out, handle, layout)
        try:
            with Progress(output.header.file_nbytes, f"export {reader.tag}", progress) as bar, torch_threads(1):
                if reader.manifest.get("optimizer") == "passthrough":
                    _stream_passthrough(reader, handle, output.writer, dtype, bar)
                else:
                    _stream_units(reader, handle, output.writer, dtype, bar, units)
                    _stream_aliases(reader, handle, output.writer, dtype, alias_of)
                buffers = reader.rank(0)[1]
                for name, bdtype, _shape in layout[len(layout) - len(reader.manifest["buffers"]):]:
                    output.writer.append(buffers[f"buffer.{name}"].to(bdtype).contiguous())
            size = output.commit()
        except BaseException:
            output.abort()
            raise
    log.info("exported '%s' to '%s' (%d tensors, %.2f GB)", reader.dir, out, len(layout), size / 1e9)
    return out


def _layout_from_checkpoint(reader: CheckpointReader, dtype: torch.dtype):
    """The output's tensors: each parameter under its first name (in unit order), then the other names of
    tied parameters, then the buffers."""
    layout: Layout = []
    alias_of: list[tuple[str, tuple[int, int]]] = []  # (alias, (unit, slot)) to write again
    m = reader.manifest
    if m.get("optimizer") == "passthrough":
        for p in m["params"]:
            layout.append((p["name"], dtype, tuple(p["shape"])))
        for p in m["params"]:
            layout += [(a, dtype, tuple(p["shape"])) for a in p["aliases"][1:]]
    else:
        for u in reader.units:
            layout += [(s.name, dtype, s.shape) for s in u.slots]
        for u in reader.units:
            for k, s in enumerate(u.slots):
                for a in s.aliases[1:]:
                    layout.append((a, dtype, s.shape))
                    alias_of.append((a, (u.index, k)))
    for name, b in m["buffers"].items():
        bdt = parse_dtype_name(b["dtype"], f"buffer {name}")
        layout.append((name, dtype if bdt.is_floating_point else bdt, tuple(b["shape"])))
    return layout, reader.units, alias_of


def _stream_units(reader: CheckpointReader, handle: AioHandle, writer: StreamWriter, dtype: torch.dtype,
                  bar: Progress, units: list[Any]) -> None:
    """Each unit's masters, partition after partition: flat elements [0, numel) are its slots end to end."""
    conv = _convert(dtype)
    checks: list[Check] = []
    flat_start: list[tuple[int, int]] = []  # (first flat element of the check's tensor, the unit's numel)
    for u in units:
        for q in range(reader.partitions):
            name = f"u{u.index}.master"
            e = reader.entry(q, name, FP32, u.shard_numel)
            checks.append(Check(reader.part_path(q), reader.open_part(q, handle), e, reader.part_crc(q, name)))
            flat_start.append((q * u.shard_numel, u.numel))

    def on_chunk(i: int, off: int, data: torch.Tensor) -> None:
        first, numel = flat_start[i]
        lo = first + off // 4
        n = min(data.numel() // 4, numel - lo)
        if n > 0:
            writer.append(conv(data[: n * 4].view(FP32)))

    read_tensors(handle, checks, progress=bar, on_chunk=on_chunk)


def _read_flat(reader: CheckpointReader, handle: AioHandle, unit: Any, lo: int, hi: int) -> Iterator[torch.Tensor]:
    """Flat elements [lo, hi) of a unit's master, in chunks (already checksummed by _stream_units)."""
    s = unit.shard_numel
    step = CHUNK_NBYTES // 4
    buf = torch.empty(min(step, hi - lo), dtype=FP32)
    pos = lo
    while pos < hi:
        q = pos // s
        e = reader.entry(q, f"u{unit.index}.master", FP32, s)
        n = min(hi, (q + 1) * s, pos + step) - pos
        handle.sync_pread(buf[:n], reader.open_part(q, handle), e.begin + (pos - q * s) * 4)
        yield buf[:n]
        pos += n


def _stream_aliases(reader: CheckpointReader, handle: AioHandle, writer: StreamWriter, dtype: torch.dtype,
                    alias_of: list[tuple[str, tuple[int, int]]]) -> None:
    conv = _convert(dtype)
    for _alias, (ui, k) in alias_of:
        u = reader.units[ui]
        slot = u.slots[k]
        for chunk in _read_flat(reader, handle, u, slot.offset, slot.offset + slot.numel):
            writer.append(conv(chunk))


def _stream_passthrough(reader: CheckpointReader, handle: AioHandle, writer: StreamWriter, dtype: torch.dtype,
                        bar: Progress) -> None:
    conv = _convert(dtype)
    params = reader.manifest["params"]
    order = [p["name"] for p in params] + [a for p in params for a in p["aliases"][1:]]
    source = {a: p for p in params for a in p["aliases"]}
    checks, dtypes = [], []
    for name in order:
        p = source[name]
        pdt = parse_dtype_name(p["dtype"], name)
        numel = 1
        for d in p["shape"]:
            numel *= d
        e = reader.entry(0, f"param.{p['name']}", pdt, numel)
        checks.append(Check(reader.part_path(0), reader.open_part(0, handle), e, reader.part_crc(0, e.name)))
        dtypes.append(pdt)
    read_tensors(handle, checks, progress=bar,
                 on_chunk=lambda i, off, data: writer.append(conv(data.view(dtypes[i]))))


# -- from a live engine -------------------------------------------------------------


def save_16bit_model(engine: CheckpointTarget, save_dir: str | os.PathLike, save_filename: str = "model.safetensors",
                     *, progress: bool | None = None) -> Path:
    """Rank 0 writes the live parameters, in the dtype they train in, and the buffers to
    ``save_dir/save_filename``; under stage 3 every rank takes part in the gathers (every rank must call it)."""
    out = Path(save_dir) / save_filename
    group = engine.group
    err = None
    output = None
    handle = None
    try:
        engine.synchronize()  # the live values are those after an optimizer step still in flight
        _check_out_path(out)
        parts = engine.checkpoint_parts()
        layout, slots = _layout_live(engine, parts)
        if group.rank == 0:
            handle = AioHandle.from_config(engine.config.aio)
            output = _Output(out, handle, layout)
    except Exception as e:
        err = e
    agree(group, err, f"starting to write '{out}'")
    err = None
    try:
        bar = Progress(output.header.file_nbytes if output else 0, f"save {out.name}", progress if output else False)
        with bar, torch_threads(1):
            append = output.writer.append if output is not None else (lambda t: None)
            for full in _live_values(engine, parts, slots):
                append(full)
                bar.update(full.numel() * full.element_size())
            if output is not None:
                _, buffers = state_dict_names(engine.module)
                for b in buffers.values():
                    append(b.detach().cpu().contiguous())
                output.commit()
                output = None
    except Exception as e:
        err = e
    finally:
        if output is not None:
            output.abort()
        if handle is not None:
            handle.close()
    agree(group, err, f"writing '{out}'")
    return out


def _layout_live(engine: CheckpointTarget, parts: TrainingParts):
    names, buffers = state_dict_names(engine.module)
    layout: Layout = []
    slots = []  # (unit or None, slot index or param, alias?) in output order
    if parts.passthrough is not None:
        params = [(names.get(id(p), [f"<unnamed {i}>"]), p) for i, p in enumerate(parts.params)]
        layout += [(n[0], p.dtype, tuple(p.shape)) for n, p in params]
        slots += [(None, p) for _, p in params]
        for n, p in params:
            layout += [(a, p.dtype, tuple(p.shape)) for a in n[1:]]
            slots += [(None, p)] * (len(n) - 1)
    else:
        infos = describe_units(engine.module, parts.units)
        for info in infos:
            layout += [(s.name, engine.dtype, s.shape) for s in info.slots]
            slots += [(info.index, k) for k in range(len(info.slots))]
        for info in infos:
            for k, s in enumerate(info.slots):
                layout += [(a, engine.dtype, s.shape) for a in s.aliases[1:]]
                slots += [(info.index, k)] * (len(s.aliases) - 1)
    layout += [(n, b.dtype, tuple(b.shape)) for n, b in buffers.items()]
    return layout, slots


def _live_values(engine: CheckpointTarget, parts: TrainingParts,
                 slots: list[tuple[Any, Any]]) -> Iterator[torch.Tensor]:
    """Each output parameter's values on CPU in output order; under stage 3 a unit is gathered once for
    its run of consecutive slots (every rank runs the same gathers)."""
    units = parts.units
    full, held = None, None
    for ui, k in slots:
        if ui is None:
            yield k.detach().cpu().contiguous()
            continue
        unit = units[ui]
        if parts.param_store is None:  # stages 0-2: the module holds every parameter whole
            yield unit.params[k].detach().cpu().contiguous()
            continue
        if held != ui:
            full = _gather_unit(engine, parts, unit)
            held = ui
        s = unit.layout.slots[k]
        yield full[s.offset : s.offset + s.numel]


def _gather_unit(engine: CheckpointTarget, parts: TrainingParts, unit: Any) -> torch.Tensor:
    store = parts.param_store
    device = collective_device(engine.group)
    shard = store.fetch(unit.key).result()
    try:
        full = torch.empty(unit.layout.padded_numel, dtype=unit.layout.dtype, device=device)
        engine.group.all_gather(full, shard.to(device))
    finally:
        store.release(unit.key)
    return full.cpu()
