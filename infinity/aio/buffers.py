"""Host memory the engine can do O_DIRECT on, and the conversion of any buffer to (pointer, size).

``aligned_empty`` memory is page aligned, backed by 2 MiB pages where it is
large enough (see csrc/aio/aligned_buffer.h for why), prefaulted once, and
pinned with cudaHostRegister when CUDA is available so H2D copies from it are
asynchronous. The same memory is visible from numpy (``tensor.numpy()``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from infinity import _aio
from infinity.host import memory_maps

DIRECT_ALIGNMENT: int = _aio.DIRECT_ALIGNMENT
HUGE_PAGE_SIZE: int = _aio.HUGE_PAGE_SIZE


def _cuda_pin(buf: _aio.AlignedBuffer) -> bool:
    if not torch.cuda.is_available() or buf.nbytes == 0:
        return False
    cudart = torch.cuda.cudart()
    ret = cudart.cudaHostRegister(buf.ptr, buf.mapped_size, 0)
    if int(ret) != 0:
        raise RuntimeError(
            f"cudaHostRegister of {buf.mapped_size} bytes failed (cudaError {int(ret)}); "
            "lower buffer_count/buffer_size or set pin_memory: false"
        )
    # The C-level function itself, not a lambda: no Python code may run while the buffer is
    # collected ([Note: finalizers run no Python] in handle.py).
    buf.set_finalizer(cudart.cudaHostUnregister)
    return True


def aligned_empty(
    nbytes: int,
    dtype: torch.dtype = torch.uint8,
    *,
    huge_pages: bool = True,
    pin: bool | None = None,
) -> torch.Tensor:
    """A 1-D CPU tensor of ``nbytes`` bytes, page aligned, zero filled.

    ``pin=None`` pins when CUDA is available; ``pin=True`` without CUDA is an error.
    Allocate once and reuse: first touch of fresh memory is ~10x slower than reuse.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    if nbytes < 0 or nbytes % itemsize:
        raise ValueError(
            f"nbytes={nbytes} is not a non-negative multiple of {dtype}'s size {itemsize}"
        )
    if pin and not torch.cuda.is_available():
        raise ValueError("pin=True needs CUDA, which is not available; use pin=None")
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    buf = _aio.AlignedBuffer(nbytes, huge_pages=huge_pages, prefault=True)
    if pin is None or pin:
        _cuda_pin(buf)
    # frombuffer keeps `buf` alive for as long as the tensor (or a view) lives.
    return torch.frombuffer(buf, dtype=dtype)


def buffer_span(buffer: Any, *, writable: bool) -> tuple[int, int, Any]:
    """(address, nbytes, keepalive) of a contiguous host buffer.

    Accepts CPU torch tensors and anything with the buffer protocol (numpy
    arrays, bytearray, memoryview, AlignedBuffer). ``writable`` is required for
    reads into the buffer.
    """
    if isinstance(buffer, torch.Tensor):
        if buffer.device.type != "cpu":
            raise ValueError(
                f"the engine reads and writes host memory; got a tensor on {buffer.device}. "
                "Stage it through a host buffer (infinity.aio.aligned_empty)."
            )
        if not buffer.is_contiguous():
            raise ValueError(
                f"the buffer must be contiguous; got a tensor of shape {tuple(buffer.shape)} "
                f"and strides {buffer.stride()} (call .contiguous() first)"
            )
        return buffer.data_ptr(), buffer.numel() * buffer.element_size(), buffer
    try:
        mv = memoryview(buffer)
    except TypeError:
        raise TypeError(
            f"expected a CPU tensor or an object with the buffer protocol, got {type(buffer).__name__}"
        ) from None
    if not mv.c_contiguous:
        raise ValueError("the buffer must be C-contiguous")
    if writable and mv.readonly:
        raise ValueError("cannot read into a read-only buffer")
    if mv.nbytes == 0:
        return 0, 0, buffer
    arr = np.frombuffer(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv, dtype=np.uint8)
    return int(arr.ctypes.data), mv.nbytes, (buffer, arr)


def huge_page_fraction(buffer: Any) -> float:
    """Fraction of ``buffer``'s bytes backed by 2 MiB pages (hugetlb or transparent), from /proc/self/smaps.

    Says whether huge pages really back a buffer (THP can be off or fragmented;
    the hugetlb pool can be empty). Transparent huge pages are counted per
    mapping and prorated over the part ``buffer`` covers. 0.0 where smaps is
    unreadable or the buffer is empty.
    """
    ptr, nbytes, _keep = buffer_span(buffer, writable=False)
    if nbytes == 0:
        return 0.0
    end = ptr + nbytes
    huge = 0.0
    for m in memory_maps(detail=True):
        overlap = min(m.end, end) - max(m.start, ptr)
        if overlap <= 0:
            continue
        if m.fields.get("KernelPageSize", 0) >= HUGE_PAGE_SIZE:
            huge += overlap
        elif m.fields.get("AnonHugePages"):
            huge += overlap * min(1.0, m.fields["AnonHugePages"] / (m.end - m.start))
    return min(1.0, huge / nbytes)
