"""CRC32C of host buffers, in C++ (SSE4.2 where the CPU has it; GIL released)."""

from __future__ import annotations

from typing import Any

from infinity import _aio
from infinity.aio.buffers import buffer_span


def crc32c(buffer: Any, value: int = 0) -> int:
    """CRC32C (Castagnoli) of ``buffer`` (CPU tensor or buffer-protocol object), continuing ``value``."""
    ptr, nbytes, _keep = buffer_span(buffer, writable=False)
    return _aio.crc32c(ptr, nbytes, value)


def crc32c_is_hardware() -> bool:
    return _aio.crc32c_is_hardware()
