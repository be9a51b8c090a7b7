"""How many threads torch's element-wise work runs on during checkpoint I/O."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Runs torch's element-wise work (dtype conversions, fills) on ``n`` threads, restoring the setting
    after. [Note: torch threads] Bulk conversions here run on one thread: the checksum pool and the aio
    workers already use the other cores, and torch's OpenMP pool, when it has to share, was measured
    4-6x slower than a single thread on the 2-core machine this was tuned on."""
    old = torch.get_num_threads()
    if old == n:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)
