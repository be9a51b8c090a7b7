"""The trace file's schema, its lanes, and the recorder's switching."""

from __future__ import annotations

import json
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infinity.timeline import Span, Timeline, check_trace, read_trace, trace_events, write_trace


def _span(start, end, track="t", cat="read", name="read 'k'"):
    return Span(name, cat, start, end, track, {"bytes": 1})


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 1000), st.integers(1, 200)).map(lambda t: (t[0], t[0] + t[1])),
        max_size=40,
    )
)
def test_overlapping_requests_get_lanes_in_which_none_overlap(intervals):
    spans = [_span(a / 1e3, b / 1e3) for a, b in intervals]
    events = trace_events(spans, 0.0)
    xs = [e for e in events if e["ph"] == "X"]
    assert len(xs) == len(spans)  # each span once
    by_tid: dict[int, list] = {}
    for e in xs:
        by_tid.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    for lane in by_tid.values():
        lane.sort()
        for (_, end), (start, _) in zip(lane, lane[1:], strict=False):
            assert end <= start + 1e-6
    # A greedy assignment in start order uses as many lanes as the most requests in flight at once.
    most = max((sum(a <= t < b for a, b in intervals) for t, _ in intervals), default=0)
    assert len(by_tid) == max(most, 1 if intervals else 0)


def test_nested_spans_of_a_thread_stay_on_its_track():
    spans = [
        _span(0.0, 1.0, "main", "phase", "forward"),
        _span(0.1, 0.5, "main", "compute", "forward Block p1"),
        _span(0.2, 0.3, "main", "wait", "unit 'p2'"),
    ]
    events = trace_events(spans, 0.0)
    names = [e["args"]["name"] for e in events if e["name"] == "thread_name"]
    assert names == ["main"]
    x = [e for e in events if e["ph"] == "X"]
    assert [(e["ts"], e["dur"]) for e in x] == [(0.0, 1e6), (1e5, 4e5), (2e5, 1e5)]


def test_the_file_round_trips_and_the_checker_names_what_is_wrong(tmp_path):
    path = write_trace(tmp_path / "t.json", [_span(0.0, 0.001)], 0.0, {"steps": []})
    doc = read_trace(path)
    assert doc["displayTimeUnit"] == "ms" and doc["infinity"] == {"steps": []}
    bad = json.loads(path.read_text())
    bad["traceEvents"][-1]["dur"] = -1
    with pytest.raises(ValueError, match="dur=-1"):
        check_trace(bad)
    bad["traceEvents"][-1]["dur"] = 1
    bad["traceEvents"][-1]["cat"] = "nonsense"
    with pytest.raises(ValueError, match="category 'nonsense'"):
        check_trace(bad)
    with pytest.raises(ValueError, match="traceEvents"):
        check_trace({"events": []})
    (tmp_path / "x.json").write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        read_trace(tmp_path / "x.json")


def test_a_recording_is_active_only_between_start_and_stop():
    assert Timeline.active is None
    tl = Timeline().start()
    try:
        with pytest.raises(RuntimeError, match="another timeline recording"):
            Timeline().start()
        tok = tl.begin("forward", "phase")
        tl.end(tok, {"step": 3})
    finally:
        tl.stop()
    assert Timeline.active is None
    spans = tl.spans()
    assert [(s.name, s.args) for s in spans] == [("forward", {"step": 3})]


class _NoLock:
    """Stands in for the timeline's registration lock: taking it fails the test."""

    def __enter__(self):
        raise AssertionError("a span emitted by a registered thread took the registration lock")

    def __exit__(self, *exc):
        return False


def test_threads_record_without_a_lock_each_on_its_own_track():
    """[Note: recording costs no lock]: after its first span, a thread's spans take no lock; the
    spans of threads emitting at once are all kept, each thread's on its track, deferred ones
    formatted only when read."""
    tl = Timeline().start()
    formatted = []

    def fmt(i):
        formatted.append(i)
        return f"deferred {i}", "read", float(i), i + 0.5, None, {"i": i}

    go = threading.Barrier(4)
    registered = threading.Barrier(5)

    def emit(t):
        tl.span("first", "compute", 0.0, 0.1)  # registers this thread's list
        registered.wait()
        go.wait()
        for i in range(200):
            tl.span(f"s{i}", "compute", float(i), i + 0.5, args={"i": i})
            tl.deferred(fmt, (i,))

    threads = [threading.Thread(target=emit, args=(t,), name=f"emitter-{t}") for t in range(4)]
    try:
        for th in threads:
            th.start()
        registered.wait()
        tl._register = _NoLock()  # from here on, any lock taken on the emit path fails the test
        for th in threads:
            th.join()
    finally:
        tl.stop()
    assert formatted == []  # nothing formatted while recording
    tl._register = threading.Lock()
    spans = tl.spans()
    assert len(spans) == 4 * (1 + 2 * 200)
    for t in range(4):
        mine = [s for s in spans if s.track == f"emitter-{t}"]
        assert sorted(s.name for s in mine if s.name.startswith("s")) == sorted(
            f"s{i}" for i in range(200)
        )
        assert sorted(s.args["i"] for s in mine if s.name.startswith("deferred")) == list(
            range(200)
        )
    assert sorted(formatted) == sorted(list(range(200)) * 4)
