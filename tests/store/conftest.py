"""Fixtures for the store tests, and RecordingAio: an AioHandle wrapper that records, gates and fails requests.

RecordingAio plays the part of TensorStore's mock kvstore: every request the
store makes is logged (kind, and the (path, offset, nbytes) of each segment),
a request can be held back behind a gate (so states like READING and WRITING
can be observed and raced deterministically), and the n-th matching request
can be made to fail with an errno, the way a dying drive would.
"""

from __future__ import annotations

import errno as _errno
import os
import threading
from dataclasses import dataclass, field

import pytest
import torch

from infinity.aio import AioError, AioHandle
from infinity.memory import BufferPool
from infinity.store import TieredStore

ENGINES = ["io_uring", "threads"]


@dataclass
class Logged:
    kind: str  # "read" | "write"
    segments: list[tuple[str, int, int]]

    @property
    def nbytes(self) -> int:
        return sum(n for _p, _o, n in self.segments)


class _FailedRequest:
    def __init__(self, kind: str, path: str, offset: int, nbytes: int, err: int):
        self._exc = AioError(
            err,
            f"{'pwrite' if kind == 'write' else 'pread'} of {nbytes} bytes at offset {offset} "
            f"{'to' if kind == 'write' else 'from'} '{path}' failed: {os.strerror(err)} (injected)",
            path,
            op=kind,
            offset=offset,
            nbytes=nbytes,
        )

    def done(self) -> bool:
        return True

    def wait(self, timeout=None):
        raise self._exc


class _GatedRequest:
    def __init__(self, real, gate: threading.Event):
        self._real = real
        self._gate = gate

    def done(self) -> bool:
        return self._gate.is_set() and self._real.done()

    def wait(self, timeout=None):
        if not self._gate.wait(timeout):
            raise TimeoutError("gated request still held")
        return self._real.wait(timeout)


@dataclass
class _Rule:
    kind: str
    action: str  # "fail" | "gate"
    errno: int = _errno.EIO
    gate: threading.Event | None = None
    remaining: int = 1


class RecordingAio:
    """Wraps a real AioHandle (``inner``, or a new one on ``engine``): logs requests;
    fail_next()/gate_next() alter the next matching ones."""

    def __init__(self, engine: str = "auto", *, inner: AioHandle | None = None):
        self.inner = inner if inner is not None else AioHandle(engine=engine)
        self.config = self.inner.config
        self.engine = self.inner.engine
        self.log: list[Logged] = []
        self._rules: list[_Rule] = []
        self._lock = threading.Lock()

    def open(self, path, mode="rw", *, create=True):
        return self.inner.open(path, mode, create=create)

    def fail_next(self, kind: str, *, errno: int = _errno.EIO, count: int = 1) -> None:
        with self._lock:
            self._rules.append(_Rule(kind, "fail", errno=errno, remaining=count))

    def gate_next(self, kind: str, *, count: int = 1) -> threading.Event:
        gate = threading.Event()
        with self._lock:
            self._rules.append(_Rule(kind, "gate", gate=gate, remaining=count))
        return gate

    def reads(self) -> list[Logged]:
        return [e for e in self.log if e.kind == "read"]

    def writes(self) -> list[Logged]:
        return [e for e in self.log if e.kind == "write"]

    def pread_many(self, items, file=None):
        return self._submit("read", list(items), file)

    def pwrite_many(self, items, file=None):
        return self._submit("write", list(items), file)

    def _submit(self, kind, items, file):
        segs = []
        for it in items:
            buf, f, off = (it[0], file, it[1]) if file is not None else it
            segs.append((getattr(f, "path", str(f)), off, buf.numel() * buf.element_size()))
        with self._lock:
            self.log.append(Logged(kind, segs))
            rule = next((r for r in self._rules if r.kind == kind and r.remaining > 0), None)
            if rule is not None:
                rule.remaining -= 1
        if rule is not None and rule.action == "fail":
            path, off, n = segs[0]
            return _FailedRequest(kind, path, off, n, rule.errno)
        real = (self.inner.pread_many if kind == "read" else self.inner.pwrite_many)(items, file)
        if rule is not None and rule.action == "gate":
            return _GatedRequest(real, rule.gate)
        return real

    def register_buffers(self, buffers) -> None:
        self.inner.register_buffers(buffers)

    def close(self) -> None:
        self.inner.close()


@dataclass
class StoreFactory:
    nvme_dir: object
    made: list = field(default_factory=list)

    def __call__(
        self,
        *,
        pool_count: int = 8,
        pool_size: int = 256 << 10,
        engine: str = "auto",
        recording: bool = False,
        nvme: bool = True,
        **kw,
    ):
        pool = kw.pop("pool", None) or BufferPool(pool_count, pool_size, name="test-pool")
        aio = RecordingAio(engine) if recording else None
        if aio is None and engine != "auto":
            from infinity.aio import AioConfig

            kw["aio"] = AioConfig(engine=engine)
        elif aio is not None:
            kw["aio"] = aio
        store = TieredStore(self.nvme_dir if nvme else None, pool=pool, **kw)
        self.made.append((store, aio))
        return (store, aio) if recording else store


@pytest.fixture
def make_store(nvme_dir):
    factory = StoreFactory(nvme_dir)
    yield factory
    for store, aio in factory.made:
        store.close()
        if aio is not None:
            aio.close()


def rand_tensor(shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(-100, 100, shape, generator=g).to(dtype)
