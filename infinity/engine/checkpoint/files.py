"""Checkpoint files without the stores: reading saved tensors to check them, appending to a new file.

- ``read_tensors`` / ``verify``: each saved tensor read whole through a ring
  of aligned buffers, chunks checksummed beside the reads and combined, and
  compared with the saved CRC32C (the first pass of a load; export's reader).
- ``StreamWriter``: appends bytes to a new file through aligned buffers
  written in order with O_DIRECT (export).
Memory: a few fixed buffers, whatever the file's size.

Threading: one caller thread; checksums on a small pool (crc.py).
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from infinity.aio import DIRECT_ALIGNMENT, AioError, AioFile, AioHandle, AioRequest, aligned_empty
from infinity.engine.checkpoint.atomic import space_error
from infinity.engine.checkpoint.crc import Checksummer, PendingCrc, crc32c_combine
from infinity.engine.checkpoint.errors import CheckpointCorruptError
from infinity.engine.checkpoint.progress import Progress
from infinity.engine.checkpoint.stream import io_error
from infinity.engine.checkpoint.window import as_bytes
from infinity.memory import round_up
from infinity.weights.header import Entry

CHUNK_NBYTES = 16 << 20
RING_DEPTH = 4


# -- verify -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Check:
    """A saved tensor whose CRC32C must be ``crc``."""

    path: str
    file: AioFile
    entry: Entry
    crc: int


def read_tensors(
    handle: AioHandle,
    checks: Sequence[Check],
    *,
    progress: Progress,
    on_chunk: Callable[[int, int, torch.Tensor], None] | None = None,
    chunk_nbytes: int = CHUNK_NBYTES,
    depth: int = RING_DEPTH,
) -> None:
    """Reads each checked tensor whole, in the order given, ``depth`` chunks in flight through a ring of
    aligned buffers, and compares its CRC32C (chunks are checksummed beside the reads and combined).
    ``on_chunk(check index, byte offset in the tensor, bytes)`` sees every chunk in order (the bytes are
    valid during the call only). Raises CheckpointCorruptError naming the first tensor and file that differ."""
    chunks = [
        (i, off, min(chunk_nbytes, c.entry.nbytes - off))
        for i, c in enumerate(checks)
        for off in range(0, c.entry.nbytes, chunk_nbytes)
    ]
    if not chunks:
        return
    ring = [
        aligned_empty(round_up(max(n for _, _, n in chunks), DIRECT_ALIGNMENT))
        for _ in range(min(depth, len(chunks)))
    ]
    busy: list[PendingCrc | None] = [None] * len(ring)  # a slot's checksum still reading it
    running: list[int | None] = [None] * len(checks)
    pending: collections.deque[tuple[AioRequest, int, tuple[int, int, int]]] = collections.deque()
    parts: collections.deque[tuple[PendingCrc, int, int, bool]] = (
        collections.deque()
    )  # (crc, check, nbytes, last)

    def combine(block: bool) -> None:
        while parts and (block or parts[0][0].done()):
            crc, i, n, last = parts.popleft()
            before = running[i]
            running[i] = crc.result() if before is None else crc32c_combine(before, crc.result(), n)
            c = checks[i]
            if last and running[i] != c.crc:
                raise CheckpointCorruptError(
                    f"checkpoint file '{c.path}' is corrupt: tensor {c.entry.name!r} (bytes {c.entry.begin}.."
                    f"{c.entry.end}) has CRC32C {running[i]:#010x}, but {c.crc:#010x} was saved; restore the "
                    "file from a copy or load another checkpoint",
                    path=c.path,
                )

    def finish() -> None:
        req, slot, (i, off, n) = pending.popleft()
        c = checks[i]
        try:
            req.wait()
        except AioError as e:
            raise CheckpointCorruptError(
                f"reading tensor {c.entry.name!r} from '{c.path}' failed: {e}", path=c.path
            ) from e
        data = ring[slot][:n]
        crc = busy[slot] = checksummer.submit(data)
        parts.append((crc, i, n, off + n == c.entry.nbytes))
        if on_chunk is not None:
            on_chunk(i, off, data)
        progress.update(n)
        combine(block=False)

    checksummer = Checksummer()
    try:
        for k, (i, off, n) in enumerate(chunks):
            if len(pending) == len(ring):
                finish()
            slot = k % len(ring)
            last_crc = busy[slot]
            if last_crc is not None:
                last_crc.result()  # its last chunk's checksum is done with the buffer
            c = checks[i]
            pending.append(
                (handle.pread(ring[slot][:n], c.file, c.entry.begin + off), slot, (i, off, n))
            )
        while pending:
            finish()
        combine(block=True)
    finally:
        for req, _, _ in pending:
            try:
                req.wait()
            except Exception:
                pass
        checksummer.close()


def verify(handle: AioHandle, checks: Sequence[Check], *, progress: Progress) -> None:
    """Reads every checked tensor once, in file order, and compares its CRC32C (changes nothing)."""
    read_tensors(handle, sorted(checks, key=lambda c: (c.path, c.entry.begin)), progress=progress)


# -- a new file, appended to --------------------------------------------------


class StreamWriter:
    """Appends bytes to a new file through ``depth`` aligned buffers written in order with O_DIRECT.

    ``close`` writes the last partial buffer padded to 4 KiB, truncates the file to the bytes
    appended and fsyncs it. Memory: ``depth x chunk_nbytes``, whatever the file's size.
    """

    def __init__(
        self,
        handle: AioHandle,
        path: Path,
        *,
        chunk_nbytes: int = CHUNK_NBYTES // 2,
        depth: int = RING_DEPTH,
    ):
        self.handle = handle
        self.path = path
        self.chunk = round_up(chunk_nbytes, DIRECT_ALIGNMENT)
        self.file = handle.open(path, "w", create=True)
        self.ring = [aligned_empty(self.chunk) for _ in range(depth)]
        self.pending: collections.deque[AioRequest] = collections.deque()
        self.slot = 0
        self.fill = 0
        self.offset = 0  # file offset of the current buffer's first byte

    @property
    def nbytes(self) -> int:
        return self.offset + self.fill

    def append(self, data: torch.Tensor | bytes) -> None:
        src = (
            np.frombuffer(data, dtype=np.uint8)
            if isinstance(data, (bytes, bytearray))
            else as_bytes(data).numpy()
        )
        pos, n = 0, src.size
        while pos < n:
            k = min(self.chunk - self.fill, n - pos)
            # numpy's memcpy: torch's copy_ runs several times slower on a busy 2-core VM (its OpenMP pool)
            np.copyto(self.ring[self.slot].numpy()[self.fill : self.fill + k], src[pos : pos + k])
            self.fill += k
            pos += k
            if self.fill == self.chunk:
                self._submit(self.chunk)

    def _submit(self, nbytes: int) -> None:
        try:
            self.pending.append(
                self.handle.pwrite(self.ring[self.slot][:nbytes], self.file, self.offset)
            )
            self.offset += self.fill
            self.fill = 0
            self.slot = (self.slot + 1) % len(self.ring)
            if len(self.pending) == len(self.ring):
                self.pending.popleft().wait()  # the buffer about to be filled again
        except AioError as e:
            raise io_error(e, self.path, self.chunk, f"'{self.path.name}'") from e

    def close(self) -> int:
        """Writes what is left, truncates to the true size, fsyncs; returns the file's size."""
        size = self.nbytes
        try:
            if self.fill:
                tail = self.fill
                self.ring[self.slot][tail : round_up(tail, DIRECT_ALIGNMENT)].zero_()
                self._submit(round_up(tail, DIRECT_ALIGNMENT))
            while self.pending:
                self.pending.popleft().wait()
            os.ftruncate(self.file.fileno(), size)
            os.fsync(self.file.fileno())
        except AioError as e:
            raise io_error(e, self.path, size, f"'{self.path.name}'") from e
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise space_error(self.path, size, f"'{self.path.name}'") from e
            raise
        finally:
            self.abort()
        return size

    def abort(self) -> None:
        while self.pending:
            try:
                self.pending.popleft().wait()
            except Exception:
                pass
        self.file.close()
