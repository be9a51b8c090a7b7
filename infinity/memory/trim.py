"""Giving freed heap memory back to the OS.

glibc raises its mmap threshold after the first large free, so later blocks of
that size come from the heap; once freed they stay mapped (RSS) unless the
heap is trimmed. Building a model under zero.Init allocates and frees every
parameter in turn — without trimming, peak RSS grows towards the model size
even though at most one module is alive at a time. ``FreedMemory`` counts
bytes the runtime freed and trims once enough have accumulated.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

_libc = None
_name = ctypes.util.find_library("c")
if _name:
    try:
        _lib = ctypes.CDLL(_name)
        if hasattr(_lib, "malloc_trim"):  # glibc only
            _libc = _lib
    except OSError:
        _libc = None


def trim_heap() -> bool:
    """Returns free heap pages (in every arena) to the OS; False where libc cannot (not glibc)."""
    if _libc is None:
        return False
    return bool(_libc.malloc_trim(0))


class FreedMemory:
    """Trims the heap each time ``threshold_nbytes`` more bytes have been freed."""

    def __init__(self, threshold_nbytes: int = 256 << 20):
        self.threshold_nbytes = threshold_nbytes
        self._pending = 0
        self._lock = threading.Lock()

    def freed(self, nbytes: int) -> None:
        with self._lock:
            self._pending += nbytes
            if self._pending < self.threshold_nbytes:
                return
            self._pending = 0
        trim_heap()
