"""TensorCache: buffers reused by size, the free lists bounded by the cap."""

import torch

from infinity.zero.buffers import TensorCache


def test_taking_the_last_buffer_of_a_size_then_overflowing_the_cap_evicts_others():
    """A bucket emptied by get() must not stay behind for put()'s eviction to pop from
    (stage 0/1 take every unit's accumulator before putting any back)."""
    cache = TensorCache(torch.device("cpu"), cap_nbytes=3 * 1024 * 4)
    a, b = torch.empty(1024), torch.empty(2048)
    cache.put(a)
    cache.put(b)
    assert cache.get(1024, torch.float32) is a  # the oldest bucket is now empty
    c = torch.empty(2048)
    cache.put(c)  # over the cap: the oldest buffer goes
    assert cache._free_nbytes <= cache.cap_nbytes
    assert cache.get(2048, torch.float32) is c
