"""Python face of the C++ async I/O engine (csrc/aio): AioHandle, AioConfig, buffers, errors.

Imports only infinity.host and infinity.timeline (and torch, numpy).
"""

from infinity import _aio
from infinity.aio.buffers import (
    DIRECT_ALIGNMENT,
    HUGE_PAGE_SIZE,
    aligned_empty,
    buffer_span,
    huge_page_fraction,
)
from infinity.aio.checksum import crc32c, crc32c_is_hardware
from infinity.aio.config import AioConfig
from infinity.aio.errors import AioEOFError, AioError
from infinity.aio.handle import AioFile, AioHandle, AioRequest, io_uring_status, open_file


def built_with_io_uring() -> bool:
    """Whether this build has the io_uring back end (liburing was found at build time)."""
    return _aio.built_with_io_uring()


__all__ = [
    "DIRECT_ALIGNMENT",
    "HUGE_PAGE_SIZE",
    "AioConfig",
    "AioEOFError",
    "AioError",
    "AioFile",
    "AioHandle",
    "AioRequest",
    "aligned_empty",
    "buffer_span",
    "crc32c",
    "crc32c_is_hardware",
    "huge_page_fraction",
    "built_with_io_uring",
    "io_uring_status",
    "open_file",
]
