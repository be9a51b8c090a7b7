"""AioHandle: asynchronous pread/pwrite through the C++ engine (io_uring or threads).

Async is the primitive: ``pread``/``pwrite`` return an AioRequest that keeps
its buffer alive until it completes; the ``sync_*`` variants are
``submit(...).wait()``. Waiting releases the GIL. One handle may be used from
several threads, and several handles at once.

Fallbacks, each announced with one log line: ``engine="auto"`` uses the
threads back end where io_uring is refused (Docker's default seccomp profile,
``kernel.io_uring_disabled``, or a build without liburing); files on a file
system that refuses O_DIRECT (ramfs; tmpfs before Linux 6.6) are read and
written buffered.

Fork: a handle belongs to the process that made it (its worker threads do not
survive fork); in a child it raises instead of hanging.

Finalizers: none here run Python code ([Note: finalizers run no Python]); a
handle dropped unclosed is drained and stopped by its engine's destructor.

(Past the ~500-line soft cap on purpose: the handle, its requests and its files
share one lifetime protocol -- who keeps buffers and descriptors alive until the
kernel is done, and what close, exit and fork do -- best read in one place.)
"""

from __future__ import annotations

import atexit
import dataclasses
import errno
import logging
import os
import threading
import weakref
from collections.abc import Iterable
from typing import Any, Literal, Union

from infinity import _aio
from infinity.aio.buffers import buffer_span
from infinity.aio.config import AioConfig
from infinity.aio.errors import AioError, request_error
from infinity.aio.waits import wait_until

log = logging.getLogger("infinity.aio")

PathLike = Union[str, "os.PathLike[str]"]
FileArg = Union["AioFile", PathLike, int]


class Notices:
    """Fallback notices, each logged once per process by whichever handle or file meets it first.
    ``AioHandle.notices`` is the process's; a test swaps in a fresh one to see them again."""

    def __init__(self) -> None:
        self._said: set[str] = set()
        self._lock = threading.Lock()

    def once(self, key: str, message: str) -> None:
        with self._lock:
            if key in self._said:
                return
            self._said.add(key)
        log.warning(message)


def io_uring_status() -> str:
    """'' when io_uring can be used in this process, else the reason it cannot."""
    return _aio.probe_io_uring()


class AioFile:
    """A file opened once for many requests (the engine keeps a direct and a buffered descriptor)."""

    def __init__(self, raw: _aio.File):
        self._raw: _aio.File | None = raw
        self._path = raw.path
        self._direct = raw.direct

    @property
    def path(self) -> str:
        return self._path

    @property
    def direct(self) -> bool:
        """Whether O_DIRECT is in use (False where the file system refused it)."""
        return self._direct

    @property
    def closed(self) -> bool:
        return self._raw is None or self._raw.closed

    def size(self) -> int:
        return self._live("size").size()

    def fileno(self) -> int:
        return self._live("fileno").fileno

    def _live(self, op: str) -> _aio.File:
        raw = self._raw
        if raw is None or raw.closed:
            raise AioError(
                errno.EBADF, f"{op} on '{self._path}': the file was closed", self._path, op=op
            )
        return raw

    def close(self) -> None:
        """Refuses new requests; the descriptors close once requests in flight on the file end."""
        raw, self._raw = self._raw, None
        if raw is not None:
            raw.close()

    def __enter__(self) -> AioFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"AioFile({self.path!r}, direct={self.direct})"


def open_file(
    path: PathLike,
    mode: Literal["r", "w", "rw"] = "rw",
    *,
    create: bool = True,
    o_direct: bool = True,
) -> AioFile:
    """Opens ``path`` for the engine. Errors name the path and say what to fix."""
    p = os.fspath(path)
    try:
        raw = _aio.open_file(p, mode, create=create, direct=o_direct)
    except OSError as e:
        raise _open_error(e, p, mode) from None
    if o_direct and not raw.direct:
        AioHandle.notices.once(
            "odirect:" + os.path.dirname(os.path.abspath(p)),
            f"O_DIRECT is refused by the file system holding {os.path.dirname(os.path.abspath(p))}; "
            "using buffered I/O there (reads may be served from the page cache)",
        )
    return AioFile(raw)


