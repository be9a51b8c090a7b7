"""Where a frozen unit's weights come from, so that a checkpoint can name the files instead of copying them.

[Note: frozen units in a checkpoint]
A frozen unit ([Note: frozen units] in infinity/estimate/runtime_plan.py) has
no master and no moments: its only state is its weights. A LoRA run's base
and a distillation's teacher are such units, and usually they are exactly
what a pretrained directory holds. So save_checkpoint writes, per frozen unit,
one of two things:
- a reference (``UnitSource``): every parameter of the unit was read from a
  safetensors file by ``load_pretrained`` (or ``from_pretrained`` under
  ``zero.Init``) before ``initialize``, and the unit's values are still those
  (the CRC32C of each rank's shard, in the training dtype, taken as
  ``initialize`` moved the unit home, equals the CRC32C of the shard at the
  save, on every rank). The manifest names the files with a fingerprint
  (size, modification time, CRC32C of the safetensors header), and each rank
  file keeps its shard's CRC32C;
- else its weights once: each partition's shard as ``u<i>.param``, in the
  dtype it trains in.
A load reads a referenced unit from its files (nothing, when this engine's
unit already comes from the same files and holds the same values), after
checking that every file is there with its fingerprint, and, where the
partitioning is unchanged, that the shard read has the saved CRC32C: a file
missing or changed is refused naming it, before anything is loaded.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from infinity.aio import crc32c
from infinity.engine.checkpoint.errors import CheckpointMismatchError, CheckpointNotFoundError
from infinity.weights.header import read_header_bytes
from infinity.weights.reader import TensorFiles, file_tensors


@dataclasses.dataclass(frozen=True)
class FileFingerprint:
    """What identifies a weights file's content without reading its data."""

    nbytes: int
    mtime_ns: int
    header_crc32c: int

    @classmethod
    def of(cls, path: str | os.PathLike) -> FileFingerprint:
        st = os.stat(path)
        header, _ = read_header_bytes(str(path))
        return cls(st.st_size, st.st_mtime_ns, crc32c(header))

    def to_json(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> FileFingerprint:
        return cls(int(d["nbytes"]), int(d["mtime_ns"]), int(d["header_crc32c"]))


@dataclasses.dataclass(frozen=True)
class UnitSource:
    """A frozen unit's weights as files hold them: per parameter (slot order) the file and tensor name."""

    tensors: tuple[tuple[str, str], ...]  # (absolute path, tensor name in the file) per slot
    files: dict[str, FileFingerprint]
    shard_crc32c: int  # this rank's shard, in the training dtype, as initialize moved it home

    def reference_json(self) -> dict[str, Any]:
        return {"tensors": [list(t) for t in self.tensors]}


def source_of(file_tensors: Sequence[Any], shard: torch.Tensor) -> UnitSource:
    """The UnitSource of a unit whose parameters were read from ``file_tensors`` (load_pretrained's
    FileTensor of each slot) and whose shard on this rank is ``shard`` (training dtype)."""
    paths = sorted({str(Path(t.path).resolve()) for t in file_tensors})
    return UnitSource(
        tuple((str(Path(t.path).resolve()), t.name) for t in file_tensors),
        {p: FileFingerprint.of(p) for p in paths},
        shard_crc(shard),
    )


def shard_crc(shard: torch.Tensor) -> int:
    return crc32c(shard.detach().contiguous().view(torch.uint8))


def check_files(files: dict[str, Any], unit_name: str) -> None:
    """Every file a reference names is there and unchanged (its saved fingerprint); raises naming it."""
    for path, saved in files.items():
        want = FileFingerprint.from_json(saved)
        try:
            got = FileFingerprint.of(path)
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                f"the frozen weights of {unit_name!r} are not in the checkpoint: it refers to '{path}', which is "
                "missing; put the pretrained files back where they were when the checkpoint was saved"
            ) from None
        except ValueError as e:
            raise CheckpointMismatchError(
                f"the frozen weights of {unit_name!r} come from '{path}', which is no longer a safetensors file "
                f"({e}); restore the file the checkpoint was saved with"
            ) from None
        if got != want:
            raise CheckpointMismatchError(
                f"the frozen weights of {unit_name!r} come from '{path}', which changed since the checkpoint was "
                f"saved ({_difference(want, got)}); restore the file the checkpoint was saved with"
            )


def _difference(want: FileFingerprint, got: FileFingerprint) -> str:
    if want.nbytes != got.nbytes:
        return f"{got.nbytes} bytes, {want.nbytes} when saved"
    if want.header_crc32c != got.header_crc32c:
        return "its tensors' names, shapes or offsets differ"
    return "modified after the save"


class SourceFiles:
    """The files frozen units are read back from: headers parsed once, each tensor's shape checked
    against the parameter it fills."""

    def __init__(self) -> None:
        self._files = TensorFiles()
        self._headers: dict[str, dict[str, Any]] = {}

    def tensor(self, path: str, name: str, shape: tuple[int, ...]) -> Any:
        if path not in self._headers:
            self._headers[path] = file_tensors(Path(path))
        t = self._headers[path].get(name)
        if t is None or tuple(t.shape) != tuple(shape):
            got = "no such tensor" if t is None else f"shape {list(t.shape)}"
            raise CheckpointMismatchError(
                f"'{path}' holds {got} under {name!r}, where the checkpoint expects shape {list(shape)}: the file "
                "changed since the checkpoint was saved; restore the file the checkpoint was saved with"
            )
        return t

    def read_tensor(self, t: Any, lo: int, hi: int, out: torch.Tensor) -> None:
        """Elements [lo, hi) of file tensor ``t`` (from ``tensor``) into ``out``, converted to its dtype."""
        self._files.read(t, lo, hi, out)

    def read_unit(
        self,
        tensors: Sequence[tuple[str, str]],
        slots: Sequence[Any],
        lo: int,
        hi: int,
        out: torch.Tensor,
    ) -> None:
        """Flat elements [lo, hi) of a unit (slots end to end, zeros in the padding) into ``out``."""
        out.zero_()
        for (path, name), s in zip(tensors, slots, strict=True):
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a < b:
                self._files.read(
                    self.tensor(path, name, tuple(s.shape)),
                    a - s.offset,
                    b - s.offset,
                    out[a - lo : b - lo],
                )

    def close(self) -> None:
        self._files.close()
