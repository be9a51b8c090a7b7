"""TraceCursor: follows the known traces through one step, and notices when the model leaves them.

[Note: divergence]
Step 0 records the order of ``acquire`` calls. From then on each step
*replays* the most recently completed trace: every use is compared with the
trace at the cursor.
- A match advances the cursor; the scheduler prefetches ahead of it.
- The first mismatch (another unit, or a use past the trace's end) looks for
  another known trace (up to ``max_traces`` are kept, most recent first) that
  begins with exactly the uses seen so far in this step; if one does, the
  cursor *switches* to it and replay goes on (a model alternating between
  branches pays one on-demand fetch per switch). Otherwise the step
  *diverges*: every later use is served on demand, the scheduler drops what
  it fetched or kept on the old trace's word, and the step is recorded.
- ``end(completed=True)`` of a diverged (or recording) step makes what it saw
  the newest trace: the model is re-recorded. A step that ends early having
  matched a prefix (an eval forward under no_grad, no backward) is *short*: it
  changes no trace, so evaluation between training steps does not cost the
  training trace.
- ``end(completed=False)`` (an aborted step: an exception mid-forward) records
  nothing: a partial sequence would only mislead the next step.
Traces name keys, never data: a wrong prediction can cost a wasted read, never
the wrong unit's data (the scheduler hands out what the store fetched for the
key asked for).

Threading: none; the scheduler calls it under its lock.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Hashable

from infinity.schedule.trace import Trace


class StepMode(enum.Enum):
    """What the cursor is doing in the current step."""

    IDLE = "idle"
    """Between steps: uses are not traced."""
    RECORD = "record"
    """No trace is known yet: uses are recorded and served on demand."""
    REPLAY = "replay"
    """Every use so far matched ``trace``; the cursor points at the next expected use."""
    DIVERGED = "diverged"
    """A use matched no known trace: the rest of the step is served on demand and recorded."""


class StepKind(enum.Enum):
    """How a step ended (``StepStats.kind``)."""

    RECORDED = "recorded"
    """No trace was known; this step's uses became the trace."""
    REPLAYED = "replayed"
    """Every use matched a known trace, to its end."""
    SHORT = "short"
    """Every use matched, but the step ended before the trace did (e.g. an eval forward); no trace changed."""
    DIVERGED = "diverged"
    """A use matched no known trace; this step's uses became the newest trace."""
    ABORTED = "aborted"
    """Ended by abort_step (or by begin_step with the step still open); nothing was recorded."""


class Seen(enum.Enum):
    """What one use was, as ``TraceCursor.observe`` tells the scheduler."""

    UNTRACED = "untraced"
    RECORDED = "recorded"
    MATCH = "match"
    SWITCH = "switch"
    MISMATCH = "mismatch"


@dataclasses.dataclass(frozen=True)
class Observation:
    seen: Seen
    pos: int | None
    """The use's position in the followed trace (MATCH, SWITCH), else None."""


class TraceCursor:
    def __init__(self, *, max_traces: int = 4):
        if max_traces < 1:
            raise ValueError(f"max_traces must be >= 1, got {max_traces}")
        self.max_traces = max_traces
        self.library: list[Trace] = []  # most recently completed first
        self.mode = StepMode.IDLE
        self.trace: Trace | None = None
        self.pos = 0
        self.observed: list[tuple[Hashable, int]] = []
        self.divergence_pos: int | None = None
        self.switches = 0

    @property
    def replaying(self) -> bool:
        return self.mode is StepMode.REPLAY

    def begin(self) -> None:
        self.trace = self.library[0] if self.library else None
        self.mode = StepMode.REPLAY if self.trace is not None else StepMode.RECORD
        self.pos = 0
        self.observed = []
        self.divergence_pos = None
        self.switches = 0

    def observe(self, key: Hashable, nbytes: int) -> Observation:
        if self.mode is StepMode.IDLE:
            return Observation(Seen.UNTRACED, None)
        self.observed.append((key, nbytes))
        if self.mode is not StepMode.REPLAY:
            return Observation(Seen.RECORDED, None)
        assert self.trace is not None
        p = self.pos
        if p < len(self.trace) and self.trace.keys[p] == key:
            self.pos += 1
            return Observation(Seen.MATCH, p)
        seen = [k for k, _ in self.observed]
        for alt in self.library:
            if alt is not self.trace and alt.starts_with(seen):
                self.trace = alt
                self.pos = p + 1
                self.switches += 1
                return Observation(Seen.SWITCH, p)
        self.mode = StepMode.DIVERGED
        self.divergence_pos = p
        return Observation(Seen.MISMATCH, None)

    def end(self, *, completed: bool) -> StepKind:
        """Closes the step; a completed diverged or recording step becomes the newest trace."""
        mode, self.mode = self.mode, StepMode.IDLE
        if not completed:
            kind = StepKind.ABORTED
        elif mode is StepMode.REPLAY:
            assert self.trace is not None
            kind = StepKind.REPLAYED if self.pos == len(self.trace) else StepKind.SHORT
            if kind is StepKind.REPLAYED and self.switches:
                self._push(self.trace)
        elif mode in (StepMode.RECORD, StepMode.DIVERGED):
            kind = StepKind.RECORDED if mode is StepMode.RECORD else StepKind.DIVERGED
            if self.observed:
                self._push(Trace(self.observed))
        else:
            raise AssertionError(f"end() of a step in mode {mode}")
        self.trace = None
        self.observed = []
        return kind

    def _push(self, trace: Trace) -> None:
        self.library = [trace] + [t for t in self.library if t != trace]
        del self.library[self.max_traces :]
