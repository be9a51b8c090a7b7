"""The model leaves the trace: first mismatch on demand, speculative holds dropped, re-recorded; short steps."""

import pytest
import torch

from tests.schedule.conftest import ENGINES, UNIT, Consumer, chain


def holds_when_acquiring(env, con, program, at):
    """Runs ``program`` (keys) in one step; returns the store's holds right after use ``at`` is acquired."""
    seen = None
    con.sched.begin_step()
    for i, k in enumerate(program):
        con.acquire(k)
        if i == at:
            seen = env.holds()
        con.release(k)
    con.sched.end_step()
    return seen


@pytest.mark.parametrize("engine", ENGINES)
def test_divergence_mid_forward(make_env, engine):
    env = make_env(10, engine=engine)
    sched = env.scheduler(bucket=3 * UNIT, live=6 * UNIT)
    con = Consumer(env, sched)
    a = chain(env.keys[:8])
    con.step(a)
    con.step(a)
    # A different branch from the 4th use on: u8 instead of u3. From a cold store, u3, u4 and
    # u5 are being read ahead (the bucket's 3 units) when the model takes it.
    b = chain(["u0", "u1", "u2", "u8", "u9", "u5", "u6", "u7"])
    env.cold()
    held = holds_when_acquiring(env, con, b, 3)
    assert held == {"u8": 1}, "speculative fetches were not given back at the mismatch"
    s = sched.stats().last
    assert s.kind == "diverged" and s.divergence_pos == 3
    assert s.dropped_prefetches == 3 and s.on_demand == len(b) - 3 and s.duplicate_reads == 0
    assert list(sched.trace.keys) == b  # re-recorded
    con.step(b)
    s = sched.stats().last
    assert s.kind == "replayed" and s.on_demand == 0
    assert env.checker.violations == [] and env.holds() == {}


@pytest.mark.parametrize("engine", ENGINES)
def test_divergence_mid_backward(make_env, engine):
    env = make_env(8, engine=engine)
    sched = env.scheduler(bucket=2 * UNIT, live=8 * UNIT, reuse=2 * UNIT)
    con = Consumer(env, sched)
    a = chain(env.keys)
    con.step(a)
    con.step(a)
    # The backward visits u4 before u5 (both prefetched or kept on the old trace's word).
    b = env.keys + ["u7", "u6", "u4", "u5", "u3", "u2", "u1", "u0"]
    held = holds_when_acquiring(env, con, b, 10)
    assert held == {"u4": 1}  # the mismatching unit itself is used; the rest is dropped
    s = sched.stats().last
    assert s.kind == "diverged" and s.divergence_pos == 10
    assert s.on_demand == 5  # u5 … u0 after the mismatch
    assert list(sched.trace.keys) == b
    con.step(b)
    assert sched.stats().last.on_demand == 0
    assert env.checker.violations == [] and env.holds() == {}


def test_eval_step_is_short_and_keeps_the_training_trace(make_env):
    env = make_env(8)
    sched = env.scheduler(bucket=2 * UNIT, live=6 * UNIT)
    con = Consumer(env, sched)
    train = chain(env.keys)
    con.step(train)
    trace = sched.trace
    with torch.no_grad():
        con.step(env.keys)  # forward only
    s = sched.stats().last
    assert s.kind == "short" and s.on_demand == 0 and s.dropped_prefetches >= 1
    assert sched.trace is trace
    assert env.holds() == {}
    con.step(train)
    assert sched.stats().last.kind == "replayed" and sched.stats().last.on_demand == 0
    assert env.checker.violations == []


def test_uses_past_the_end_of_the_trace_rerecord(make_env):
    env = make_env(6)
    sched = env.scheduler(bucket=2 * UNIT, live=6 * UNIT)
    con = Consumer(env, sched)
    con.step(env.keys)  # the first step ever is an eval forward
    con.step(chain(env.keys))
    s = sched.stats().last
    assert s.kind == "diverged" and s.divergence_pos == 6 and s.on_demand == 6
    con.step(chain(env.keys))
    assert sched.stats().last.on_demand == 0
    con.step(env.keys)  # eval again: a prefix of the newest trace
    assert sched.stats().last.kind == "short"


def test_alternating_branches_switch_traces_instead_of_rerecording(make_env):
    env = make_env(6)
    sched = env.scheduler(bucket=2 * UNIT, live=6 * UNIT)
    con = Consumer(env, sched)
    even = chain(["u0", "u1", "u2", "u4", "u5"])
    odd = chain(["u0", "u1", "u3", "u4", "u5"])
    con.step(even)
    con.step(odd)
    assert [s.kind for s in sched.stats().history] == ["recorded", "diverged"]
    for path in (even, odd, even):
        con.step(path)
        s = sched.stats().last
        assert (s.kind, s.trace_switches) == ("replayed", 1)
        assert s.on_demand == 1  # only the unit where the paths part
        assert s.duplicate_reads == 0
    assert sched.stats().traces == 2
    assert env.checker.violations == [] and env.holds() == {}


@pytest.mark.parametrize("reuse", [0, 10**9])
def test_a_unit_used_twice_in_one_step(make_env, reuse):
    # u1 is used twice in the forward (a module called twice), and held twice at once in the
    # backward (nested acquires); a 3-unit pool evicts it in between when it is not kept.
    env = make_env(5, pool_count=3)
    sched = env.scheduler(bucket=UNIT, live=3 * UNIT, reuse=reuse)
    con = Consumer(env, sched)
    program = [
        "u0",
        "u1",
        "u2",
        "u3",
        "u1",
        "u4",
        ("acq", "u1"),
        ("acq", "u1"),
        "u3",
        ("rel", "u1"),
        ("rel", "u1"),
        "u0",
    ]
    for _ in range(3):
        env.checker.clear()
        con.step(program)
    s = sched.stats().last
    assert s.kind == "replayed" and s.on_demand == 0 and s.duplicate_reads == 0
    # Kept: one store fetch for its three acquires (the nested one shares the hold).
    # Not kept: one per acquire of a released unit.
    assert len(env.checker.fetches("u1")) == (1 if reuse else 3)
    assert env.checker.violations == [] and env.holds() == {}


def test_changed_units_are_never_served_stale(make_env):
    # Every step changes two units in place (as an optimizer would between steps): a unit read
    # ahead, cached or kept must still be the newest data, through pool turnover.
    env = make_env(8, pool_count=4)
    sched = env.scheduler(bucket=2 * UNIT, live=4 * UNIT, reuse=4 * UNIT)
    con = Consumer(env, sched)
    for step in range(5):
        sched.begin_step()
        for k in chain(env.keys):
            t = con.acquire(k)
            if k in (f"u{step}", f"u{step + 2}") and con.held[k] == 1:
                t.add_(1.0)
                sched.mark_dirty(k)
                env.data[k] = env.data[k] + 1.0
            con.release(k)
        sched.end_step()
    env.cold()  # writes the dirty units home
    for k in env.keys:
        got = env.store.fetch(k).result(30)
        assert torch.equal(got, env.data[k])
        env.store.release(k)