def _open_error(e: OSError, path: str, mode: str) -> AioError:
    why = os.strerror(e.errno) if e.errno else str(e)
    hint = ""
    if e.errno == errno.ENOENT:
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            hint = f": the directory {parent} does not exist; create it or choose another path"
        else:
            hint = ": no such file"
    elif e.errno in (errno.EACCES, errno.EPERM):
        hint = f": permission denied for mode '{mode}'; check the owner and mode of the path"
    elif e.errno == errno.EROFS:
        hint = ": the file system is read-only"
    return AioError(e.errno or errno.EIO, f"cannot open '{path}' ({why}){hint}", path, op="open")


class AioRequest:
    """One submitted read or write. ``wait()`` returns the byte count or raises AioError.

    Its buffers stay alive until it completes, even when it is dropped
    unwaited: the engine keeps them ([Note: requests keep their buffers alive]
    in csrc/aio/bindings.cc) and lets go once it is waited for or found done.
    """

    __slots__ = ("_raw", "_engine", "_where", "__weakref__")

    def __init__(self, raw: _aio.Request, engine: _aio.Engine, where: str = ""):
        self._raw = raw
        self._engine = engine  # keeps the buffers (see the class docstring)
        self._where = where  # the first segment's file and offset, for slow-wait log lines

    @property
    def nbytes(self) -> int:
        return self._raw.nbytes

    @property
    def write(self) -> bool:
        return self._raw.write

    def done(self) -> bool:
        """True once every piece has completed (successfully or not)."""
        return self._raw.done()

    def wait(self, timeout: float | None = None) -> int:
        """Waits (GIL released). Raises TimeoutError after ``timeout`` seconds, AioError on failure.

        A wait of more than a few seconds is logged, naming the request ([Note: no silent
        waits] in waits.py): nothing but the drive can end it, so there is no cause to raise."""
        if not wait_until(self._raw.wait, what=self._describe, log=log, timeout=timeout):
            raise TimeoutError(f"{self._describe()} not done after {timeout} s")
        self._engine.release(self._raw)
        err = self._raw.error()
        if err is not None:
            raise request_error(err, self.nbytes)
        return self.nbytes

    result = wait

    def _describe(self) -> str:
        kind, prep = ("pwrite", "to") if self.write else ("pread", "from")
        return f"{kind} of {self.nbytes} bytes {prep} {self._where or 'no file'}"

    def __repr__(self) -> str:
        kind = "pwrite" if self.write else "pread"
        return f"<AioRequest {kind} {self.nbytes} bytes {'done' if self.done() else 'in flight'}>"


