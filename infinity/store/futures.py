"""The store's asynchrony: I/O ops in flight, the futures callers hold, and the reaper that completes ops.

[Note: completing ops]
An IoOp is one submitted request (a read or write of one or several keys, or
a host-to-device copy). Its completion changes residency state and releases
or keeps pool regions, so it must run exactly once, whoever notices first:
- a caller waiting in ``StoreFuture.result()`` waits on the op's request
  (outside the store lock, GIL released), then completes it;
- otherwise the store's reaper thread notices (it waits on the oldest op a
  few ms at a time and sweeps the rest), so regions return to the pool even
  when nobody ever waits.
The first to take the op's claim (under the store lock) completes it; anyone
else waits for the op to be finished. Futures are resolved after the store lock is
released, so callbacks may call the store.

Threading: StoreFuture methods may be called from any thread. The reaper
holds its store weakly: a store that is dropped without close() is not kept
alive by it.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from infinity.aio.waits import wait_until
from infinity.timeline import Timeline

log = logging.getLogger("infinity.store")

REAPER_SLICE_S = 0.02


# Settling and slow-path waiting share one condition: settling is a few
# attribute writes under it, and a notify only when someone waits without an
# op to drive (rare); ops use it too. So a future costs far less than a concurrent.futures one
# (whose per-future Condition dominated fetch_many of many small keys).
_settle_cv = threading.Condition(threading.Lock())
_slow_waiters = 0


def _wait_for(predicate: Callable[[], bool], timeout: float | None) -> bool:
    global _slow_waiters
    with _settle_cv:
        _slow_waiters += 1
        try:
            return _settle_cv.wait_for(predicate, timeout)
        finally:
            _slow_waiters -= 1


class _Failed:
    """A request that could not even be submitted: it has ended, with ``exc``."""

    def __init__(self, exc: BaseException):
        self._exc = exc

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> None:
        raise self._exc


class IoOp:
    """One request in flight and the keys whose state its completion changes.

    ``req`` may be attached after the op is registered (reads are submitted
    after the store lock is released); until then the op has not ended.
    """

    __slots__ = (
        "kind",
        "req",
        "recs",
        "nbytes",
        "background",
        "claimed",
        "_finished",
        "t0",
        "preparer",
        "__weakref__",
    )

    def __init__(self, kind: str, req: Any, recs: list, nbytes: int, *, background: bool = False):
        self.kind = kind  # "read" | "write" | "h2d"
        self.req = (
            req  # AioRequest, or anything with wait(timeout) and done(); None until submitted
        )
        self.recs = recs
        self.nbytes = nbytes
        self.background = (
            background  # a write-back nobody waits for (errors are kept on the record)
        )
        self.claimed = False
        self._finished = False
        self.t0 = time.monotonic()
        # Who will submit an op registered without its request: the registering thread, right after
        # it releases the store lock (read_path.prepare_read / submit_read).
        self.preparer = threading.current_thread() if req is None else None

    def attach(self, req: Any) -> None:
        with _settle_cv:
            self.req = req
            if _slow_waiters:
                _settle_cv.notify_all()

    def fail_submit(self, exc: BaseException) -> None:
        self.attach(_Failed(exc))

    def io_done(self) -> bool:
        req = self.req
        return req is not None and bool(req.done())

    def wait_io(self, timeout: float | None) -> bool:
        """Waits until the request has ended (successfully or not); False on timeout.

        Long waits are logged ([Note: no silent waits]): the request's own wait names its file
        and offset; before it is submitted, this names the op."""
        if self.req is None and not self._wait_submitted(timeout):
            return False
        try:
            self.req.wait(timeout)
        except TimeoutError:
            return self.io_done()
        except Exception:
            pass  # a failed request has ended; its error is raised when the op completes
        return True

    def wait_error(self) -> BaseException | None:
        """Waits until the request has ended; its exception, or None if it succeeded."""
        if self.req is None:
            self._wait_submitted(None)
        try:
            self.req.wait(None)
        except Exception as e:
            return e
        return None

    def _wait_submitted(self, timeout: float | None) -> bool:
        self._fail_if_orphaned()
        return wait_until(
            lambda s: _wait_for(lambda: self.req is not None, s),
            what=lambda: (
                f"the {self.describe()} to be submitted (its thread is still preparing it)"
            ),
            log=log,
            timeout=timeout,
        )

    def _fail_if_orphaned(self) -> None:
        """An op its preparer can no longer submit fails instead of being waited for forever: the waiter
        is the preparer itself (an exception, KeyboardInterrupt above all, landed between registering
        and submitting, and the thread went on to close the store), or the preparer is gone."""
        t = self.preparer
        if (
            self.req is None
            and t is not None
            and (t is threading.current_thread() or not t.is_alive())
        ):
            self.fail_submit(
                RuntimeError(
                    f"the {self.describe()} was never submitted: thread {t.name}, which registered it, was "
                    "interrupted before it could (the read failed; fetch the keys again)"
                )
            )

    def describe(self) -> str:
        """What the op is, for messages: "read of 3 keys (1.0 MiB), started 2.0 s ago"."""
        n = len(self.recs)
        keys = f"key {self.recs[0].key!r}" if n == 1 else f"{n} keys"
        return (
            f"{self.kind} of {keys} ({self.nbytes} bytes), started "
            f"{time.monotonic() - self.t0:.1f} s ago"
        )

    def error(self) -> BaseException | None:
        """The request's exception, once it has ended."""
        try:
            self.req.wait(0)
        except TimeoutError:
            raise AssertionError("IoOp.error() before the request ended") from None
        except Exception as e:
            return e
        return None

    @property
    def finished(self) -> bool:
        """Completed: states changed and its futures settled."""
        return self._finished

    def set_finished(self) -> None:
        with _settle_cv:
            self._finished = True
            if _slow_waiters:
                _settle_cv.notify_all()

    def wait_finished(self, timeout: float | None = None) -> bool:
        return self._finished or wait_until(
            lambda s: _wait_for(lambda: self._finished, s),
            what=lambda: f"another thread to complete the {self.describe()}",
            log=log,
            timeout=timeout,
        )


