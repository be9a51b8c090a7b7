"""Long waits that say what they wait for: a log line every few seconds, and the cause when one is known.

[Note: no silent waits]
Every blocking wait of the runtime (an I/O request, pool space, a store
future, the overlapped optimizer step, the scheduler's fetch lock...) goes
through ``wait_until``. The wait is cut into slices; after each slice it
- asks ``cause()``, which returns the exception that means the wait can never
  end well (a failed write-back that holds the memory waited for, a closed
  store, a thread that died), and raises it at once, instead of a bare
  timeout minutes later;
- every ``LOG_EVERY_S`` seconds logs a warning naming what is awaited, for
  how long so far, and (``holder()``) who holds it;
and once a wait that logged ends, one line says how long it took. A wait
that ends within the first slice costs one call of ``ready`` and nothing
else. ``INFINITY_WAIT_LOG_S`` sets the interval (seconds).
A wait given a ``kind`` (what it waits for: a read, a write, pool memory, the
optimizer, a lock) is a span of the timeline while one records ([Note: the
timeline] in infinity/timeline/recorder.py), named by ``what``, if it lasts
at least ``SPAN_MIN_S``.

Threading: ``wait_until`` is called by the waiting thread and keeps no state
between calls; ``ready``, ``cause`` and ``holder`` run in that thread, must
not block longer than the slice they are given (``ready``) or at all (the
others), and are called with no lock of the caller held.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from infinity.timeline import Timeline

LOG_EVERY_S = float(os.environ.get("INFINITY_WAIT_LOG_S", "5"))
"""Seconds between the log lines of one long wait."""

SPAN_MIN_S = 20e-6
"""Shorter waits (a free lock, a request already done) are not timeline spans: they are not waits
anyone would look for, and there are many."""

SLICE_S = 1.0
"""Longest slice between two looks at ``cause`` (shorter when LOG_EVERY_S is)."""

Text = str | Callable[[], str]


def _text(t: Text | None) -> str:
    if t is None:
        return ""
    return t() if callable(t) else t


def wait_until(
    ready: Callable[[float], bool],
    *,
    what: Text,
    log: logging.Logger,
    timeout: float | None = None,
    cause: Callable[[], BaseException | None] | None = None,
    holder: Text | None = None,
    kind: str | None = None,
) -> bool:
    """Calls ``ready(slice_s)`` (which blocks up to ``slice_s`` seconds and says whether the wait is
    over) until it returns True, then returns True; False once ``timeout`` seconds have passed.

    Raises what ``cause()`` returns as soon as it returns an exception. ``what`` names what is
    awaited ("fetch of key 'w'", "pool space"), ``holder`` who holds it; both may be callables,
    formatted only when a line is logged. ``kind``: a timeline span of that kind (see above)."""
    tl = Timeline.active
    if tl is None or kind is None:
        return _wait_until(ready, what, log, timeout, cause, holder)
    if not tl.keeps_spans:  # a profiler's range, opened before the wait
        token = tl.begin(_text(what), "wait", {"kind": kind})
        try:
            return _wait_until(ready, what, log, timeout, cause, holder)
        finally:
            tl.end(token)
    t0 = time.monotonic()
    try:
        return _wait_until(ready, what, log, timeout, cause, holder)
    finally:
        t1 = time.monotonic()
        if t1 - t0 >= SPAN_MIN_S:  # named once it ends: ``what`` must name what it waited for
            tl.span(_text(what), "wait", t0, t1, args={"kind": kind})


def _wait_until(
    ready: Callable[[float], bool],
    what: Text,
    log: logging.Logger,
    timeout: float | None,
    cause: Callable[[], BaseException | None] | None,
    holder: Text | None,
) -> bool:
    t0 = time.monotonic()
    if ready(_first_slice(timeout)):
        return True
    deadline = None if timeout is None else t0 + timeout
    every = max(LOG_EVERY_S, 0.01)
    next_log = t0 + every
    logged = False
    try:
        while True:
            if cause is not None:
                exc = cause()
                if exc is not None:
                    raise exc
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return False
            if now >= next_log:
                who = _text(holder)
                log.warning(
                    "still waiting after %.1f s for %s%s",
                    now - t0,
                    _text(what),
                    f"; held by {who}" if who else "",
                )
                logged = True
                next_log = now + every
            step = min(SLICE_S, every, max(next_log - now, 0.001))
            if deadline is not None:
                step = min(step, max(deadline - now, 0.0))
            if ready(step):
                return True
    finally:
        if logged:
            log.warning("waited %.1f s for %s", time.monotonic() - t0, _text(what))


def _first_slice(timeout: float | None) -> float:
    step = min(SLICE_S, max(LOG_EVERY_S, 0.01))
    return step if timeout is None else min(step, timeout)


def result_of(
    fut: concurrent.futures.Future,
    *,
    what: Text,
    log: logging.Logger,
    cause: Callable[[], BaseException | None] | None = None,
    kind: str | None = None,
) -> Any:
    """``fut.result()`` of a concurrent.futures.Future (work handed to a thread pool), waiting
    as ``wait_until`` does."""
    wait_until(
        lambda s: bool(concurrent.futures.wait((fut,), timeout=s).done),
        what=what,
        log=log,
        cause=cause,
        kind=kind,
    )
    return fut.result()
