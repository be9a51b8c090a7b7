"""Tensors read from safetensors files into given memory, a stretch at a time, without mapping the file.

[Note: reading safetensors without mmap]
``safetensors.safe_open`` maps the whole file, and every page a tensor read
touches stays in the process's resident set until the file is closed: loading
a model that way makes the peak RSS the file's size, which a streamed load
exists to avoid. So headers are parsed by header.py and tensors are read with
``preadv`` into their destination (or, when the dtype changes, through one
small staging buffer): the page cache holds the file, not the process.

Threading: a TensorFiles is used by one thread.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from infinity.weights.header import Entry, read_header

STAGE_NBYTES = 8 << 20  # converting reads go through this much at a time


@dataclasses.dataclass(frozen=True)
class FileTensor:
    """One tensor of a safetensors file: the file, and where in it the tensor's bytes are."""

    path: Path
    entry: Entry

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def dtype(self) -> torch.dtype:
        return self.entry.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.entry.shape

    @property
    def numel(self) -> int:
        return self.entry.numel

    @property
    def nbytes(self) -> int:
        return self.entry.nbytes


def file_tensors(path: Path) -> dict[str, FileTensor]:
    """The tensors of the safetensors file at ``path``, in file order, every offset checked against its size."""
    return {name: FileTensor(path, e) for name, e in read_header(path).entries.items()}


class TensorFiles:
    """The open files of a checkpoint; reads a tensor's elements, converted, into a given tensor."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}
        self._stage = torch.empty(0, dtype=torch.uint8)

    def read(self, t: FileTensor, lo: int, hi: int, out: torch.Tensor) -> None:
        """Elements [lo, hi) of ``t``, flat, into ``out`` (contiguous, ``hi - lo`` elements, any dtype)."""
        if out.dtype == t.dtype:
            self._pread(t, lo, out)
            return
        step = max(1, STAGE_NBYTES // t.dtype.itemsize)
        flat = out.view(-1)
        for a in range(lo, hi, step):
            b = min(hi, a + step)
            nbytes = (b - a) * t.dtype.itemsize
            if self._stage.numel() < nbytes:
                self._stage = torch.empty(
                    max(nbytes, min(STAGE_NBYTES, t.nbytes)), dtype=torch.uint8
                )
            stage = self._stage[:nbytes].view(t.dtype)
            self._pread(t, a, stage)
            flat[a - lo : b - lo].copy_(stage)

    def read_whole(self, t: FileTensor, dest: torch.Tensor) -> None:
        """All of ``t`` into ``dest`` (its shape, any dtype and device)."""
        if dest.is_contiguous() and dest.device.type == "cpu":
            self.read(t, 0, t.numel, dest)
            return
        tmp = torch.empty(t.shape, dtype=dest.dtype)
        self.read(t, 0, t.numel, tmp)
        dest.copy_(tmp)

    def _pread(self, t: FileTensor, lo: int, out: torch.Tensor) -> None:
        fd = self._fds.get(t.path)
        if fd is None:
            fd = self._fds[t.path] = os.open(t.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        view = out.view(-1).view(torch.uint8).numpy().data
        offset, done = t.entry.begin + lo * t.dtype.itemsize, 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:
                raise OSError(
                    f"'{t.path}' ended at byte {offset + done} while reading tensor {t.name!r}: the file "
                    "changed or was truncated while loading"
                )
            done += n

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> TensorFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