class Outcome(NamedTuple):
    """How an op's request ended, found by whoever completes the op, before it takes the store lock."""

    error: BaseException | None  # None: it succeeded
    crcs: list[int] | None = None  # integrity mode: each key's CRC32C, in op.recs order


class StoreFuture:
    """A store operation's result: ``result(timeout=None)``, ``done()``, ``exception()``,
    ``add_done_callback()``.

    Waiting drives completion (see [Note: completing ops]); time spent blocked
    in ``result`` is counted in the store's ``stats().wait_s``.
    """

    __slots__ = (
        "_store",
        "_op",
        "_label",
        "_deps",
        "_done",
        "_value",
        "_exc",
        "_callbacks",
        "__weakref__",
    )

    def __init__(self, store: Any = None, op: IoOp | None = None, label: str | tuple = ""):
        self._store = store
        self._op = op
        self._label = label
        self._deps: Sequence[StoreFuture] = ()
        self._done = False
        self._value: Any = None
        self._exc: BaseException | None = None
        self._callbacks: list | None = None

    def done(self) -> bool:
        return self._done

    def follow(self, op: IoOp) -> None:
        """Makes ``op`` the op whose completion settles this future: waiting on it drives ``op``."""
        self._op = op

    def cancel(self) -> bool:
        return False  # store transitions cannot be undone half way

    def cancelled(self) -> bool:
        return False

    def result(self, timeout: float | None = None) -> Any:
        if not self._done:
            self._drive(timeout)
        if self._exc is not None:
            raise self._exc
        return self._value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self._done:
            self._drive(timeout)
        return self._exc

    def add_done_callback(self, fn: Callable[[StoreFuture], Any]) -> None:
        with _settle_cv:
            if not self._done:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        fn(self)

    def set_result(self, value: Any) -> None:
        self._settle(value, None)

    def set_exception(self, exc: BaseException) -> None:
        self._settle(None, exc)

    def _settle(self, value: Any, exc: BaseException | None) -> None:
        with _settle_cv:
            if self._done:
                raise RuntimeError(f"{self!r} is already done")
            self._value = value
            self._exc = exc
            self._done = True
            callbacks, self._callbacks = self._callbacks, None
            if _slow_waiters:
                _settle_cv.notify_all()
        for fn in callbacks or ():
            try:
                fn(self)
            except Exception:
                log.exception("infinity store: a future's done-callback raised")

    def _drive(self, timeout: float | None) -> None:
        t0 = time.monotonic()
        deadline = None if timeout is None else t0 + timeout
        try:
            for dep in self._deps:
                dep._drive(_remaining(deadline))
            traced, op = Timeline.active is not None, self._op
            if not self._done and not wait_until(
                self._step,
                # Traced, the span is named once the wait ends, when its op has finished: what
                # it waits for is bound now.
                what=(
                    functools.partial(self._wait_text, op, op is None or op.finished)
                    if traced
                    else self._waiting_for
                ),
                log=log,
                timeout=_remaining(deadline),
                kind=self._wait_kind() if traced else None,
            ):
                raise TimeoutError(self._timeout_message(timeout))
        finally:
            if self._store is not None:
                self._store._count_wait(time.monotonic() - t0)

    def _step(self, slice_s: float) -> bool:
        """One slice of a wait: drives the op in flight, if any ([Note: completing ops]); True once done."""
        op = self._op
        if op is not None and self._store is not None and not op.finished:
            if op.wait_io(slice_s):
                self._store._finish(op)  # settles the futures it resolves before returning
            return self._done
        # Settled by another thread (one finding a region, a write this fetch
        # follows, a device copy it was moved to): wait for it, a short slice at a
        # time so a newly attached op gets driven.
        _wait_settled(self, min(slice_s, 0.01))
        return self._done

    def _wait_kind(self) -> str:
        """What a wait on this future waits for, as the timeline names it (a read, a write...)."""
        op = self._op
        if op is None or op.finished:
            return "pool" if self._store is not None else "other"
        return op.kind if op.kind in ("read", "write") else "other"

    def _waiting_for(self) -> str:
        op = self._op
        return self._wait_text(op, op is None or op.finished)

    def _wait_text(self, op: IoOp | None, settled: bool) -> str:
        """What a wait on this future waits for: ``op``, or (``settled``) another thread."""
        store = f" in store '{self._store.name}'" if self._store is not None else ""
        if settled or op is None:
            return (
                f"{self.label}{store} (settled by another thread: finding pool memory or copying)"
            )
        return f"{self.label}{store}: its {op.describe()}"

    @property
    def label(self) -> str:
        """What the future is for, e.g. "fetch of key 'w'" (formatted only when asked)."""
        if isinstance(self._label, tuple):
            verb, key = self._label
            return f"{verb} {key!r}"
        return self._label or "store operation"

    def _timeout_message(self, timeout: float | None) -> str:
        return f"{self.label} not complete after {timeout} s"

    def __repr__(self) -> str:
        return f"<StoreFuture {self.label} {'done' if self._done else 'pending'}>"


