"""Timeline: the spans of a recorded window (compute, reads, writes, waits, optimizer), kept in memory.

[Note: the timeline]
Every layer that does work worth seeing on a timeline emits it here: the
store its reads and writes (start at submit, end when the store completes
the request), ``wait_until`` every blocking wait with what it waited for,
the scheduler each unit's wait at acquire, the partitioner each unit's
forward, backward and recomputation, the optimizer its sub-groups, the
engine its phases. What a site does when nothing is recording is one read
of ``Timeline.active`` and a test against None: no clock read, no string
formatted, no allocation. A recording is switched on per step by whoever
owns the run (the engine's tracing window), so a step that is not recorded
pays that test and nothing else.

Two kinds of sink: ``Timeline`` keeps the spans for a Chrome-trace file
(chrome.py); ``ProfilerRanges`` turns the spans that begin and end on one
thread (compute, waits, sub-groups, phases) into ``torch.profiler``
``record_function`` ranges, so they appear inside a profiler's own trace
while one is running. Spans that start on one thread and end on another (a
read submitted here and completed by the store's reaper) cannot be a
profiler range; they appear there as the waits for them, which name the key.

Sites emit in one of three ways:
- ``begin(...)`` / ``end(token)`` around synchronous work on the calling thread;
- ``span(...)`` with a start and end taken from ``time.monotonic()``, for
  work whose start was stamped earlier (an I/O request);
- ``deferred(fmt, payload)``: the span's raw fields now, its name and
  ``args`` made by ``fmt(*payload)`` only when the spans are read (``spans()``),
  for sites where formatting costs more than the work (an I/O completion
  under a store's lock, a scheduler's acquire). ``payload`` must not change
  after the call.

[Note: recording costs no lock]
A recording's cost is what its sites add to the step, and on the I/O
threads that is latency the compute waits for, so emitting takes no lock and
formats nothing it can put off: each thread appends plain tuples to its own
list (found through a ``threading.local``; a list append is atomic), and only
a thread's first span of a recording takes the lock that registers its list.
Names, ``args`` dicts and ``Span`` objects are made by ``spans()``, after the
recording stops, by the thread that reads them. Measured as the emitting
thread's CPU time: a span 0.6 us, where a ``Span`` appended under a lock was
1.2 us; a completed read or write 0.5 us under its store's lock, where
formatting its keys there was 4.4 us (docs/tracing.md, "What it costs").

Threading: any thread may emit at any time; ``Timeline.active`` is switched by
one thread (the run's owner) and read without a lock: a span emitted just as a
recording stops may land in it or not, never half.

Imports only the standard library (and torch, for profiler ranges).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar

CATEGORIES = ("compute", "read", "write", "wait", "optimizer", "phase", "copy")
"""What a span is: unit compute, an NVMe read or write, a blocking wait, an optimizer sub-group,
an engine phase (forward, backward, step), a host-device copy."""

WAIT_KINDS = ("read", "write", "pool", "optimizer", "lock", "other")
"""What a wait waited for: a read, a write, pool memory, the optimizer, a lock, other."""


class Span:
    """One finished span: [start, end) in ``time.monotonic()`` seconds, on track ``track``."""

    __slots__ = ("name", "cat", "start", "end", "track", "args")

    def __init__(
        self, name: str, cat: str, start: float, end: float, track: str, args: dict | None
    ):
        self.name = name
        self.cat = cat
        self.start = start
        self.end = end
        self.track = track
        self.args = args or {}

    @property
    def duration(self) -> float:
        return self.end - self.start

    def __repr__(self) -> str:
        return f"Span({self.cat}:{self.name!r} on {self.track}, {self.duration * 1e3:.3f} ms)"


class Timeline:
    """A recording in progress: the spans emitted while it is ``Timeline.active``
    ([Note: recording costs no lock])."""

    active: ClassVar[Timeline | ProfilerRanges | None] = None
    """The sink sites emit to (one per process, as a profiler is); None: nothing records."""

    keeps_spans: ClassVar[bool] = True
    """Spans stamped after the fact (``span``, ``deferred``) are kept."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._buffers: list[tuple[str, list[tuple]]] = []  # (thread name, its records)
        self._register = threading.Lock()  # a thread's first span only
        self.started = time.monotonic()
        self.stopped: float | None = None

    # -- emitting ------------------------------------------------------------------

    def _records(self) -> list[tuple]:
        """The calling thread's own list, registered at its first span."""
        try:
            return self._local.records
        except AttributeError:
            records: list[tuple] = []
            with self._register:
                self._buffers.append((threading.current_thread().name, records))
            self._local.records = records
            return records

    def begin(self, name: str, cat: str, args: dict | None = None) -> Any:
        """Starts a span on the calling thread; pass what it returns to ``end``."""
        return (name, cat, args, time.monotonic())

    def end(self, token: Any, args: dict | None = None) -> None:
        name, cat, first, t0 = token
        if args:
            first = {**first, **args} if first else args
        self._records().append((name, cat, t0, time.monotonic(), None, first))

    def span(
        self,
        name: str,
        cat: str,
        start: float,
        end: float,
        *,
        track: str | None = None,
        args: dict | None = None,
    ) -> None:
        """A finished span; ``track`` defaults to the calling thread's name."""
        self._records().append((name, cat, start, end, track, args))

    def deferred(self, fmt: Callable[..., tuple], payload: tuple) -> None:
        """A finished span whose fields ``fmt(*payload)`` makes when the spans are read:
        ``(name, cat, start, end, track or None, args)``."""
        self._records().append((fmt, payload))

    # -- switching ------------------------------------------------------------------

    def start(self) -> Timeline:
        """Makes this the active recording (refused while another sink is active)."""
        if Timeline.active is not None and Timeline.active is not self:
            raise RuntimeError(
                "another timeline recording is active in this process; stop it first"
            )
        self.started = time.monotonic()
        Timeline.active = self
        return self

    def stop(self) -> None:
        """Stops recording (cheap: what was recorded is made into spans by ``spans()``)."""
        if Timeline.active is self:
            Timeline.active = None
        self.stopped = time.monotonic()

    def spans(self) -> list[Span]:
        """The spans recorded, in order of start (deferred ones formatted now)."""
        with self._register:
            buffers = list(self._buffers)
        out = []
        for thread, records in buffers:
            for r in list(records):
                if len(r) == 2:
                    fmt, payload = r
                    r = fmt(*payload)
                name, cat, start, end, track, args = r
                out.append(Span(name, cat, start, end, track or thread, args))
        out.sort(key=lambda s: s.start)
        return out


