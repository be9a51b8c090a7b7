"""Exceptions raised by the I/O engine: each names the operation, path, offset and size."""

from __future__ import annotations

import errno as _errno
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from infinity._aio import RequestErrorInfo


class AioError(OSError):
    """An I/O request failed. ``errno``, ``filename``, ``offset`` and ``nbytes`` say where."""

    def __init__(
        self,
        err: int,
        message: str,
        filename: str | None = None,
        *,
        op: str = "",
        offset: int | None = None,
        nbytes: int | None = None,
    ):
        super().__init__(err, message, filename)
        self.op = op
        self.offset = offset
        self.nbytes = nbytes

    def __str__(self) -> str:  # OSError's default puts the filename last; ours is in the text
        return f"[Errno {self.errno}] {self.strerror}" if self.errno else str(self.strerror)


class AioEOFError(AioError, EOFError):
    """A read asked for bytes past the end of the file (never filled with zeros)."""


def request_error(info: RequestErrorInfo, total_nbytes: int) -> AioError:
    """Builds the exception for a failed request from the engine's error record."""
    op = "pwrite" if info["write"] else "pread"
    prep = "to" if info["write"] else "from"
    where = f"{op} of {info['nbytes']} bytes at offset {info['offset']} {prep} '{info['path']}'" + (
        f" (part of a {total_nbytes}-byte request)" if total_nbytes != info["nbytes"] else ""
    )
    if info["eof"]:
        return AioEOFError(
            0,
            f"{where} runs past the end of the file, which has {info['file_size']} bytes",
            info["path"],
            op=op,
            offset=info["offset"],
            nbytes=info["nbytes"],
        )
    err = info["errno"]
    hint = ""
    if err == _errno.ENOSPC:
        hint = ": the file system is full; free space or point nvme_path at a larger drive"
    return AioError(
        err,
        f"{where} failed: {os.strerror(err)}{hint}",
        info["path"],
        op=op,
        offset=info["offset"],
        nbytes=info["nbytes"],
    )
