"""The ``trace`` section: record chosen steps as a timeline file the Perfetto UI opens (infinity's own).

DeepSpeed has no such section. ``INFINITY_TRACE=PATH[:FIRST[-LAST]]`` sets the
same from the environment (``parse_trace_env``) and overrides the section: the
run records steps FIRST..LAST (counted from 0, optimizer steps) into PATH. What
a recording holds, and what it costs, is docs/tracing.md; the recorder is
infinity.timeline, the window the engine's (infinity/engine/tracing.py).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from infinity.config.errors import ConfigError
from infinity.config.values import check_section, knob

ENV = "INFINITY_TRACE"


@dataclasses.dataclass(frozen=True)
class TraceConfig:
    """``trace``: a timeline of chosen optimizer steps, written as Chrome-trace / Perfetto JSON."""

    PATH: ClassVar[str] = "trace"

    enabled: bool = knob(False)
    """Record the steps below and write them to output_path."""
    output_path: str = knob("infinity_trace.json")
    """The file written (its directory must exist and be writable); with several ranks, each rank
    writes its own, ``.rank<N>`` before the suffix."""
    first_step: int = knob(2, ge=0)
    """The first optimizer step recorded, counted from 0 (the default skips the step that records
    the prefetch order and one more)."""
    steps: int = knob(1, ge=1)
    """How many optimizer steps are recorded (each with all its micro-batches)."""

    def __post_init__(self) -> None:
        check_section(self)


def parse_trace_env(value: str) -> TraceConfig:
    """``INFINITY_TRACE``'s value as a section: ``PATH``, ``PATH:FIRST`` or ``PATH:FIRST-LAST``."""
    path, sep, steps = value.rpartition(":")
    if not sep or not steps or not steps.replace("-", "").isdigit():
        path, steps = value, ""
    if not path:
        raise ConfigError(
            f"{ENV}={value!r} names no file: set it to PATH, PATH:FIRST or PATH:FIRST-LAST "
            "(e.g. trace.json:2-3)"
        )
    if not steps:
        return TraceConfig(enabled=True, output_path=path)
    first, _, last = steps.partition("-")
    try:
        lo = int(first)
        hi = int(last) if last else lo
    except ValueError:
        lo, hi = -1, -1
    if lo < 0 or hi < lo:
        raise ConfigError(
            f"{ENV}={value!r}: the steps after ':' must be FIRST or FIRST-LAST with "
            "0 <= FIRST <= LAST (e.g. trace.json:2-3)"
        )
    return TraceConfig(enabled=True, output_path=path, first_step=lo, steps=hi - lo + 1)
