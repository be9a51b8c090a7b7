"""Aborted steps, failed reads and misuse: nothing is left held, and errors name the key."""

import errno
import logging

import pytest
import torch

from infinity.schedule import ScheduleError
from infinity.store import StoreIOError, StoreStateError
from tests.schedule.conftest import ENGINES, UNIT, Consumer, chain


@pytest.mark.parametrize("engine", ENGINES)
def test_exception_mid_forward_leaves_no_buffer_held(make_env, engine):
    env = make_env(10, engine=engine)
    sched = env.scheduler(bucket=4 * UNIT, live=8 * UNIT, reuse=10**9)
    con = Consumer(env, sched)
    con.step(chain(env.keys))
    sched.begin_step()
    with pytest.raises(RuntimeError, match="boom"):
        try:
            for k in env.keys:
                con.acquire(k)
                if k == "u4":
                    raise RuntimeError("boom")
                con.release(k)
        finally:  # the partitioner's post-forward hooks run (always_call), then the engine aborts
            con.release_all()
            sched.abort_step()
    s = sched.stats().last
    assert s.kind == "aborted" and s.dropped_prefetches > 0
    assert env.holds() == {} and sched.stats().live_nbytes == 0
    env.cold()  # every key evictable: none is held, reads in flight have ended
    assert env.store.pool.stats().in_use == 0
    con.step(chain(env.keys))  # the trace survived the aborted step
    assert sched.stats().last.kind == "replayed" and sched.stats().last.on_demand == 0
    assert env.checker.violations == []


def test_begin_step_with_a_step_open_aborts_it(make_env):
    env = make_env(6)
    sched = env.scheduler(bucket=3 * UNIT, live=6 * UNIT)
    con = Consumer(env, sched)
    con.step(chain(env.keys))
    sched.begin_step()
    con.run(["u0", "u1"])  # no end_step: e.g. an eval forward the engine did not close
    con.step(chain(env.keys))
    kinds = [s.kind for s in sched.stats().history]
    assert kinds == ["recorded", "aborted", "replayed"]
    assert env.holds() == {}
    assert sched.abort_step() is None  # nothing open: a no-op


@pytest.mark.parametrize("engine", ENGINES)
def test_a_failed_prefetch_read_is_raised_at_its_acquire_naming_the_key(make_env, engine):
    env = make_env(6, engine=engine, recording=True)
    sched = env.scheduler(bucket=2 * UNIT, live=4 * UNIT)
    con = Consumer(env, sched)
    con.step(chain(env.keys))
    env.cold()
    env.aio.fail_next("read", errno=errno.EIO)
    sched.begin_step()  # prefetches u0 and u1: the read of u0 fails
    with pytest.raises(StoreIOError, match="'u0'") as e:
        con.acquire("u0")
    assert any("scheduler 'prefetch'" in n for n in getattr(e.value, "__notes__", []))
    sched.abort_step()
    assert env.holds() == {} and sched.stats().live_nbytes == 0
    con.step(chain(env.keys))  # the next read of u0 works
    assert sched.stats().last.kind == "replayed"
    assert env.holds() == {}


def test_a_key_never_written_is_refused_and_not_held(make_env):
    env = make_env(3)
    env.store.register("blank", (UNIT // 4,), torch.float32)
    sched = env.scheduler(bucket=UNIT, live=4 * UNIT)
    con = Consumer(env, sched)
    sched.begin_step()
    with pytest.raises(StoreStateError, match="'blank'.*never written"):
        sched.acquire("blank")
    sched.end_step()
    assert env.store.spec("blank").holds == 0 and sched.stats().live_nbytes == 0
    con.step(["u0"])


def test_misuse_is_refused_with_what_to_do(make_env):
    env = make_env(3)
    sched = env.scheduler(bucket=UNIT, live=4 * UNIT)
    with pytest.raises(ScheduleError, match="release of key 'u0'.*must follow an acquire"):
        sched.release("u0")
    with pytest.raises(ScheduleError, match="mark_dirty of key 'u1'"):
        sched.mark_dirty("u1")
    with pytest.raises(ScheduleError, match="end_step.*without begin_step"):
        sched.end_step()
    with pytest.raises(KeyError, match="'nope' is not registered"):
        sched.acquire("nope")
    sched.close()
    with pytest.raises(ScheduleError, match="closed"):
        sched.acquire("u0")


def test_close_gives_back_holds_still_acquired(make_env, caplog):
    env = make_env(3)
    sched = env.scheduler(bucket=UNIT, live=4 * UNIT)
    sched.begin_step()
    sched.acquire("u0")
    with caplog.at_level(logging.WARNING, logger="infinity.schedule"):
        sched.close()
    assert "still acquired" in caplog.text
    assert env.holds() == {}
    sched.close()  # idempotent
