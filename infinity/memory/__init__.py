"""Host memory for I/O: page-aligned (pinned when CUDA is present) buffers and the buffer pool.

Imports only infinity.aio (and torch). See docs/ARCHITECTURE.md.
"""

from infinity.aio import aligned_empty
from infinity.memory.pool import BufferPool, PoolRegion, PoolStats, PoolTooSmallError, format_nbytes
from infinity.memory.ranges import RangeAllocator, round_up
from infinity.memory.trim import FreedMemory, trim_heap

__all__ = [
    "BufferPool",
    "FreedMemory",
    "PoolRegion",
    "PoolStats",
    "PoolTooSmallError",
    "RangeAllocator",
    "aligned_empty",
    "format_nbytes",
    "round_up",
    "trim_heap",
]
