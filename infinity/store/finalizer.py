"""Cleanup of objects dropped without close(), run in a thread of its own, never in the dropping thread.

``on_collect(obj, fn, *args)`` arranges for ``fn(*args)`` to run once ``obj``
has been collected, like ``weakref.finalize``, with one difference that
matters: the thread that drops the last reference runs no Python code. The
weak reference's callback is ``SimpleQueue.put``, a C function, so it only
queues the reference; the ``infinity-finalizer`` thread takes it from the
queue and runs ``fn``. Python code run by a finalizer in the main thread is
where a KeyboardInterrupt lands and is lost ("Exception ignored in ...",
training goes on): see [Note: finalizers run no Python] in
infinity/aio/handle.py. Signals are delivered to the main thread only, so the
finalizer thread cannot swallow one.

As with ``weakref.finalize``, callbacks still pending at interpreter exit run
then (in the exiting thread), so a store never closed still removes its swap
files. A forked child forgets its parent's pending callbacks: the objects,
and what their cleanup would remove, belong to the parent.

Threading: ``on_collect``, ``Finalizer.detach`` and ``drain`` may be called
from any thread; ``_lock`` guards the table of pending callbacks; ``fn`` runs
without it, in the finalizer thread (or at exit), and must not wait for the
thread that dropped ``obj``.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

log = logging.getLogger("infinity.store")

_queue: queue.SimpleQueue[Any] = queue.SimpleQueue()  # the C implementation: put() runs no Python
_pending: dict[int, tuple[weakref.ref, Callable[..., None], tuple]] = {}
_lock = threading.Lock()
_thread: threading.Thread | None = None


class Finalizer:
    """What ``on_collect`` returns: ``detach()`` cancels the callback (e.g. after an explicit close)."""

    __slots__ = ("_ref",)

    def __init__(self, ref: weakref.ref):
        self._ref = ref

    def detach(self) -> None:
        with _lock:
            _pending.pop(id(self._ref), None)

    @property
    def alive(self) -> bool:
        """Whether the callback is still to run."""
        with _lock:
            return id(self._ref) in _pending


def on_collect(obj: object, fn: Callable[..., None], *args: Any) -> Finalizer:
    """Runs ``fn(*args)`` in the finalizer thread once ``obj`` is collected (see the module docstring).

    ``args`` must not refer to ``obj``, or it is never collected."""
    ref = weakref.ref(obj, _queue.put)
    with _lock:
        _pending[id(ref)] = (ref, fn, args)
        _start()
    return Finalizer(ref)


def drain(timeout: float | None = None) -> bool:
    """Waits until the callbacks of objects collected so far have run; False on timeout."""
    done = threading.Event()
    with _lock:
        _start()
    _queue.put(done)
    return done.wait(timeout)


def _start() -> None:
    """Starts the finalizer thread if it is not running (under ``_lock``)."""
    global _thread
    if _thread is None or not _thread.is_alive():
        _thread = threading.Thread(target=_run, name="infinity-finalizer", daemon=True)
        _thread.start()


def _run() -> None:
    while True:
        item = _queue.get()
        if isinstance(item, threading.Event):
            item.set()
            continue
        with _lock:
            entry = _pending.pop(id(item), None)
        if entry is not None:
            _call(entry)
        del item, entry


def _call(entry: tuple[weakref.ref, Callable[..., None], tuple]) -> None:
    _ref, fn, args = entry
    try:
        fn(*args)
    except Exception:
        log.exception("infinity: cleaning up after an object dropped without close() failed")


def _run_pending_at_exit() -> None:
    """Like weakref.finalize(atexit=True): what is still pending runs now, in the exiting thread."""
    if _thread is not None and _thread.is_alive():
        drain(5.0)  # let a callback already taken from the queue finish first
    with _lock:
        entries = list(_pending.values())
        _pending.clear()
    for entry in entries:
        _call(entry)


def _forget_in_child() -> None:
    global _thread, _lock
    _lock = threading.Lock()  # another thread may have held it at fork()
    _pending.clear()
    _thread = None


atexit.register(_run_pending_at_exit)
os.register_at_fork(after_in_child=_forget_in_child)
