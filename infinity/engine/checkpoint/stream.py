"""Tensors between the tiered stores and checkpoint files, through the aio engine, a unit at a time.

Three movers, all bounded in memory whatever the model's size:
- ``write_part``: store keys (or plain tensors) → one safetensors file. Each
  key is fetched (read from swap if it lives on NVMe), its CRC32C taken, and
  written from the very pool memory it was fetched into (O_DIRECT, no copy).
- ``read_into``: checkpoint files → store keys fetched with ``overwrite``
  (no read from swap), then written home by eviction.
- ``verify``: reads saved tensors through a small ring of aligned buffers and
  checks their CRC32C, touching no state (the first pass of a load).
``StreamWriter`` appends bytes to a new file through aligned buffers (export).

[Note: pool room]
Keys are held from their fetch until their I/O completes, so the pipeline
holds pool memory while writes are in flight. A fetch that would have to
wait for pool space is issued only when the pipeline holds nothing in that
store or the pool can serve it now; otherwise the oldest job is completed
(and its keys released and evicted) first. The pipeline so never waits for
room that it holds itself, and at most ``max_inflight_nbytes`` are in flight.

Threading: each mover runs on its caller's thread; completions are awaited
there too (the store's reaper thread only resolves store futures).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import os
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from infinity.aio import AioError, AioFile, AioHandle, AioRequest, aligned_empty
from infinity.engine.checkpoint.atomic import space_error
from infinity.engine.checkpoint.crc import Checksummer, PendingCrc, crc32c_combine
from infinity.engine.checkpoint.errors import CheckpointCorruptError
from infinity.engine.checkpoint.format import ALIGN, Entry, round_up
from infinity.engine.checkpoint.progress import Progress
from infinity.store import Residency, StoreFuture, TieredStore

DEFAULT_INFLIGHT_NBYTES = 64 << 20  # 1 MiB pieces at queue depth 32, twice over
CHUNK_NBYTES = 16 << 20
RING_DEPTH = 4


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view."""
    return t.reshape(-1).view(torch.uint8)


@dataclasses.dataclass(frozen=True)
class StoreRef:
    store: TieredStore
    key: Hashable


def _by_store(refs: Sequence[StoreRef]) -> list[tuple[TieredStore, list[Hashable]]]:
    groups: dict[int, tuple[TieredStore, list[Hashable]]] = {}
    for r in refs:
        groups.setdefault(id(r.store), (r.store, []))[1].append(r.key)
    return list(groups.values())


def _room_needed(store: TieredStore, keys: Sequence[Hashable]) -> int:
    total = 0
    for k in keys:
        spec = store.spec(k)
        if spec.home == "nvme" and spec.state is Residency.AT_REST:
            total += round_up(spec.nbytes)
    return total


class _Holding:
    """The keys of one job, held in their stores from fetch until the job's I/O is over."""

    def __init__(self, refs: Sequence[StoreRef], *, overwrite: bool):
        self.refs = list(refs)
        self.overwrite = overwrite
        self.at_rest = [r.store.spec(r.key).state is Residency.AT_REST for r in self.refs]
        self._held = [False] * len(self.refs)
        self.futures: list[StoreFuture] = []
        self._order: list[int] = []  # ref index of each future
        by_store: dict[int, tuple[TieredStore, list[int]]] = {}
        for i, r in enumerate(self.refs):
            by_store.setdefault(id(r.store), (r.store, []))[1].append(i)
        try:
            for store, idx in by_store.values():
                self.futures.extend(store.fetch_many([self.refs[i].key for i in idx], overwrite=overwrite))
                self._order.extend(idx)
        except BaseException:
            self._settle()
            self.release([])
            raise

    def _settle(self) -> BaseException | None:
        """Waits for every fetch issued; marks the ones that succeeded as held; returns the first error."""
        first = None
        for fut, i in zip(self.futures, self._order, strict=True):
            if self._held[i]:
                continue
            try:
                fut.result()
                self._held[i] = True
            except Exception as e:  # every future must be awaited
                first = first or e
        return first

    def views(self) -> list[torch.Tensor]:
        """Waits for every fetch; on a failure releases the ones that succeeded and raises it."""
        first = self._settle()
        if first is not None:
            self.release([])
            raise first
        got: list[torch.Tensor | None] = [None] * len(self.refs)
        for fut, i in zip(self.futures, self._order, strict=True):
            got[i] = fut.result()
        return got  # type: ignore[return-value]

    def release(self, evictions: list[StoreFuture]) -> None:
        """Drops the holds; evicts keys that live on NVMe and were brought in (or overwritten) here."""
        held = [(r, rest) for r, rest, h in zip(self.refs, self.at_rest, self._held, strict=True) if h]
        self._held = [False] * len(self.refs)
        for store, keys in _by_store([r for r, _ in held]):
            store.release_many(keys)
        for r, rest in held:
            spec = r.store.spec(r.key)
            if spec.home == "nvme" and spec.holds == 0 and (self.overwrite or rest):
                evictions.append(r.store.evict(r.key))


