"""Tensors between the tiered stores and checkpoint files, through the aio engine, a unit at a time.

- ``write_part``: store keys (or plain tensors) → one safetensors file. Each
  key is fetched (read from swap if it lives on NVMe), written from the very
  pool memory it was fetched into (O_DIRECT, no copy), and checksummed beside
  the write.
- ``read_into``: checkpoint files → store keys fetched with ``overwrite``
  (no read from swap), checksummed as they land, then written home by
  eviction.
Both run on window.py's pipeline, bounded by pool room and bytes in flight
([Note: pool room]), whatever the model's size.

Threading: each mover runs on its caller's thread; checksums on a small pool (crc.py).
"""

from __future__ import annotations

import dataclasses
import errno
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from infinity.aio import DIRECT_ALIGNMENT, AioError, AioFile, AioHandle, aligned_empty
from infinity.engine.checkpoint.atomic import space_error
from infinity.engine.checkpoint.crc import Checksummer, PendingCrc
from infinity.engine.checkpoint.errors import CheckpointCorruptError
from infinity.engine.checkpoint.format import FILE_MODE
from infinity.engine.checkpoint.progress import Progress
from infinity.engine.checkpoint.window import (
    DEFAULT_INFLIGHT_NBYTES,
    FollowUp,
    Holding,
    Job,
    StoreRef,
    Window,
    as_bytes,
)
from infinity.memory import round_up
from infinity.weights.header import Entry


def io_error(e: AioError, path: Path | str, nbytes: int, what: str) -> BaseException:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return space_error(path, nbytes, what)
    return e


# -- save ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SaveItem:
    """One tensor of a part file and where its bytes come from: a store key, or a host tensor."""

    entry: Entry
    ref: StoreRef | None = None
    tensor: torch.Tensor | None = None


def _host_tensor(tensor: torch.Tensor | None, name: str) -> torch.Tensor:
    """An item's host tensor, where it has no store key."""
    if tensor is None:
        raise ValueError(f"{name}: an item needs a store key or a host tensor, and has neither")
    return tensor


