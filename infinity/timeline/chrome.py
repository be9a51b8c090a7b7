"""Spans as a Chrome trace-event file (JSON object format), the file the Perfetto UI opens as is.

The file is ``{"traceEvents": [...], "displayTimeUnit": "ms", "infinity": {...}}``:
- each span is one complete event (``"ph": "X"``) with ``ts`` and ``dur`` in
  microseconds from the recording's start, ``pid`` 1, ``cat`` its category
  and ``args`` what it carries (key, bytes, tier, what a wait waited for);
- each track is a ``tid`` named by a metadata event (``"ph": "M"``,
  ``thread_name``), ordered by ``thread_sort_index``: a thread's own spans
  on its track, and spans that may overlap without nesting (reads and
  writes in flight together, a unit's backward overlapping the next) spread
  over as many lanes of their track as they need (``nvme read #0``,
  ``#1``...), since a viewer draws one track's spans as a nest;
- ``infinity`` holds what the run's owner adds (steps, counters, the plan):
  viewers ignore keys they do not know.

``check_trace`` states the schema the tests and ``infinity report`` hold a
file to.

Imports only the standard library.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from infinity.timeline.recorder import CATEGORIES, Span

LANED = ("read", "write", "copy")
"""Categories whose spans overlap without nesting on one track (requests in flight together)."""


def _lanes(spans: list[Span]) -> list[int]:
    """For spans sorted by start: the lowest lane each fits in (no overlap with that lane's last)."""
    ends: list[float] = []
    out = []
    for s in spans:
        for i, e in enumerate(ends):
            if e <= s.start:
                ends[i] = s.end
                out.append(i)
                break
        else:
            ends.append(s.end)
            out.append(len(ends) - 1)
    return out


def _nests(spans: list[Span]) -> bool:
    """Whether spans sorted by start nest properly (each starts after, or ends within, the open ones)."""
    open_ends: list[float] = []
    for s in spans:
        while open_ends and open_ends[-1] <= s.start:
            open_ends.pop()
        if open_ends and s.end > open_ends[-1]:
            return False
        open_ends.append(s.end)
    return True


def trace_events(spans: Iterable[Span], origin: float) -> list[dict[str, Any]]:
    """The events of ``spans`` (``time.monotonic()`` seconds), times relative to ``origin``."""
    by_track: dict[str, list[Span]] = {}
    for s in sorted(spans, key=lambda s: (s.start, -s.end)):
        by_track.setdefault(s.track, []).append(s)
    rows: list[tuple[str, list[Span]]] = []
    for track, ss in by_track.items():
        laned = [s for s in ss if s.cat in LANED]
        nested = [s for s in ss if s.cat not in LANED]
        if nested and _nests(nested):
            rows.append((track, nested))
        elif nested:
            laned = nested + laned
        if laned:
            laned.sort(key=lambda s: (s.start, s.end))
            lanes = _lanes(laned)
            pairs = list(zip(laned, lanes, strict=True))
            for lane in range(max(lanes) + 1):
                rows.append((f"{track} #{lane}", [s for s, n in pairs if n == lane]))
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "infinity"}}
    ]
    for tid, (name, ss) in enumerate(rows, start=1):
        events.append(
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": name}}
        )
        events.append(
            {
                "ph": "M",
                "name": "thread_sort_index",
                "pid": 1,
                "tid": tid,
                "args": {"sort_index": tid},
            }
        )
        for s in ss:
            events.append(
                {
                    "ph": "X",
                    "name": s.name,
                    "cat": s.cat,
                    "pid": 1,
                    "tid": tid,
                    "ts": round((s.start - origin) * 1e6, 3),
                    "dur": round(max(s.end - s.start, 0.0) * 1e6, 3),
                    "args": {**s.args, "track": s.track},
                }
            )
    return events


def write_trace(path: str | Path, spans: Iterable[Span], origin: float, extra: dict) -> Path:
    """Writes the trace file (``extra`` under its ``infinity`` key); returns its path."""
    path = Path(path)
    doc = {"traceEvents": trace_events(spans, origin), "displayTimeUnit": "ms", "infinity": extra}
    check_trace(doc)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, separators=(",", ":"), allow_nan=False))
    tmp.replace(path)
    return path


def _fail(msg: str) -> None:
    raise ValueError(f"not an infinity trace file: {msg}")


def check_trace(doc: Any) -> None:
    """Raises ValueError naming the first thing wrong with a trace document (see the module doc)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        _fail('it must be a JSON object with a "traceEvents" list')
    if not isinstance(doc.get("infinity"), dict):
        _fail('it has no "infinity" object (it was not written by infinity\'s trace)')
    named: set[int] = set()
    for i, e in enumerate(doc["traceEvents"]):
        if not isinstance(e, dict) or e.get("ph") not in ("X", "M"):
            _fail(f"event {i} is not a complete (X) or metadata (M) event: {e!r:.200}")
        if not isinstance(e.get("name"), str) or not isinstance(e.get("pid"), int):
            _fail(f"event {i} lacks a string name or an integer pid")
        if not isinstance(e.get("tid"), int):
            _fail(f"event {i} lacks an integer tid")
        if e["ph"] == "M":
            if e["name"] == "thread_name":
                named.add(e["tid"])
            continue
        for k in ("ts", "dur"):
            v = e.get(k)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or (k == "dur" and v < 0):
                _fail(f"event {i} ({e['name']!r}) has {k}={v!r}: microseconds, finite, dur >= 0")
        if e.get("cat") not in CATEGORIES:
            _fail(
                f"event {i} ({e['name']!r}) has category {e.get('cat')!r}, not one of {CATEGORIES}"
            )
        if e["tid"] not in named:
            _fail(f"event {i} ({e['name']!r}) is on tid {e['tid']}, which no thread_name names")
        if not isinstance(e.get("args"), dict):
            _fail(f"event {i} ({e['name']!r}) has no args object")


def read_trace(path: str | Path) -> dict[str, Any]:
    """A trace file, checked (ValueError naming what is wrong, FileNotFoundError if missing)."""
    try:
        doc = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON ({e}); is it an infinity trace file?") from None
    check_trace(doc)
    return doc
