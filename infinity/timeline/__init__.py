"""A timeline of a run: spans emitted by every layer while a recording is active, written as a
Chrome-trace / Perfetto file ([Note: the timeline] in recorder.py).

The lowest layer beside ``infinity.host``, so that the store, the I/O engine's waits, the scheduler,
the partitioner and the optimizer can all emit into it. Imports only the standard library (and torch).
"""

from infinity.timeline.chrome import check_trace, read_trace, trace_events, write_trace
from infinity.timeline.recorder import (
    CATEGORIES,
    WAIT_KINDS,
    ProfilerRanges,
    Span,
    Timeline,
    profiler_running,
)

__all__ = [
    "CATEGORIES",
    "WAIT_KINDS",
    "ProfilerRanges",
    "Span",
    "Timeline",
    "check_trace",
    "profiler_running",
    "read_trace",
    "trace_events",
    "write_trace",
]