def create_allocated(path: Path, nbytes: int, what: str) -> None:
    """Creates ``path`` with ``nbytes`` allocated on disk, so that a full disk is found before any write."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise space_error(path, nbytes, what) from e
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise  # a file system without fallocate reports a full disk at write time instead
    finally:
        os.close(fd)


def write_part(
    handle: AioHandle,
    path: Path,
    header: bytes,
    groups: Iterable[Sequence[SaveItem]],
    *,
    file_nbytes: int,
    progress: Progress,
    max_inflight_nbytes: int = DEFAULT_INFLIGHT_NBYTES,
) -> dict[str, int]:
    """Writes ``header`` then every group's tensors at their entries' offsets; fsyncs. Returns CRC32C by name."""
    what = f"checkpoint file '{path.name}'"
    create_allocated(path, file_nbytes, what)
    crcs: dict[str, int] = {}
    f = handle.open(path, "w", create=False)
    window = Window(max_inflight_nbytes)
    checksummer = Checksummer()
    try:
        head = aligned_empty(round_up(len(header), DIRECT_ALIGNMENT))
        head[: len(header)].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        window.add(Job(handle.pwrite(head[: len(header)], f, 0), None, len(header), None, "header"))
        for group in groups:
            refs = [it.ref for it in group if it.ref is not None]
            nbytes = sum(it.entry.nbytes for it in group)
            window.make_room(refs, nbytes)
            holding = Holding(refs, overwrite=False) if refs else None
            views = iter(holding.views()) if holding is not None else iter(())
            items = []
            pending = {}
            try:
                for it in group:
                    t = (
                        next(views)
                        if it.ref is not None
                        else _host_tensor(it.tensor, it.entry.name).detach().cpu().contiguous()
                    )
                    b = as_bytes(t)
                    if b.numel() != it.entry.nbytes:
                        raise RuntimeError(
                            f"{it.entry.name}: {b.numel()} bytes in memory, {it.entry.nbytes} planned"
                        )
                    # Checksummed beside the write (both only read the memory), off this thread.
                    pending[it.entry.name] = checksummer.submit(b)
                    items.append((b, it.entry.begin))
                req = handle.pwrite_many(items, f)
            except BaseException:
                for p in pending.values():
                    p.result()
                if holding is not None:
                    holding.release(window.evictions)
                raise

            def on_done(n=nbytes, pending=pending) -> None:
                for name, p in pending.items():
                    crcs[name] = p.result()  # before the holding is released
                progress.update(n)

            window.add(Job(req, holding, nbytes, on_done, group[0].entry.name))
            window.retire_done()
        window.drain()
        os.fsync(f.fileno())
    except AioError as e:
        checksummer.close()  # checksums still running read memory that abort() releases
        window.abort()
        raise io_error(e, path, file_nbytes, what) from e
    except BaseException:
        checksummer.close()
        window.abort()
        raise
    finally:
        checksummer.close()
        f.close()
    return crcs


# -- load ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Piece:
    """Bytes [offset, offset + nbytes) of ``file`` go to byte ``dest`` of the destination."""

    file: AioFile
    offset: int
    dest: int
    nbytes: int


@dataclasses.dataclass
class LoadItem:
    """One destination (a store key fetched with overwrite, or a host tensor) and the pieces that fill it.
    Bytes no piece covers are zeroed (padding). ``crc``: the saved CRC32C where the destination is
    exactly one saved tensor, checked again after the read."""

    name: str
    nbytes: int
    pieces: list[Piece]
    ref: StoreRef | None = None
    tensor: torch.Tensor | Callable[[], torch.Tensor] | None = None
    """A host tensor, or what makes one when the group's turn comes (host memory held only while the
    group is in flight)."""
    crc: int | None = None
    path: str = ""

    def destination(self) -> torch.Tensor | None:
        return self.tensor() if callable(self.tensor) else self.tensor


@dataclasses.dataclass
class LoadGroup:
    items: list[LoadItem]
    after: Callable[[list[torch.Tensor]], None] | None = None
    """Called with the filled destinations while they are still held (e.g. to derive 16-bit copies)."""


def _zero_gaps(b: torch.Tensor, pieces: Sequence[Piece]) -> None:
    pos = 0
    for p in sorted(pieces, key=lambda p: p.dest):
        if p.dest > pos:
            b[pos : p.dest].zero_()
        pos = max(pos, p.dest + p.nbytes)
    if pos < b.numel():
        b[pos:].zero_()


class _Landed:
    """A group read in: its checksums run beside the next reads; then it is compared and derived from."""

    def __init__(
        self,
        sums: list[tuple[LoadItem, PendingCrc]],
        dests: list[torch.Tensor],
        after: Callable[[list[torch.Tensor]], None] | None,
        count: Callable[[], None],
    ):
        self.sums, self.dests, self.after, self.count = sums, dests, after, count

    def done(self) -> bool:
        return all(p.done() for _, p in self.sums)

    def complete(self) -> None:
        for it, p in self.sums:
            got = p.result()
            if got != it.crc:
                raise CheckpointCorruptError(
                    f"tensor {it.name!r} in '{it.path}' read back with CRC32C {got:#010x}, but "
                    f"{it.crc:#010x} was saved: the file changed after it was verified, or the "
                    "drive returned bad data. The engine's state is now partly loaded: load a "
                    "checkpoint again before training on",
                    path=it.path,
                )
        if self.after is not None:
            self.after(self.dests)
        self.count()

    def wait_quietly(self) -> None:
        for _, p in self.sums:
            try:
                p.result()
            except Exception:
                pass


def read_into(
    handle: AioHandle,
    groups: Iterable[LoadGroup],
    *,
    progress: Progress,
    max_inflight_nbytes: int = DEFAULT_INFLIGHT_NBYTES,
) -> None:
    """Fills every group's destinations from the files, then writes store keys home (waits for it)."""
    window = Window(max_inflight_nbytes)
    checksummer = Checksummer()
    try:
        for group in groups:
            refs = [it.ref for it in group.items if it.ref is not None]
            nbytes = sum(it.nbytes for it in group.items)
            window.make_room(refs, nbytes)
            holding = Holding(refs, overwrite=True) if refs else None
            try:
                views = iter(holding.views()) if holding is not None else iter(())
                dests = [
                    next(views) if it.ref is not None else _host_tensor(it.destination(), it.name)
                    for it in group.items
                ]
                reads: list[tuple[torch.Tensor, AioFile, int]] = []
                for it, d in zip(group.items, dests, strict=True):
                    b = as_bytes(d)
                    if b.numel() != it.nbytes:
                        raise RuntimeError(
                            f"{it.name}: {b.numel()} bytes in memory, {it.nbytes} planned"
                        )
                    _zero_gaps(b, it.pieces)
                    reads.extend(
                        (b[p.dest : p.dest + p.nbytes], p.file, p.offset) for p in it.pieces
                    )
                req = handle.pread_many(reads) if reads else None
            except BaseException:
                if holding is not None:
                    holding.release(window.evictions)
                raise

            def on_done(items=group.items, dests=dests, after=group.after, n=nbytes) -> FollowUp:
                sums = [
                    (it, checksummer.submit(as_bytes(d)))
                    for it, d in zip(items, dests, strict=True)
                    if it.crc is not None
                ]
                return _Landed(sums, dests, after, lambda: progress.update(n))

            window.add(
                Job(req, holding, nbytes, on_done, group.items[0].name if group.items else "")
            )
            window.retire_done()
        window.drain()
    except BaseException:
        window.abort()
        raise
    finally:
        checksummer.close()