class FollowUp(Protocol):
    """Work a job still has after its I/O, running off this thread (a checksum); ``complete`` finishes it
    on this thread (compare, derive) once ``done``."""

    def done(self) -> bool: ...

    def complete(self) -> None: ...

    def wait_quietly(self) -> None:
        """Waits until nothing runs over the job's memory any more (after a failure elsewhere)."""
        ...


@dataclasses.dataclass
class _Job:
    request: AioRequest | None
    holding: _Holding | None
    nbytes: int
    on_done: Callable[[], FollowUp | None] | None  # after the I/O; may hand back a follow-up
    what: str
    follow: FollowUp | None = None

    def done(self) -> bool:
        return self.request is None or self.request.done()


class _Window:
    """Jobs in flight, completed in order (see [Note: pool room]). A job whose ``on_done`` hands back a
    FollowUp waits in ``checking``, keeping its keys, until that is done; follow-ups complete in order."""

    def __init__(self, max_nbytes: int):
        self.max_nbytes = max_nbytes
        self.jobs: collections.deque[_Job] = collections.deque()
        self.checking: collections.deque[_Job] = collections.deque()
        self.nbytes = 0
        self.holding_in: collections.Counter[int] = collections.Counter()
        self.evictions: list[StoreFuture] = []

    def make_room(self, refs: Sequence[StoreRef], nbytes: int) -> None:
        while self.jobs or self.checking:
            fits = self.nbytes + nbytes <= self.max_nbytes and all(
                not self.holding_in[id(store)] or store.pool.can_serve(_room_needed(store, keys))
                for store, keys in _by_store(refs)
            )
            if fits:
                return
            self._step()

    def _step(self) -> None:
        """Finishes the oldest follow-up if the oldest job has none to wait for, else retires that job."""
        if self.checking and (not self.jobs or self.checking[0].follow.done()):
            self._complete(self.checking.popleft())
        else:
            self.retire_oldest()

    def add(self, job: _Job) -> None:
        self.jobs.append(job)
        self.nbytes += job.nbytes
        if job.holding is not None:
            for store, _ in _by_store(job.holding.refs):
                self.holding_in[id(store)] += 1

    def _forget(self, job: _Job) -> None:
        self.nbytes -= job.nbytes
        if job.holding is not None:
            for store, _ in _by_store(job.holding.refs):
                self.holding_in[id(store)] -= 1
            job.holding.release(self.evictions)

    def retire_oldest(self) -> None:
        job = self.jobs.popleft()
        try:
            if job.request is not None:
                job.request.wait()
            job.follow = job.on_done() if job.on_done is not None else None
        except BaseException:
            self._forget(job)
            raise
        if job.follow is not None:
            self.checking.append(job)
        else:
            self._forget(job)

    def _complete(self, job: _Job) -> None:
        try:
            job.follow.complete()
        finally:
            self._forget(job)

    def retire_done(self) -> None:
        while True:
            if self.jobs and self.jobs[0].done():
                self.retire_oldest()
            elif self.checking and self.checking[0].follow.done():
                self._complete(self.checking.popleft())
            else:
                return

    def drain(self) -> None:
        while self.jobs:
            self.retire_oldest()
        while self.checking:
            self._complete(self.checking.popleft())
        for fut in self.evictions:
            fut.result()
        self.evictions.clear()

    def abort(self) -> None:
        """After a failure: waits for everything in flight (ignoring its errors) and releases every hold."""
        while self.jobs:
            job = self.jobs.popleft()
            if job.request is not None:
                try:
                    job.request.wait()
                except Exception:
                    pass
            self.checking.append(job)
        while self.checking:
            job = self.checking.popleft()
            if job.follow is not None:
                job.follow.wait_quietly()
            self._forget(job)
        for fut in self.evictions:
            try:
                fut.result()
            except Exception:
                pass
        self.evictions.clear()


def _io_error(e: AioError, path: Path | str, nbytes: int, what: str) -> BaseException:
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