def _wait_settled(fut: StoreFuture, timeout: float) -> bool:
    return _wait_for(lambda: fut._done, timeout)


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)


Settlement = tuple[StoreFuture | None, Any, BaseException | None]
"""(future, value, exception) decided under the store lock, settled by ``settle`` after it."""


def settle(settlements: list[Settlement]) -> None:
    """Settles futures decided under the store lock; called after releasing it, so that their
    callbacks may call the store (see [Note: completing ops]). A future settled already is left."""
    for fut, value, exc in settlements:
        if fut is None or fut.done():
            continue
        if exc is None:
            fut.set_result(value)
        else:
            fut.set_exception(exc)


def done_future(value: Any = None, label: str = "") -> StoreFuture:
    f = StoreFuture(label=label)
    f.set_result(value)
    return f


def gather(futures: Sequence[StoreFuture], label: str) -> StoreFuture:
    """A future that completes when all of ``futures`` have; it raises the first failure.

    It has no store of its own: waiting on it drives (and is counted by) its dependencies."""
    out = StoreFuture(None, None, label)
    out._deps = tuple(futures)
    if not futures:
        out.set_result(None)
        return out
    left = [len(futures)]
    lock = threading.Lock()

    def one_done(_f: StoreFuture) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        for f in futures:
            exc = f.exception(0)
            if exc is not None:
                out.set_exception(exc)
                return
        out.set_result(None)

    for f in futures:
        f.add_done_callback(one_done)
    return out


class Reaper:
    """A daemon thread that completes a store's ops nobody waits for (see [Note: completing ops]).

    Ops reach it through a ``queue.SimpleQueue``, not a lock-guarded list: ``put`` runs no Python
    code, so a KeyboardInterrupt in the thread that adds an op cannot land between acquiring and
    releasing a lock (a ``with lock:`` whose ``__enter__`` is interrupted after the acquire never
    releases it; that left this thread blocked and ``close`` waiting on it forever)."""

    _STOP = object()

    def __init__(self, owner: Any, name: str):
        # A plain weak reference to the store (whose ``_finish`` completes ops): a WeakMethod's own
        # callback would run Python code when the store is dropped ([Note: finalizers run no Python]).
        self._owner = weakref.ref(owner)
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._run, name=f"infinity-store-reaper[{name}]", daemon=True
        )
        self._thread.start()

    def add(self, op: IoOp) -> None:
        self._inbox.put(op)

    def stop(self) -> None:
        self._inbox.put(self._STOP)
        thread = self._thread
        if thread is not threading.current_thread():

            def stopped(slice_s: float) -> bool:
                thread.join(slice_s)
                return not thread.is_alive()

            wait_until(
                stopped,
                what=f"thread {thread.name} to stop (it is completing an op)",
                log=log,
            )

    def _take(self, ops: list[IoOp]) -> bool:
        """Move what ``add`` queued into ``ops``, waiting up to 1 s for the first one when there
        is nothing to watch. False once ``stop`` was called."""
        try:
            item = self._inbox.get(timeout=1.0) if not ops else self._inbox.get_nowait()
            while True:
                if item is self._STOP:
                    return False
                ops.append(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            return True

    def _run(self) -> None:
        ops: list[IoOp] = []
        while True:
            if not self._take(ops):
                return
            if not ops:
                if self._owner() is None:
                    return
                continue
            ops[0].wait_io(REAPER_SLICE_S)
            # One pass: an op that ends between two passes would be dropped unnoticed.
            ended: list[IoOp] = []
            pending: list[IoOp] = []
            for op in ops:
                (ended if op.claimed or op.io_done() else pending).append(op)
            ops = pending
            owner = self._owner()
            if owner is None:
                return
            for op in ended:
                try:
                    owner._finish(op, wait=False)
                except Exception:  # never let the reaper die: later ops would go unnoticed
                    log.exception("infinity store reaper: completing an op failed")
            del owner