# [Note: finalizers run no Python]
# A finalizer (``__del__``, a weakref callback written in Python,
# weakref.finalize, WeakSet/WeakMethod's own callbacks) runs Python code in
# whatever thread drops the last reference, at any point of the program. A
# KeyboardInterrupt that lands in it is printed as "Exception ignored" and
# lost: training went on after Ctrl-C during save_checkpoint. So objects of
# the runtime have no Python finalizers: C++ keeps what must outlive a
# dropped object (a request's buffers: [Note: requests keep their buffers
# alive] in csrc/aio/bindings.cc; an engine drains in its destructor), and
# cleanup that needs Python runs in a thread of its own
# (infinity/store/finalizer.py). Registries hold plain weak references
# without callbacks, pruned as they grow. tests/aio/test_finalizers.py and
# tests/store/test_finalizers.py check that dropping each kind of object runs
# no Python code; tests/checkpoint/test_interrupt.py samples the symptom.
class LiveHandles:
    """The handles of this process not closed yet, so that exit closes them and a forked child keeps
    theirs alive. ``AioHandle.live`` is the process's (exit and fork are the process's).

    Plain weak references without callbacks ([Note: finalizers run no Python]), pruned as they grow;
    no lock (dict operations under the GIL are atomic, and a lock held by another thread at fork
    would deadlock the child's hook)."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref[AioHandle]] = {}
        self._prune_at = 64

    def add(self, handle: AioHandle) -> None:
        if len(self._refs) >= self._prune_at:
            for key, ref in list(self._refs.items()):
                if ref() is None:
                    self._refs.pop(key, None)
            self._prune_at = max(64, 2 * len(self._refs))
        self._refs[id(handle)] = weakref.ref(handle)

    def discard(self, handle: AioHandle) -> None:
        self._refs.pop(id(handle), None)

    def handles(self) -> list[AioHandle]:
        return [h for h in (r() for r in list(self._refs.values())) if h is not None]

    def close_all(self) -> None:
        """At exit: every handle still open is drained and closed."""
        for h in self.handles():
            h.close()

    def keep_alive_in_child(self) -> None:
        """After fork, in the child: the parent's worker threads do not exist here, and destroying an
        engine would join threads that are gone. Every inherited engine is kept alive for good (a
        deliberate leak); the handles refuse use (``AioHandle._check``)."""
        import ctypes

        for h in self.handles():
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(h._engine))
        self._refs.clear()


class AioHandle:
    """Asynchronous NVMe I/O, built from one AioConfig.

    ``AioHandle(config)``, ``AioHandle(block_size=..., queue_depth=...)`` (the
    DeepSpeed ``aio`` keys, aliases included, as keyword arguments), or both
    (the keywords override the config's values): the keywords go through
    ``AioConfig.from_dict``, so they are checked and named the same way a
    config file's are. Requests larger than ``block_size`` are split into
    block_size pieces, kept ``queue_depth`` deep per worker; ``thread_count``
    workers share a request.
    """

    live: LiveHandles = LiveHandles()
    """This process's open handles (closed at exit, kept alive in a forked child)."""
    notices: Notices = Notices()
    """This process's fallback notices, each said once."""

    def __init__(self, config: AioConfig | None = None, /, **options: Any):
        if config is not None and not isinstance(config, AioConfig):
            raise TypeError(
                f"AioHandle takes an AioConfig (or aio keys as keyword arguments), got "
                f"{type(config).__name__}; for a DeepSpeed aio dict use AioHandle(**section)"
            )
        cfg = AioConfig.from_dict(options, base=config) if options else config or AioConfig()
        self._engine, resolved = _start_engine(cfg)
        # What is in use: ``engine`` says which back end "auto" became.
        self.config = dataclasses.replace(cfg, engine=resolved)
        self._pid = os.getpid()
        self._closed = False
        AioHandle.live.add(self)

    @classmethod
    def from_config(cls, config: AioConfig) -> AioHandle:
        """``AioHandle(config)``."""
        return cls(config)

    @property
    def engine(self) -> str:
        """The back end in use: 'io_uring' or 'threads'."""
        return self.config.engine

    @property
    def closed(self) -> bool:
        return self._closed

    # -- files ---------------------------------------------------------------

    def open(
        self, path: PathLike, mode: Literal["r", "w", "rw"] = "rw", *, create: bool = True
    ) -> AioFile:
        """Opens ``path`` once for many requests, O_DIRECT per this handle's ``o_direct``."""
        self._check("open", os.fspath(path), 0, 0)
        return open_file(path, mode, create=create, o_direct=self.config.o_direct)

    def _resolve(self, file: FileArg, write: bool) -> _aio.File:
        if isinstance(file, AioFile):
            return file._live("pwrite" if write else "pread")
        if isinstance(file, bool):  # an int, but never meant as a file descriptor
            raise TypeError(f"file must be an AioFile, a path or a file descriptor, got {file!r}")
        if isinstance(file, int):
            try:
                return _aio.file_from_fd(file)
            except OSError as e:
                raise AioError(
                    e.errno or errno.EBADF,
                    f"bad file descriptor {file}: {os.strerror(e.errno or errno.EBADF)}",
                ) from None
        # A path: opened for this request only, closed when it completes, so a
        # file replaced on disk is never served from a stale descriptor.
        return open_file(
            file, "rw" if write else "r", create=write, o_direct=self.config.o_direct
        )._live("pwrite" if write else "pread")

    # -- requests ------------------------------------------------------------

    def pread(self, buffer: Any, file: FileArg, offset: int = 0) -> AioRequest:
        """Reads len(buffer) bytes at ``offset`` into ``buffer``, asynchronously."""
        return self._submit(False, [(buffer, file, offset)])

    def pwrite(self, buffer: Any, file: FileArg, offset: int = 0) -> AioRequest:
        """Writes ``buffer`` at ``offset``, asynchronously (creating a file given by path)."""
        return self._submit(True, [(buffer, file, offset)])

    def sync_pread(self, buffer: Any, file: FileArg, offset: int = 0) -> int:
        return self.pread(buffer, file, offset).wait()

    def sync_pwrite(self, buffer: Any, file: FileArg, offset: int = 0) -> int:
        return self.pwrite(buffer, file, offset).wait()

    def pread_many(self, items: Iterable[tuple], file: FileArg | None = None) -> AioRequest:
        """One request for many reads: items are (buffer, offset) with ``file``, or (buffer, file, offset)."""
        return self._submit(False, _with_file(items, file))

    def pwrite_many(self, items: Iterable[tuple], file: FileArg | None = None) -> AioRequest:
        """One request for many writes: items are (buffer, offset) with ``file``, or (buffer, file, offset)."""
        return self._submit(True, _with_file(items, file))

    def _submit(self, write: bool, items: list[tuple[Any, FileArg, int]]) -> AioRequest:
        segments = []
        keep = []
        files: dict[int, _aio.File] = {}
        for buffer, file, offset in items:
            if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
                raise ValueError(f"offset must be a non-negative int, got {offset!r}")
            ptr, nbytes, k = buffer_span(buffer, writable=not write)
            self._check("pwrite" if write else "pread", file, offset, nbytes)
            key = id(file)
            raw = files.get(key)
            if raw is None:
                raw = files[key] = self._resolve(file, write)
            segments.append((ptr, nbytes, offset, raw))
            keep.append(k)
        try:
            raw_req = self._engine.submit(segments, write=write, keep=(keep, list(files.values())))
        except OSError as e:  # a file or this handle was closed by another thread meanwhile
            op = "pwrite" if write else "pread"
            _, file, offset = items[0]
            self._check(op, file, offset, 0)
            raise AioError(
                e.errno or errno.EBADF,
                f"{op} at offset {offset} on '{_name(file)}': the file was closed",
                _name(file),
                op=op,
                offset=offset,
            ) from None
        where = f"'{_name(items[0][1])}' at offset {items[0][2]}" if items else ""
        return AioRequest(raw_req, self._engine, where)

    def register_buffers(self, buffers: Iterable[Any]) -> None:
        """Registers buffers with io_uring (fixed buffers) so requests in them skip per-I/O page pinning.

        Buffers must stay alive while registered; pass ``[]`` to unregister. A no-op
        for the threads engine. Waits for requests in flight first.

        Not done by default: with 1 MiB pieces in huge-page memory, pinning per I/O
        costs little, and registration measured no faster here (read 2.76 vs 2.72,
        write 3.80 vs 3.83 GB/s, interleaved); it also pins the memory for the
        handle's lifetime (RLIMIT_MEMLOCK for non-root users) and caps each buffer
        at 1 GiB. It may pay off for small pieces at high IOPS.
        """
        self._check("register_buffers", "", 0, 0)
        ranges = []
        for b in buffers:
            ptr, n, _ = buffer_span(b, writable=True)
            # io_uring caps one registered buffer at 1 GiB.
            for off in range(0, n, 1 << 30):
                ranges.append((ptr + off, min(1 << 30, n - off)))
        if self.engine == "io_uring":
            try:
                self._engine.register_buffers(ranges)
            except OSError as e:
                self._check("register_buffers", "", 0, 0)  # closed meanwhile: say so
                raise AioError(
                    e.errno or errno.EIO,
                    f"io_uring_register_buffers of {len(ranges)} range(s) failed: {os.strerror(e.errno or errno.EIO)}"
                    + (
                        "; the locked-memory limit (ulimit -l) is too low for these buffers"
                        if e.errno == errno.ENOMEM
                        else ""
                    ),
                    op="register_buffers",
                ) from None

    def wait_all(self, timeout: float | None = None) -> None:
        """Waits until every request submitted on this handle has completed (GIL released)."""
        if self._closed:
            return
        if not self._engine.wait_all(-1.0 if timeout is None else float(timeout)):
            raise TimeoutError(f"requests still in flight after {timeout} s")

    def in_flight(self) -> int:
        """Requests submitted and not yet complete."""
        return 0 if self._closed else self._engine.in_flight()

    def close(self) -> None:
        """Waits for requests in flight, then stops the workers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() == self._pid:
            self._engine.shutdown()  # drains, then lets go of every request's buffers
        AioHandle.live.discard(self)

    def __enter__(self) -> AioHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check(self, op: str, file: Any, offset: int, nbytes: int) -> None:
        if self._closed:
            raise AioError(
                errno.EBADF,
                f"{op} of {nbytes} bytes at offset {offset} on '{_name(file)}': the AioHandle is closed",
                _name(file),
                op=op,
                offset=offset,
                nbytes=nbytes,
            )
        if os.getpid() != self._pid:
            raise AioError(
                errno.EBADF,
                f"{op} on '{_name(file)}': this AioHandle was created in process {self._pid} and its "
                "worker threads do not survive fork(); create a new handle in the child",
                _name(file),
                op=op,
            )

    def __repr__(self) -> str:
        c = self.config
        return (
            f"AioHandle(engine={c.engine!r}, block_size={c.block_size}, queue_depth={c.queue_depth}, "
            f"thread_count={c.thread_count}, o_direct={c.o_direct}{', closed' if self._closed else ''})"
        )


def _name(file: Any) -> str:
    if isinstance(file, AioFile):
        return file.path
    if isinstance(file, int):
        return f"<fd {file}>"
    try:
        return os.fspath(file)
    except TypeError:
        return repr(file)


def _with_file(items: Iterable[tuple], file: FileArg | None) -> list[tuple[Any, FileArg, int]]:
    out = []
    for it in items:
        if file is not None:
            buffer, offset = it
            out.append((buffer, file, offset))
        else:
            buffer, f, offset = it
            out.append((buffer, f, offset))
    return out


# SQEs per io_uring_enter when single_submit is off. More than two let the
# kernel plug the queue and merge adjacent pieces into requests larger than
# block_size, measured 35% slower on writes here ([Note: submit batches] in
# csrc/aio/uring_backend.cc).
SUBMIT_BATCH = 2


def _start_engine(cfg: AioConfig) -> tuple[_aio.Engine, Literal["io_uring", "threads"]]:
    def engine(backend: Literal["io_uring", "threads"]) -> _aio.Engine:
        return _aio.Engine(
            backend=backend,
            block_size=cfg.block_size,
            queue_depth=cfg.queue_depth,
            thread_count=cfg.thread_count,
            submit_batch=1 if cfg.single_submit else SUBMIT_BATCH,
            overlap_events=cfg.overlap_events,
        )

    if cfg.engine in ("auto", "io_uring"):
        reason = _aio.probe_io_uring()
        if not reason:
            try:
                return engine("io_uring"), "io_uring"
            except OSError as e:
                reason = f"io_uring_queue_init: {os.strerror(e.errno or errno.EIO)}"
        if cfg.engine == "io_uring":
            raise AioError(
                errno.ENOSYS,
                f"engine='io_uring' is not available here ({reason}); use engine='auto' to fall "
                "back to the threads engine",
            )
        AioHandle.notices.once(
            "engine",
            f"io_uring is not available ({reason}); using the threads I/O engine. In Docker, "
            "io_uring is blocked by the default seccomp profile (see docs/troubleshooting.md).",
        )
    return engine("threads"), "threads"


atexit.register(AioHandle.live.close_all)
os.register_at_fork(after_in_child=AioHandle.live.keep_alive_in_child)
