"""Full weights as safetensors files: one file, or Hugging Face's shards with their index.

The writers (export from a checkpoint, ``save_16bit_model`` from a live
engine) produce one stream of tensor bytes in a fixed order, described by
``Segment``s; ``WeightFiles`` cuts it into files. A segment without a name
is consumed and dropped (a tied parameter's second name, a key Hugging Face
does not save): the stream's order is the model's units', and skipping is
cheaper than reordering. The named segments go into one file, or into shards
of at most ``max_shard_nbytes`` of tensor data each, split as
huggingface_hub splits them (infinity.weights.hf_layout), with
``<name>.index.json`` naming each tensor's shard. That split gives a tensor
larger than the limit a shard of its own, numbered before the shard still
being filled: so a shard's file is open from its first byte in the stream to
its last, and two can be open at once (the one being filled, and a large
tensor's own).

Every file carries the ``{"format": "pt"}`` metadata transformers checks,
and is written under a temporary name through the aio engine (a few aligned
buffers, whatever its size) and fsynced; only when every shard is complete
are they renamed into place, then the index written, then the weight files
of an earlier save that this one did not replace removed (another shard
count: from_pretrained would read them). A failure before that leaves the
directory as it was.

Threading: one caller thread (the aio engine's workers do the writes).
"""

from __future__ import annotations

import dataclasses
import math
import os
import secrets
from collections.abc import Sequence
from pathlib import Path

import torch

from infinity.aio import AioHandle
from infinity.engine.checkpoint import atomic
from infinity.engine.checkpoint.files import StreamWriter
from infinity.engine.checkpoint.window import as_bytes
from infinity.weights.header import build_header
from infinity.weights.hf_layout import (
    index_json,
    index_name,
    shard_file_names,
    split_shards,
    stale_files,
)

METADATA = {"format": "pt"}  # transformers refuses a safetensors file without it


