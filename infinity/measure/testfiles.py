"""The files a throughput run reads and writes: a TestFile on one drive, or a Stripe over several.

A TestFile is ``nbytes`` of real data written once (a read of unwritten blocks measures nothing).
A Stripe is one TestFile per drive, read and written as one space striped the way a store lays
out its swap space over those drives ([Note: striping] in infinity/store/swapspace.py). Each gives
the (buffer, file, offset) pieces of one run through a ring buffer; infinity.measure.throughput
times them.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from infinity.aio import AioHandle, aligned_empty


class TestFile:
    """The file the runs read and write: ``nbytes`` of real data on the file system under test."""

    def __init__(self, directory: Path, nbytes: int, name: str = "infinity-bench-aio.dat"):
        self.directory = Path(directory)
        self.nbytes = nbytes
        self.path = self.directory / name

    def prepare(self) -> None:
        """Creates the directory and writes the file once (a read of unwritten blocks measures
        nothing)."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SystemExit(
                f"cannot create {self.directory}: {e.strerror}; pass --path to a writable directory"
            ) from None
        have = self.path.stat().st_size if self.path.exists() else 0
        if have == self.nbytes:
            return
        free = os.statvfs(self.directory)
        free_nbytes = free.f_bavail * free.f_frsize + have
        if free_nbytes < self.nbytes:
            raise SystemExit(
                f"{self.directory} has {free_nbytes / 1e9:.1f} GB free, the test file needs "
                f"{self.nbytes / 1e9:.1f} GB; pass a smaller --size or another --path"
            )
        self.path.unlink(missing_ok=True)
        chunk = min(self.nbytes, 64 << 20)
        data = aligned_empty(chunk)
        data.numpy()[:] = np.resize(np.frombuffer(os.urandom(1 << 20), np.uint8), chunk)
        with AioHandle() as h, h.open(self.path, "w") as f:
            h.pwrite_many(
                [
                    (data[: min(chunk, self.nbytes - off)], off)
                    for off in range(0, self.nbytes, chunk)
                ],
                f,
            ).wait()
            os.fsync(f.fileno())

    def direct_io_works(self) -> bool:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
        except OSError as e:
            if e.errno == errno.EINVAL:
                return False
            raise
        os.close(fd)
        return True

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)

    @property
    def files(self) -> list[TestFile]:
        return [self]

    def items(self, ring: Any, block_size: int, files: Sequence[Any]) -> list[tuple[Any, Any, int]]:
        """The whole file as (buffer, file, offset) pieces cycling through ``ring``."""
        n, ring_n = self.nbytes, ring.numel()
        return [(ring[: min(ring_n, n - off)], files[0], off) for off in range(0, n, ring_n)]


class Stripe:
    """One test file per drive, read and written as one striped space: piece k (block_size bytes) is
    in file k % N at offset (k // N) x block_size, as a store striped over these drives lays out its
    swap space with the default stripe unit (the aio block_size)."""

    def __init__(self, files: Sequence[TestFile]):
        if len(files) < 2 or len({f.nbytes for f in files}) != 1:
            raise ValueError("a stripe needs two or more test files of one size")
        self.files = list(files)

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    @property
    def path(self) -> Path:
        """The first file (where messages need one path)."""
        return self.files[0].path

    def prepare(self) -> None:
        for f in self.files:
            f.prepare()

    def direct_io_works(self) -> bool:
        return all(f.direct_io_works() for f in self.files)

    def remove(self) -> None:
        for f in self.files:
            f.remove()

    def items(self, ring: Any, block_size: int, files: Sequence[Any]) -> list[tuple[Any, Any, int]]:
        """Every file as block_size pieces going round the files, each in the ring slot of its
        logical offset (the ring is a whole number of blocks)."""
        size, n, ring_n = self.files[0].nbytes, len(files), ring.numel()
        out = []
        for k in range(n * -(-size // block_size)):
            off = (k // n) * block_size
            if off < size:
                at = (k * block_size) % ring_n
                out.append((ring[at : at + min(block_size, size - off)], files[k % n], off))
        return out


Target = TestFile | Stripe


def targets(paths: Sequence[Path], nbytes: int, name: str) -> list[tuple[str, Target]]:
    """What a run over ``paths`` measures: the one test file; or with several paths each one's
    alone (labelled by its path) and then all of them striped ("stripe"). A folder listed twice is
    refused."""
    seen: dict[str, Path] = {}
    for p in paths:
        real = os.path.realpath(os.path.expanduser(p))
        if real in seen:
            raise SystemExit(
                f"--path lists the same directory twice ({seen[real]} and {p}); "
                "list each drive once"
            )
        seen[real] = p
    files = [TestFile(Path(os.path.expanduser(p)), nbytes, name=name) for p in paths]
    if len(files) == 1:
        return [("", files[0])]
    return [(str(p), f) for p, f in zip(paths, files, strict=True)] + [("stripe", Stripe(files))]


def shared_file_systems(paths: Sequence[Path]) -> list[list[Path]]:
    """Groups of ``paths`` (created, as the test files are) that lie on one file system: a stripe
    over them shares one drive's bandwidth."""
    by_dev: dict[int, list[Path]] = {}
    for p in paths:
        by_dev.setdefault(os.stat(os.path.expanduser(p)).st_dev, []).append(p)
    return [group for group in by_dev.values() if len(group) > 1]
