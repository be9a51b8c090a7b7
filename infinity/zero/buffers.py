"""Reusable full-size buffers for gathered parameters and flat gradients.

On CUDA, torch's caching allocator already reuses memory. On the CPU, a fresh
multi-MB allocation is served by mmap and first-touched at ~1.4 GB/s (vs ~16
GB/s for reused memory, measured here), so buffers of the sizes a model uses
every step are kept in per-size free lists, bounded by ``cap_nbytes``.

A buffer put back may still be viewed by a tensor someone else holds (the
stage-3 partitioner hands a frozen unit's gathered buffer to autograd's saved
tensors and puts it back at once: [Note: frozen units in backward] in
partitioner.py): ``get`` hands out only a buffer whose storage nothing but the
cache references, so such a buffer is reused once the last view of it is gone,
and until then it lives as long as that view, as any tensor's memory does.
"""

from __future__ import annotations

import collections

import torch


def _storage_refs(t: torch.Tensor) -> int:
    """How many tensors and storage objects hold ``t``'s storage (torch's own count)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


_ALONE = _storage_refs(torch.empty(1))
"""The count for a tensor nothing else views (the tensor and the storage object asked)."""


class TensorCache:
    def __init__(self, device: torch.device, *, cap_nbytes: int):
        self.device = device
        self.cap_nbytes = cap_nbytes
        self._free: collections.OrderedDict[tuple[int, torch.dtype], list[torch.Tensor]] = (
            collections.OrderedDict()
        )
        self._free_nbytes = 0

    def get(self, numel: int, dtype: torch.dtype, *, zero: bool = False) -> torch.Tensor:
        key = (numel, dtype)
        bucket = self._free.get(key, [])
        i = next(
            (i for i in reversed(range(len(bucket))) if _storage_refs(bucket[i]) <= _ALONE), -1
        )
        if i >= 0:
            t = bucket.pop(i)
            if not bucket:
                del self._free[key]  # put()'s eviction takes the oldest bucket's first buffer
            self._free_nbytes -= t.numel() * t.element_size()
        else:  # none, or each still viewed by a tensor held elsewhere
            t = torch.empty(numel, dtype=dtype, device=self.device)
        if zero:
            t.zero_()
        return t

    def put(self, t: torch.Tensor) -> None:
        if self.device.type == "cuda":
            return  # the caching allocator does this better
        nbytes = t.numel() * t.element_size()
        if nbytes > self.cap_nbytes:
            return
        self._free.setdefault((t.numel(), t.dtype), []).append(t)
        self._free.move_to_end((t.numel(), t.dtype))
        self._free_nbytes += nbytes
        while self._free_nbytes > self.cap_nbytes:
            key, bucket = next(iter(self._free.items()))
            old = bucket.pop(0)
            self._free_nbytes -= old.numel() * old.element_size()
            if not bucket:
                del self._free[key]

    def clear(self) -> None:
        self._free.clear()
        self._free_nbytes = 0
