"""Trace, TraceCursor and the lookahead's decisions, without a store."""

import math

import pytest

from infinity.schedule import StepKind, StepMode, Trace, TraceCursor
from infinity.schedule import lookahead as la


def t(*keys, n=10):
    return Trace([(k, n) for k in keys])


def test_trace_positions_and_distances():
    tr = Trace([("a", 10), ("b", 20), ("c", 30), ("b", 20), ("a", 10)])
    assert len(tr) == 5 and tr.total_nbytes == 90
    assert tr.uses("b") == [1, 3] and tr.uses("z") == []
    assert tr.next_use("b", 0) == 1 and tr.next_use("b", 2) == 3 and tr.next_use("b", 4) is None
    assert tr.bytes_between(1, 4) == 70
    # cursor at 2 (b and a used, c next): b comes back after c (30 bytes), a after c and b
    assert tr.reuse_distance("b", 2) == 30
    assert tr.reuse_distance("a", 2) == 50
    assert tr.reuse_distance("c", 3) is None
    # Belady order counts into the next step: c is needed again at the next step's position 2
    assert tr.until_next_use("c", 3) == 5 - 3 + 2
    assert tr.until_next_use("zz", 0) == math.inf
    assert tr.starts_with(["a", "b"]) and not tr.starts_with(["b"])


def test_cursor_records_then_replays():
    cur = TraceCursor()
    cur.begin()
    assert cur.mode is StepMode.RECORD
    for k in "abc":
        assert cur.observe(k, 10).seen.value == "recorded"
    assert cur.end(completed=True) is StepKind.RECORDED
    assert cur.library == [t("a", "b", "c")]
    cur.begin()
    assert cur.mode is StepMode.REPLAY
    assert [cur.observe(k, 10).pos for k in "abc"] == [0, 1, 2]
    assert cur.end(completed=True) is StepKind.REPLAYED


def test_cursor_mismatch_diverges_and_rerecords():
    cur = TraceCursor()
    cur.begin()
    for k in "abcd":
        cur.observe(k, 10)
    cur.end(completed=True)
    cur.begin()
    cur.observe("a", 10)
    obs = cur.observe("x", 10)
    assert (
        obs.seen.value == "mismatch" and cur.mode is StepMode.DIVERGED and cur.divergence_pos == 1
    )
    for k in "cd":  # the rest is recorded, not matched again
        assert cur.observe(k, 10).seen.value == "recorded"
    assert cur.end(completed=True) is StepKind.DIVERGED
    assert cur.library[0] == t("a", "x", "c", "d") and cur.library[1] == t("a", "b", "c", "d")


def test_cursor_short_step_keeps_the_trace_and_abort_records_nothing():
    cur = TraceCursor()
    cur.begin()
    for k in "abcba":
        cur.observe(k, 10)
    cur.end(completed=True)
    full = cur.library[0]
    cur.begin()
    for k in "abc":  # an eval forward: a prefix of the training step
        cur.observe(k, 10)
    assert cur.end(completed=True) is StepKind.SHORT
    assert cur.library == [full]
    cur.begin()
    cur.observe("a", 10)
    cur.observe("q", 10)
    assert cur.end(completed=False) is StepKind.ABORTED
    assert cur.library == [full]


def test_cursor_use_past_the_end_diverges():
    cur = TraceCursor()
    cur.begin()
    cur.observe("a", 10)
    cur.end(completed=True)  # e.g. step 0 was an eval forward
    cur.begin()
    cur.observe("a", 10)
    assert cur.observe("b", 10).seen.value == "mismatch"
    cur.end(completed=True)
    assert cur.library[0] == t("a", "b")


def test_cursor_switches_between_known_traces():
    cur = TraceCursor(max_traces=2)
    for path in ("aXc", "aYc"):
        cur.begin()
        for k in path:
            cur.observe(k, 10)
        cur.end(completed=True)
    cur.begin()  # replays aYc (the newest)
    cur.observe("a", 10)
    obs = cur.observe("X", 10)
    assert obs.seen.value == "switch" and obs.pos == 1 and cur.trace == t("a", "X", "c")
    assert cur.observe("c", 10).pos == 2
    assert cur.end(completed=True) is StepKind.REPLAYED
    assert cur.library[0] == t("a", "X", "c")  # switched-to trace is now the newest
    cur.begin()
    cur.observe("Z", 10)
    cur.end(completed=True)
    assert len(cur.library) == 2 and t("a", "Y", "c") not in cur.library  # bounded, oldest dropped


def test_lookahead_decisions():
    class R:
        def __init__(self, key, nbytes=10):
            self.key, self.nbytes = key, nbytes

    tr = t("a", "b", "c", "d", "c", "b", "a")
    a, b, c, d = R("a"), R("b"), R("c"), R("d")
    # at cursor 4 (c next): a is needed at 6, b at 5, c at 4, d next step at 3
    assert [r.key for r in la.furthest_first([a, b, c, d], tr, 4)] == ["d", "a", "b", "c"]
    assert [r.key for r in la.needed_after([a, b, c, d], tr, 4, 5)] == ["d", "a"]
    assert [r.key for r in la.displace([a, b, c], tr, 4, 4, 15)] == ["a", "b"]
    assert la.displace([a, b, c], tr, 4, 5, 15) is None  # only a is needed after position 5
    assert la.displace([a], tr, 4, 4, 0) == []
    assert la.keep_for_reuse(tr, 4, "b", 10) and not la.keep_for_reuse(tr, 4, "b", 9)
    assert not la.keep_for_reuse(tr, 4, "d", 10**9) and not la.keep_for_reuse(None, 4, "b", 10**9)
    assert la.fits(10, moves=True, ahead=20, live=50, bucket=30, max_live=55) == (True, 5)
    assert la.fits(11, moves=True, ahead=20, live=0, bucket=30, max_live=55) == (False, 0)
    assert la.fits(11, moves=False, ahead=20, live=0, bucket=30, max_live=55) == (True, 0)


def test_cursor_rejects_no_traces():
    with pytest.raises(ValueError, match="max_traces"):
        TraceCursor(max_traces=0)
