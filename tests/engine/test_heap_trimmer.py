"""HeapTrimmer: train_batch's backward trims the heaps only where they would raise the peak
([Note: layer-major accumulation] in infinity/engine/layer_major.py, heaps). The resident set is
scripted: what is checked is when the trims happen, not what glibc does (the peak RSS that the
trims hold is tests/estimate/test_layer_major.py's)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from infinity.engine import layer_major
from infinity.engine.layer_major import HeapTrimmer

MIB = 1 << 20


class _Hooks:
    """What HeapTrimmer.during_backward uses of GradHooks: the on_unit_done callback."""

    def __init__(self, on_unit_done=None):
        self.on_unit_done = on_unit_done


def _scripted(monkeypatch, rss: list[int]) -> list[int]:
    """``rss`` read one value per call; returns the list that each trim appends its call index to."""
    reads = iter(rss)
    trims: list[int] = []
    calls = [0]

    def read() -> int:
        calls[0] += 1
        return next(reads)

    monkeypatch.setattr(layer_major, "rss_nbytes", read)
    monkeypatch.setattr(layer_major, "trim_heap", lambda: trims.append(calls[0]) or True)
    return trims


def _backward(trimmer: HeapTrimmer, hooks: _Hooks, units: int) -> None:
    with trimmer.during_backward(hooks):
        for u in range(units):
            hooks.on_unit_done(u)


def test_trims_only_near_the_highest_resident_set_seen(monkeypatch):
    # read 1: the backward's start; reads 2..: one per unit's end
    rss = [500 * MIB, 520 * MIB, 300 * MIB, 480 * MIB, 510 * MIB, 600 * MIB, 200 * MIB]
    trims = _scripted(monkeypatch, rss)
    done: list[int] = []
    hooks = _Hooks(done.append)
    trimmer = HeapTrimmer(margin_nbytes=32 * MIB)
    _backward(trimmer, hooks, units=len(rss) - 1)
    # 520 (a new high), 510 (within 32 MiB of 520), 600 (a new high); not 300, 480 or 200
    assert trims == [2, 5, 6]
    assert trimmer.trims == 3
    assert trimmer.peak_nbytes == 600 * MIB
    assert done == list(range(len(rss) - 1))  # the partitioner's release still runs, first
    assert hooks.on_unit_done == done.append  # given back after the backward


def test_later_backwards_do_not_raise_the_peak_with_what_they_keep(monkeypatch):
    # first backward: starts at 900, a unit ends at 950 (the peak, trimmed)
    # second: starts at 700; units end at 1000 (over the peak: trimmed, the peak stays 950), 930
    # (within 32 MiB of it: trimmed), 800 (kept); third: starts at 990, which is the peak now
    rss = [900, 950, 700, 1000, 930, 800, 990, 960]
    trims = _scripted(monkeypatch, [r * MIB for r in rss])
    trimmer = HeapTrimmer(margin_nbytes=32 * MIB)
    _backward(trimmer, _Hooks(), units=1)
    _backward(trimmer, _Hooks(), units=3)
    assert trimmer.peak_nbytes == 950 * MIB
    _backward(trimmer, _Hooks(), units=1)
    assert trimmer.peak_nbytes == 990 * MIB
    assert trims == [2, 4, 5, 8]


def test_the_callback_is_given_back_when_the_backward_raises(monkeypatch):
    _scripted(monkeypatch, [100 * MIB] * 3)
    hooks = _Hooks(None)
    with pytest.raises(RuntimeError, match="boom"):
        with HeapTrimmer().during_backward(hooks):
            hooks.on_unit_done(0)
            raise RuntimeError("boom")
    assert hooks.on_unit_done is None


def test_without_grad_hooks_nothing_is_read(monkeypatch):
    trims = _scripted(monkeypatch, [])
    with HeapTrimmer().during_backward(None):
        pass
    assert trims == []


@given(
    backwards=st.lists(
        st.lists(st.integers(0, 4096), min_size=1, max_size=12), min_size=1, max_size=4
    ),
    margin=st.integers(0, 256),
)
def test_no_unit_ends_near_or_above_the_peak_untrimmed(backwards, margin):
    """Whatever the resident set does, a unit's end trims exactly when it is within the margin of
    the peak (or above it): the highest of the backwards' starts and the first backward's unit
    ends so far. Each backward's first value is its start, the rest its units' ends."""
    reads = iter([r * MIB for b in backwards for r in b])
    trimmed: list[bool] = []
    trimmer = HeapTrimmer(margin_nbytes=margin * MIB)
    peak = 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(layer_major, "rss_nbytes", lambda: next(reads))
        mp.setattr(layer_major, "trim_heap", lambda: trimmed.append(True) or True)
        for i, b in enumerate(backwards):
            hooks = _Hooks()
            peak = max(peak, b[0])
            with trimmer.during_backward(hooks):
                for u, rss in enumerate(b[1:]):
                    if i == 0:
                        peak = max(peak, rss)
                    n = len(trimmed)
                    hooks.on_unit_done(u)
                    assert (len(trimmed) > n) == (rss + margin >= peak), (i, u, backwards, margin)
            assert trimmer.peak_nbytes == peak * MIB