def create_allocated(path: Path, nbytes: int, what: str) -> None:
    """Creates ``path`` with ``nbytes`` allocated on disk, so that a full disk is found before any write."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
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
    window = _Window(max_inflight_nbytes)
    checksummer = Checksummer()
    try:
        head = aligned_empty(round_up(len(header), ALIGN))
        head[: len(header)].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        window.add(_Job(handle.pwrite(head[: len(header)], f, 0), None, len(header), None, "header"))
        for group in groups:
            refs = [it.ref for it in group if it.ref is not None]
            nbytes = sum(it.entry.nbytes for it in group)
            window.make_room(refs, nbytes)
            holding = _Holding(refs, overwrite=False) if refs else None
            views = iter(holding.views()) if holding is not None else iter(())
            items = []
            pending = {}
            try:
                for it in group:
                    t = next(views) if it.ref is not None else it.tensor.detach().cpu().contiguous()
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

            window.add(_Job(req, holding, nbytes, on_done, group[0].entry.name))
            window.retire_done()
        window.drain()
        os.fsync(f.fileno())
    except AioError as e:
        checksummer.close()  # checksums still running read memory that abort() releases
        window.abort()
        raise _io_error(e, path, file_nbytes, what) from e
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
    tensor: torch.Tensor | None = None
    crc: int | None = None
    path: str = ""


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

    def __init__(self, sums: list[tuple[LoadItem, PendingCrc]], dests: list[torch.Tensor],
                 after: Callable[[list[torch.Tensor]], None] | None, count: Callable[[], None]):
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
    window = _Window(max_inflight_nbytes)
    checksummer = Checksummer()
    try:
        for group in groups:
            refs = [it.ref for it in group.items if it.ref is not None]
            nbytes = sum(it.nbytes for it in group.items)
            window.make_room(refs, nbytes)
            holding = _Holding(refs, overwrite=True) if refs else None
            try:
                views = iter(holding.views()) if holding is not None else iter(())
                dests = [next(views) if it.ref is not None else it.tensor for it in group.items]
                reads = []
                for it, d in zip(group.items, dests, strict=True):
                    b = as_bytes(d)
                    if b.numel() != it.nbytes:
                        raise RuntimeError(f"{it.name}: {b.numel()} bytes in memory, {it.nbytes} planned")
                    _zero_gaps(b, it.pieces)
                    reads.extend((b[p.dest : p.dest + p.nbytes], p.file, p.offset) for p in it.pieces)
                req = handle.pread_many(reads) if reads else None
            except BaseException:
                if holding is not None:
                    holding.release(window.evictions)
                raise

            def on_done(items=group.items, dests=dests, after=group.after, n=nbytes) -> FollowUp:
                sums = [(it, checksummer.submit(as_bytes(d))) for it, d in zip(items, dests, strict=True)
                        if it.crc is not None]
                return _Landed(sums, dests, after, lambda: progress.update(n))

            window.add(_Job(req, holding, nbytes, on_done, group.items[0].name if group.items else ""))
            window.retire_done()
        window.drain()
    except BaseException:
        window.abort()
        raise
    finally:
        checksummer.close()


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
    chunks = [(i, off, min(chunk_nbytes, c.entry.nbytes - off))
              for i, c in enumerate(checks) for off in range(0, c.entry.nbytes, chunk_nbytes)]
    if not chunks:
        return
    ring = [aligned_empty(round_up(max(n for _, _, n in chunks))) for _ in range(min(depth, len(chunks)))]
    busy: list[PendingCrc | None] = [None] * len(ring)  # a slot's checksum still reading it
    running: list[int | None] = [None] * len(checks)
    pending: collections.deque[tuple[AioRequest, int, tuple[int, int, int]]] = collections.deque()
    parts: collections.deque[tuple[PendingCrc, int, int, bool]] = collections.deque()  # (crc, check, nbytes, last)

    def combine(block: bool) -> None:
        while parts and (block or parts[0][0].done()):
            crc, i, n, last = parts.popleft()
            running[i] = crc.result() if running[i] is None else crc32c_combine(running[i], crc.result(), n)
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
        busy[slot] = checksummer.submit(data)
        parts.append((busy[slot], i, n, off + n == c.entry.nbytes))
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
            if busy[slot] is not None:
                busy[slot].result()  # its last chunk's checksum is done with the buffer
            c = checks[i]
            pending.append((handle.pread(ring[slot][:n], c.file, c.entry.begin + off), slot, (i, off, n)))
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

    def __init__(self, handle: AioHandle, path: Path, *, chunk_nbytes: int = CHUNK_NBYTES // 2, depth: int = RING_DEPTH):
        self.handle = handle
        self.path = path
        self.chunk = round_up(chunk_nbytes)
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
        src = np.frombuffer(data, dtype=np.uint8) if isinstance(data, (bytes, bytearray)) else as_bytes(data).numpy()
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
            self.pending.append(self.handle.pwrite(self.ring[self.slot][:nbytes], self.file, self.offset))
            self.offset += self.fill
            self.fill = 0
            self.slot = (self.slot + 1) % len(self.ring)
            if len(self.pending) == len(self.ring):
                self.pending.popleft().wait()  # the buffer about to be filled again
        except AioError as e:
            raise _io_error(e, self.path, self.chunk, f"'{self.path.name}'") from e

    def close(self) -> int:
        """Writes what is left, truncates to the true size, fsyncs; returns the file's size."""
        size = self.nbytes
        try:
            if self.fill:
                tail = self.fill
                self.ring[self.slot][tail : round_up(tail)].zero_()
                self._submit(round_up(tail))
            while self.pending:
                self.pending.popleft().wait()
            os.ftruncate(self.file.fileno(), size)
            os.fsync(self.file.fileno())
        except AioError as e:
            raise _io_error(e, self.path, size, f"'{self.path.name}'") from e
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



@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Runs torch's element-wise work (dtype conversions, fills) on ``n`` threads, restoring the setting
    after. [Note: torch threads] Bulk conversions here run on one thread: the checksum pool and the aio
    workers already use the other cores, and torch's OpenMP pool, when it has to share, was measured
    4-6x slower than a single thread on the 2-core machine this was tuned on."""
    old = torch.get_num_threads()
    if old == n:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)
