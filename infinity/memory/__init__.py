"""Host memory for I/O: page-aligned (pinned when CUDA is present) buffers and the buffer pool.

Imports only infinity.aio and infinity.host (and torch). See DESIGN.md (memory).
"""

from infinity.aio import aligned_empty
from infinity.memory.pool import BufferPool, PoolRegion, PoolStats, PoolTooSmallError, format_nbytes
from infinity.memory.ranges import RangeAllocator, round_up
from infinity.memory.trim import FreedMemory, trim_heap
from infinity.memory.usage import peak_host_nbytes, resident_host_nbytes

__all__ = [
    "BufferPool",
    "FreedMemory",
    "PoolRegion",
    "PoolStats",
    "PoolTooSmallError",
    "RangeAllocator",
    "aligned_empty",
    "format_nbytes",
    "peak_host_nbytes",
    "resident_host_nbytes",
    "round_up",
    "trim_heap",
]
