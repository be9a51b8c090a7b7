"""CRC32C of large buffers on a few threads: pieces checksummed in parallel, then combined.

One thread checksums ~4 GB/s here, slower than the disk writes, so a save
that checksums on its own thread runs at the checksum's speed. The C++
crc32c releases the GIL; pieces go to a small thread pool and their CRCs are
joined with zlib's crc32_combine algorithm (GF(2) matrices, here for the
Castagnoli polynomial), using operators for 2**k zero bytes built once.

Threading: a Checksummer may be used from one thread at a time; its pool's
threads only run crc32c over buffers the caller keeps alive until
``result()``.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os

import torch

from infinity.aio import crc32c
from infinity.aio.waits import result_of

log = logging.getLogger("infinity.checkpoint")

_POLY = 0x82F63B78  # CRC32C (Castagnoli), reflected
PIECE_NBYTES = 4 << 20


def _times(mat: list[int], vec: int) -> int:
    out = 0
    i = 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _square(mat: list[int]) -> list[int]:
    return [_times(mat, mat[n]) for n in range(32)]


@functools.cache
def _zero_operators() -> tuple[list[int], ...]:
    """Operator k appends 2**k zero bytes to a CRC (before its final inversion)."""
    op = [_POLY] + [1 << n for n in range(31)]  # one zero bit
    for _ in range(3):
        op = _square(op)  # 2, 4, 8 bits: one byte
    ops = []
    for _ in range(64):
        ops.append(op)
        op = _square(op)
    return tuple(ops)


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32C of A + B from crc(A), crc(B) and len(B) bytes."""
    ops = _zero_operators()
    k = 0
    while len2:
        if len2 & 1:
            crc1 = _times(ops[k], crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


class PendingCrc:
    """The CRC32C of one buffer, being computed in pieces."""

    def __init__(self, parts: list[tuple[concurrent.futures.Future, int]]):
        self._parts = parts

    def done(self) -> bool:
        return all(f.done() for f, _ in self._parts)

    def result(self) -> int:
        crc = 0
        for i, (fut, n) in enumerate(self._parts):
            c = result_of(
                fut,
                what=f"the CRC32C of piece {i} of {len(self._parts)} (thread pool infinity-crc32c)",
                log=log,
            )
            crc = c if i == 0 else crc32c_combine(crc, c, n)
        return crc


class Checksummer:
    def __init__(self, threads: int | None = None, piece_nbytes: int = PIECE_NBYTES):
        self.piece_nbytes = piece_nbytes
        n = threads or min(4, os.cpu_count() or 1)
        self._pool = concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="infinity-crc32c")

    def submit(self, data: torch.Tensor) -> PendingCrc:
        """Starts checksumming ``data`` (a flat uint8 tensor the caller keeps alive until ``result()``)."""
        n = data.numel()
        if n == 0:
            return PendingCrc([(_done(crc32c(data)), 0)])
        return PendingCrc(
            [
                (
                    self._pool.submit(crc32c, data[o : o + self.piece_nbytes]),
                    min(self.piece_nbytes, n - o),
                )
                for o in range(0, n, self.piece_nbytes)
            ]
        )

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> Checksummer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _done(value: int) -> concurrent.futures.Future:
    f: concurrent.futures.Future = concurrent.futures.Future()
    f.set_result(value)
    return f
