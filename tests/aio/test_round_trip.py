"""Byte-exact round trips through both engines: sizes around the 4 KiB O_DIRECT alignment, unaligned
offsets and memory, block sizes, queue depths, sync and async, single and vectored requests.

Every byte is compared against an independent reader/writer (os.pread / os.pwrite on a buffered
descriptor), so the engine is never checked only against itself.
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import torch
from aio_util import random_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infinity.aio import AioHandle, aligned_empty

SIZES = st.one_of(
    st.sampled_from([1, 2, 511, 4095, 4096, 4097, 8191, 8192, 12289, 65535, 65537, 3 * 65536 + 5]),
    st.integers(1, 300_000),
)
OFFSETS = st.one_of(
    st.sampled_from([0, 1, 511, 4095, 4096, 4097, 65536, 1 << 20]), st.integers(0, 200_000)
)
MEM_SHIFTS = st.sampled_from([0, 0, 1, 3, 512, 4095])
BLOCK_SIZES = st.sampled_from([4096, 8192, 65536, 1 << 20])
QUEUE_DEPTHS = st.sampled_from([1, 2, 8, 32])
HYPO = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

_counter = itertools.count()
_handles: dict[tuple, AioHandle] = {}


@pytest.fixture(scope="module", autouse=True)
def _close_cached_handles():
    yield
    for h in _handles.values():
        h.close()
    _handles.clear()


def cached_handle(
    engine: str, block_size: int, queue_depth: int, thread_count: int = 1
) -> AioHandle:
    key = (engine, block_size, queue_depth, thread_count)
    if key not in _handles:
        _handles[key] = AioHandle(
            engine=engine, block_size=block_size, queue_depth=queue_depth, thread_count=thread_count
        )
    return _handles[key]


def host_buffer(kind: str, nbytes: int, shift: int):
    """A writable buffer of ``nbytes`` starting ``shift`` bytes past a page boundary."""
    if kind == "tensor":
        return aligned_empty(nbytes + shift)[shift:]
    if kind == "numpy":
        return np.zeros(nbytes + shift, np.uint8)[shift:]
    return memoryview(bytearray(nbytes + shift))[shift:]


def as_numpy(buf) -> np.ndarray:
    return buf.numpy() if isinstance(buf, torch.Tensor) else np.frombuffer(buf, np.uint8)


def fresh_file(d, fill: bytes = b"") -> str:
    path = str(d / f"f{next(_counter)}")
    with open(path, "wb") as f:
        f.write(fill)
    return path


def read_back(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, os.fstat(fd).st_size, 0)
    finally:
        os.close(fd)


@HYPO
@given(
    size=SIZES,
    offset=OFFSETS,
    shift=MEM_SHIFTS,
    block_size=BLOCK_SIZES,
    queue_depth=QUEUE_DEPTHS,
    is_async=st.booleans(),
    kind=st.sampled_from(["tensor", "numpy", "bytearray"]),
)
def test_write_then_read(
    engine, nvme_dir, size, offset, shift, block_size, queue_depth, is_async, kind
):
    h = cached_handle(engine, block_size, queue_depth)
    payload = random_bytes(size, seed=size ^ offset)
    # Bytes around the written range must survive: pre-fill past both ends.
    before = random_bytes(offset + size + 5000, seed=7).tobytes()
    path = fresh_file(nvme_dir, before)

    src = host_buffer(kind, size, shift)
    as_numpy(src)[:] = payload
    if is_async:
        req = h.pwrite(src, path, offset)
        assert req.wait() == size
        assert req.done()
    else:
        assert h.sync_pwrite(src, path, offset) == size
    expected = before[:offset] + payload.tobytes() + before[offset + size :]
    assert read_back(path) == expected

    dst = host_buffer(kind, size, (shift * 7) % 4096)
    n = h.pread(dst, path, offset).wait() if is_async else h.sync_pread(dst, path, offset)
    assert n == size
    assert as_numpy(dst).tobytes() == payload.tobytes()


@HYPO
@given(
    size=SIZES, offset=OFFSETS, shift=MEM_SHIFTS, block_size=BLOCK_SIZES, queue_depth=QUEUE_DEPTHS
)
def test_read_what_another_writer_wrote(
    engine, nvme_dir, size, offset, shift, block_size, queue_depth
):
    h = cached_handle(engine, block_size, queue_depth)
    content = random_bytes(offset + size + 123, seed=offset).tobytes()
    path = fresh_file(nvme_dir, content)
    with h.open(path, "r") as f:
        assert f.direct  # the disk accepts O_DIRECT: the aligned body really goes direct
        dst = host_buffer("tensor", size, shift)
        h.sync_pread(dst, f, offset)
    assert as_numpy(dst).tobytes() == content[offset : offset + size]


@HYPO
@given(
    segments=st.lists(
        st.tuples(st.integers(1, 70_000), st.integers(0, 9000), MEM_SHIFTS), min_size=1, max_size=12
    ),
    block_size=BLOCK_SIZES,
    queue_depth=QUEUE_DEPTHS,
    thread_count=st.sampled_from([1, 2, 3]),
)
def test_vectored_round_trip(engine, nvme_dir, segments, block_size, queue_depth, thread_count):
    """pwrite_many/pread_many: many (buffer, offset) pairs, disjoint with gaps, in one request."""
    h = cached_handle(engine, block_size, queue_depth, thread_count)
    layout, off = [], 0
    for i, (n, gap, shift) in enumerate(segments):
        off += gap
        layout.append((off, random_bytes(n, seed=i), shift))
        off += n
    path = fresh_file(nvme_dir, b"\xee" * off)
    srcs = []
    for o, data, shift in layout:
        b = host_buffer("tensor", len(data), shift)
        b.numpy()[:] = data
        srcs.append((b, o))
    with h.open(path, "rw") as f:
        assert h.pwrite_many(srcs, f).wait() == sum(len(d) for _, d, _ in layout)
        expected = bytearray(b"\xee" * off)
        for o, data, _ in layout:
            expected[o : o + len(data)] = data.tobytes()
        assert read_back(path) == bytes(expected)

        dsts = [(host_buffer("numpy", len(d), (s + 1) % 4096), o) for o, d, s in layout]
        h.pread_many([(b, f, o) for b, o in dsts]).wait()
    for (b, _), (_, data, _) in zip(dsts, layout, strict=True):
        assert b.tobytes() == data.tobytes()


@pytest.mark.parametrize("size", [1, 4095, 4096, 4097, (8 << 20) + 4097])
def test_large_and_tiny_through_default_handle(engine, nvme_dir, size):
    """The default settings (1 MiB blocks, qd 32) on the sizes the issue names, plus a multi-block one."""
    with AioHandle(engine=engine) as h:
        t = aligned_empty(size)
        t.numpy()[:] = random_bytes(size, seed=size)
        path = nvme_dir / "x"
        h.sync_pwrite(t, path)
        assert os.path.getsize(path) == size
        u = aligned_empty(size)
        h.sync_pread(u, path)
        assert torch.equal(t, u)


def test_typed_tensors_and_views(engine, nvme_dir):
    """Any contiguous CPU tensor works, whatever its dtype or storage offset; bytes are what count."""
    with AioHandle(engine=engine, block_size=8192, queue_depth=4) as h:
        base = torch.randn(10_001, dtype=torch.float32)
        view = base[17:]  # storage offset: 68 bytes past the allocation
        h.sync_pwrite(view, nvme_dir / "t")
        out = torch.empty(10_001 - 17, dtype=torch.float32)
        h.sync_pread(out, nvme_dir / "t")
        assert torch.equal(out, view)
        half = torch.empty(2 * out.numel(), dtype=torch.bfloat16)
        h.sync_pread(half, nvme_dir / "t")
        assert torch.equal(half.view(torch.float32), view)


def test_zero_length_requests(engine, nvme_dir):
    with AioHandle(engine=engine) as h:
        path = fresh_file(nvme_dir, b"abc")
        assert h.sync_pwrite(torch.empty(0, dtype=torch.uint8), path, 3) == 0
        assert h.sync_pread(bytearray(0), path, 3) == 0
        assert h.pread_many([], path).wait() == 0
        assert read_back(path) == b"abc"


def test_registered_buffers_round_trip(engine, nvme_dir):
    """Requests inside registered (fixed) buffers, outside them, and straddling none, after re-registration."""
    with AioHandle(engine=engine, block_size=1 << 20, queue_depth=8) as h:
        a = aligned_empty(6 << 20)
        b = aligned_empty(3 << 20)
        h.register_buffers([a, b])
        a.numpy()[:] = random_bytes(a.numel(), 1)
        b.numpy()[:] = random_bytes(b.numel(), 2)
        other = torch.from_numpy(random_bytes(5 << 20, 3))
        h.sync_pwrite(a, nvme_dir / "a")
        h.sync_pwrite(b[4097:], nvme_dir / "b", 11)
        h.sync_pwrite(other, nvme_dir / "c")
        h.register_buffers([b])
        ra, rc = aligned_empty(6 << 20), aligned_empty(5 << 20)
        rb = b.clone()
        h.sync_pread(ra, nvme_dir / "a")
        h.sync_pread(b[4097:], nvme_dir / "b", 11)
        h.sync_pread(rc, nvme_dir / "c")
        assert torch.equal(ra, a) and torch.equal(b, rb) and torch.equal(rc, other)
        h.register_buffers([])
        h.sync_pread(ra, nvme_dir / "a")
        assert torch.equal(ra, a)
