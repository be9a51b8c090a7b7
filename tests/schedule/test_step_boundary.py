"""Reading ahead across the step boundary ([Note: across the step boundary] in scheduler.py).

Against the real store, with the budgets checked at every event by the
conftest's Checker: between two micro-steps the next forward's first units
stay held and are read ahead, so the next step reads none of them on demand;
after an optimizer step the read-ahead waits for each unit's ``ready`` gate;
a checkpoint-style abort between steps gives everything back.
"""

from tests.schedule.conftest import UNIT, Consumer, chain


def _warm(env, sched, program):
    """Step 0 records the trace; step 1 replays it with an ordinary end."""
    con = Consumer(env, sched)
    con.step(program)
    con.step(program)
    return con


def test_a_micro_step_keeps_and_reads_ahead_what_the_next_one_starts_with(make_env):
    env = make_env(12, pool_count=16)
    sched = env.scheduler(bucket=3 * UNIT, live=6 * UNIT)
    program = chain(env.keys)
    con = _warm(env, sched, program)

    sched.begin_step()
    con.run(program)
    sched.end_step(keep_for_next=True)
    held = set(env.holds())
    assert "u0" in held and held <= set(env.keys[:6])  # the next trace's start, within max_live
    env.cold()  # whatever the scheduler does not hold is gone from memory
    env.checker.clear()
    con.step(program)
    s = sched.stats().last
    assert s.kind == "replayed" and s.on_demand == 0
    assert not set(env.checker.reads()) & held, "a unit kept across the boundary was read again"
    assert env.checker.violations == [] and env.checker.events > 0
    assert env.holds() == {}


def test_an_ordinary_end_gives_everything_back(make_env):
    """end_step() without keep_for_next: nothing is held between steps, and a cold cache reads u0 again."""
    env = make_env(12, pool_count=16)
    sched = env.scheduler(bucket=3 * UNIT, live=6 * UNIT)
    program = chain(env.keys)
    con = _warm(env, sched, program)
    assert env.holds() == {}
    env.cold()
    env.checker.clear()
    con.step(program)
    assert env.checker.reads()[0] == "u0"


def test_after_an_optimizer_step_each_unit_is_read_ahead_once_it_is_ready(make_env):
    env = make_env(12, pool_count=16)
    done: set[str] = set()
    sched = env.scheduler(bucket=3 * UNIT, live=6 * UNIT, ready=lambda k: k in done)
    program = chain(env.keys)
    con = _warm(env, sched, program)
    env.cold()
    sched.prefetch_next_step()
    assert env.holds() == {}  # nothing is ready: nothing is read ahead of its update
    done.update({"u0", "u1"})
    sched.poke()
    assert set(env.holds()) == {"u0", "u1"}  # the walk stops at u2, the first unit not ready
    done.update(env.keys)
    sched.poke()
    assert set(env.holds()) == set(env.keys[:3])  # reads ahead within the bucket
    env.checker.clear()
    con.step(program)
    s = sched.stats().last
    assert s.on_demand == 0 and s.prefetch_hits + s.late_prefetches >= 3
    assert not set(env.checker.reads()) & set(env.keys[:3])
    assert env.checker.violations == []


def test_abort_between_steps_gives_the_read_ahead_back(make_env):
    env = make_env(12, pool_count=16)
    sched = env.scheduler(bucket=3 * UNIT, live=6 * UNIT)
    program = chain(env.keys)
    _warm(env, sched, program)
    sched.prefetch_next_step()
    assert env.holds()
    assert sched.abort_step() is None
    assert env.holds() == {} and sched.stats().live_nbytes == 0
    sched.poke()  # and it does not start again on its own
    assert env.holds() == {}


def test_a_next_step_that_leaves_the_trace_gives_the_read_ahead_back(make_env):
    env = make_env(12, pool_count=16)
    sched = env.scheduler(bucket=3 * UNIT, live=6 * UNIT)
    program = chain(env.keys)
    con = _warm(env, sched, program)
    sched.prefetch_next_step()
    assert "u0" in env.holds()
    other = chain(list(reversed(env.keys)))
    con.step(other)
    assert sched.stats().last.kind == "diverged"
    assert env.holds() == {} and sched.stats().live_nbytes == 0
    assert env.checker.violations == []