@dataclasses.dataclass(frozen=True)
class Segment:
    """One tensor of the stream: written as ``name``, or dropped when ``name`` is None."""

    name: str | None
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class WeightFiles:
    """The stream of ``segments`` cut into ``weights_name`` (or its shards) under ``directory``."""

    def __init__(
        self,
        directory: Path,
        handle: AioHandle,
        segments: Sequence[Segment],
        *,
        weights_name: str,
        max_shard_nbytes: int | None = None,
        replace_stale: bool = False,
    ):
        """``replace_stale``: remove the weight files of an earlier save this one does not overwrite
        (Hugging Face's layout, where from_pretrained would read them)."""
        self.directory = directory
        self.handle = handle
        self.segments = list(segments)
        self.weights_name = weights_name
        self.replace_stale = replace_stale
        named = [(s.name, s.nbytes) for s in self.segments if s.name is not None]
        if len({n for n, _ in named}) != len(named):
            raise ValueError(
                "a tensor name is written twice: "
                + ", ".join(sorted({n for n, _ in named if sum(m == n for m, _ in named) > 1}))
            )
        groups = (
            split_shards(named, max_shard_nbytes)
            if max_shard_nbytes is not None
            else [[n for n, _ in named]]
        )
        self.file_names = shard_file_names(weights_name, max(1, len(groups)))
        file_of = {n: k for k, names in enumerate(groups) for n in names}
        self._file_of_segment = [
            file_of.get(s.name) if s.name is not None else None for s in self.segments
        ]
        self._layouts: list[list[tuple[str, torch.dtype, tuple[int, ...]]]] = [
            [] for _ in self.file_names
        ]
        for s, k in zip(self.segments, self._file_of_segment, strict=True):
            if k is not None:
                self._layouts[k].append((s.name, s.dtype, s.shape))  # type: ignore[arg-type]
        self.headers = [build_header(layout, METADATA) for layout in self._layouts]
        self.nonce = secrets.token_hex(8)
        self.tmp_paths = [
            directory / f".{name}{atomic.PARTIAL}{self.nonce}" for name in self.file_names
        ]
        self.total_nbytes = sum(h.file_nbytes for _, h in self.headers)
        self._seg = 0  # the segment being streamed, and its bytes still to come
        self._left = self.segments[0].nbytes if self.segments else 0
        self._left_in_file = [
            sum(math.prod(shape) * dt.itemsize for _, dt, shape in layout)
            for layout in self._layouts
        ]
        self._writers: dict[int, StreamWriter] = {}  # the files open: begun and not yet complete
        self._closed: set[int] = set()
        self._skip_empty()

    # -- the stream ---------------------------------------------------------------

    def append(self, data: torch.Tensor) -> None:
        """The next bytes of the stream (any dtype; contiguous)."""
        raw = as_bytes(data)
        pos = 0
        while pos < raw.numel():
            if self._seg >= len(self.segments):
                raise RuntimeError(
                    f"{raw.numel() - pos} bytes appended past the last tensor of '{self.weights_name}'"
                )
            take = min(self._left, raw.numel() - pos)
            k = self._file_of_segment[self._seg]
            if k is not None:
                self._open(k).append(raw[pos : pos + take])
                self._left_in_file[k] -= take
                if self._left_in_file[k] == 0:
                    self._close(k)
            pos += take
            self._left -= take
            self._skip_empty()

    def _skip_empty(self) -> None:
        """Moves past finished segments (and past empty ones)."""
        while self._seg < len(self.segments) and self._left == 0:
            self._seg += 1
            if self._seg < len(self.segments):
                self._left = self.segments[self._seg].nbytes

    def _open(self, k: int) -> StreamWriter:
        writer = self._writers.get(k)
        if writer is None:
            if k in self._closed:
                raise RuntimeError(f"the stream reached shard {k + 1} after it was complete")
            writer = self._writers[k] = StreamWriter(self.handle, self.tmp_paths[k])
            writer.append(self.headers[k][0])
        return writer

    def _close(self, k: int) -> None:
        writer = self._writers.pop(k)
        self._closed.add(k)
        size = writer.close()
        want = self.headers[k][1].file_nbytes
        if size != want:
            raise RuntimeError(f"wrote {size} bytes to '{writer.path}', its header implies {want}")

    # -- the end ------------------------------------------------------------------

    def commit(self) -> list[Path]:
        """Renames every file into place (after the whole stream), writes the index of shards, removes
        stale weight files; returns the files written."""
        try:
            if self._seg < len(self.segments):
                raise RuntimeError(
                    f"the stream ended at tensor {self._seg} of {len(self.segments)} of "
                    f"'{self.weights_name}'"
                )
            for k in range(len(self.file_names)):  # files whose tensors are all empty: headers only
                if k not in self._closed:
                    self._open(k)
                    self._close(k)
            finals = [self.directory / name for name in self.file_names]
            for tmp, final in zip(self.tmp_paths, finals, strict=True):
                os.replace(tmp, final)
            if len(finals) > 1:
                weight_map = {
                    name: self.file_names[k]
                    for k, layout in enumerate(self._layouts)
                    for name, _, _ in layout
                }
                data = sum(h.file_nbytes - h.data_start for _, h in self.headers)
                atomic.replace_durably(
                    self.directory / index_name(self.weights_name),
                    index_json(weight_map, data).encode(),
                    "the weights index",
                    self.nonce,
                )
            atomic.fsync_path(self.directory, directory=True)
        except BaseException:
            self.abort()
            raise
        if self.replace_stale:
            written = [
                *self.file_names,
                *([index_name(self.weights_name)] if len(finals) > 1 else []),
            ]
            for stale in stale_files(self.directory, self.weights_name, written):
                stale.unlink()
        return finals

    def abort(self) -> None:
        """Removes what this save wrote under temporary names."""
        for writer in self._writers.values():
            writer.abort()
        self._writers.clear()
        for tmp in self.tmp_paths:
            try:
                tmp.unlink()
            except FileNotFoundError:
                pass
