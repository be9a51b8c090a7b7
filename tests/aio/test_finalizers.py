"""Dropping aio objects runs no Python code in the dropping thread ([Note: finalizers run no Python]).

Before, AioRequest.__del__ and AioHandle.__del__ ran Python code wherever the
last reference went; a Ctrl-C landing there was printed as "Exception
ignored" and lost. The buffers of a dropped request must still outlive its I/O
(test_concurrency.py checks that with real memory reuse).
"""

from __future__ import annotations

import numpy as np

from infinity import _aio
from infinity.aio import AioHandle
from tests.aio.aio_util import random_bytes
from tests.finalizers import python_calls_while


def test_dropping_a_request_in_flight_runs_no_python(engine, nvme_dir):
    path = nvme_dir / "f"
    path.write_bytes(random_bytes(8 << 20).tobytes())
    with AioHandle(engine=engine, block_size=4096, queue_depth=1) as h:
        held = {"req": h.pread(np.empty(8 << 20, np.uint8), path)}
        assert not held["req"].done(), "the read ended before the drop; the test proves nothing"
        assert python_calls_while(held.clear) == []
        h.wait_all()
        assert h._engine.kept() == 0


def test_dropping_an_open_handle_with_io_in_flight_runs_no_python(engine, nvme_dir):
    data = random_bytes(8 << 20)
    h = AioHandle(engine=engine, block_size=4096, queue_depth=1)
    req = h.pwrite(data, nvme_dir / "w")
    held = {"h": h, "req": req}
    del h, req
    # The engine drains in its destructor: the write is complete once the drop returns.
    assert python_calls_while(held.clear) == []
    assert (nvme_dir / "w").read_bytes() == data.tobytes()


def test_an_aligned_buffer_finalizer_is_called_with_its_address_from_c():
    seen: list[int] = []
    buf = _aio.AlignedBuffer(4096, huge_pages=False, prefault=True)
    ptr = buf.ptr
    buf.set_finalizer(seen.append)  # a C-level callable: what cudaHostUnregister is
    held = {"buf": buf}
    del buf
    assert python_calls_while(held.clear) == []
    assert seen == [ptr]