class ProfilerRanges:
    """Spans as ``torch.profiler`` ranges (``record_function``) while a profiler runs; nothing kept."""

    keeps_spans: ClassVar[bool] = False
    """A range must be open while its work runs: ``span`` after the fact is dropped."""

    def __init__(self) -> None:
        from torch.autograd.profiler import record_function

        self._range = record_function

    def begin(self, name: str, cat: str, args: dict | None = None) -> Any:
        label = f"infinity/{cat}: {name}"
        if args:
            label += " (" + ", ".join(f"{k}={v}" for k, v in args.items()) + ")"
        r = self._range(label)
        r.__enter__()
        return r

    def end(self, token: Any, args: dict | None = None) -> None:
        token.__exit__(None, None, None)

    def span(self, name: str, cat: str, start: float, end: float, **kw: Any) -> None:
        """A span stamped after the fact (I/O ended on another thread): no profiler range can hold
        it; the waits for it are ranges of their own."""

    def deferred(self, fmt: Callable[..., tuple], payload: tuple) -> None:
        """Stamped after the fact too: dropped, as ``span``."""

    def start(self) -> ProfilerRanges:
        if Timeline.active is not None and Timeline.active is not self:
            raise RuntimeError(
                "another timeline recording is active in this process; stop it first"
            )
        Timeline.active = self
        return self

    def stop(self) -> None:
        if Timeline.active is self:
            Timeline.active = None


def profiler_running() -> bool:
    """Whether a torch.profiler (or autograd profiler) is recording in this process."""
    import torch

    return bool(torch.autograd._profiler_enabled())
