"""Host memory for I/O: page-aligned (pinned when CUDA is present) buffers and the buffer pool.

Imports only infinity.aio and infinity.host (and torch). See docs/ARCHITECTURE.md.
"""

from infinity.aio import aligned_empty

# Not memory's: infinity/estimate/machine.py still imports it from here, and the estimate branch
# rewrites that file (it should import infinity.host.resident_host_nbytes). Delete on that merge.
from infinity.host import resident_host_nbytes  # noqa: E402, F401
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
