"""IoHandles: the pair of aio handles a store submits its reads and its writes to.

Reads and writes go to separate handles so that a burst of write-backs never
queues ahead of the read a computation waits for. Given an AioConfig the store
opens both handles itself and closes them with the store; given a handle
object (tests pass RecordingAio, a wrapper that records requests and injects
failures) it uses that one object for both and leaves closing it to the caller.
``AioHandleLike`` is what the store needs of such an object, so a wrapper need
not subclass AioHandle.

Threading: the handles are thread-safe (AioHandle's own rules); IoHandles is
built once in the store's constructor and closed once, by close() or the
store's finalizer.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Literal, Protocol

import torch

from infinity.aio import AioConfig, AioFile, AioHandle
from infinity.aio.handle import FileArg, PathLike

log = logging.getLogger("infinity.store")


class IoRequest(Protocol):
    """A submitted request (AioRequest, or a CUDA copy's event): ``wait`` raises its error."""

    def done(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> object: ...


class AioHandleLike(Protocol):
    """What the store uses of an AioHandle."""

    @property
    def config(self) -> AioConfig: ...

    @property
    def engine(self) -> str: ...

    def open(
        self, path: PathLike, mode: Literal["r", "w", "rw"] = "rw", *, create: bool = True
    ) -> AioFile: ...

    def pread_many(self, items: Iterable[tuple], file: FileArg | None = None) -> IoRequest: ...

    def pwrite_many(self, items: Iterable[tuple], file: FileArg | None = None) -> IoRequest: ...

    def register_buffers(self, buffers: Iterable[torch.Tensor]) -> None: ...

    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class IoHandles:
    """``read`` and ``write``: the handles reads and writes are submitted to (one object when
    the caller gave one); ``owned``: the store opened them, so the store closes them."""

    read: AioHandleLike
    write: AioHandleLike
    owned: bool

    @classmethod
    def open(cls, aio: AioConfig | AioHandleLike | None) -> IoHandles:
        aio = AioConfig() if aio is None else aio
        if isinstance(aio, AioConfig):
            return cls(AioHandle.from_config(aio), AioHandle.from_config(aio), owned=True)
        return cls(aio, aio, owned=False)

    def register_pool(self, slab: torch.Tensor, store_name: str) -> None:
        """Registers the pool's slab as io_uring fixed buffers, when the store owns io_uring handles.

        Fixed buffers spare the kernel a page pin per request. Registering needs
        RLIMIT_MEMLOCK room; without it requests still work, unpinned.
        """
        if not self.owned or self.read.engine != "io_uring":
            return
        try:
            for h in (self.read, self.write):
                h.register_buffers([slab])
        except (OSError, RuntimeError) as e:
            log.info(
                "store '%s': io_uring fixed buffers not registered (%s); continuing without",
                store_name,
                e,
            )

    def close(self) -> None:
        """Closes the handles the store opened (a caller's handle stays open)."""
        if self.owned:
            self.read.close()
            self.write.close()
