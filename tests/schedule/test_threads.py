"""Several threads on one scheduler: forward and backward on different threads (CUDA), and at once."""

import random
import threading

import pytest

from tests.schedule.conftest import ENGINES, UNIT, Consumer


def run_threads(*targets, timeout=60):
    errors = []

    def guard(fn):
        try:
            fn()
        except BaseException as e:  # re-raised below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=guard, args=(fn,)) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a thread is stuck: deadlock"
    if errors:
        raise errors[0]


@pytest.mark.parametrize("engine", ENGINES)
def test_forward_and_backward_on_different_threads(make_env, engine):
    env = make_env(10, engine=engine, pool_count=8, pool_timeout=30)
    sched = env.scheduler(bucket=3 * UNIT, live=6 * UNIT, reuse=2 * UNIT)
    fwd, bwd = Consumer(env, sched), Consumer(env, sched)
    forward_done = [threading.Event() for _ in range(5)]
    backward_done = [threading.Event() for _ in range(5)]

    def forward_thread():
        for step in range(5):
            if step:
                assert backward_done[step - 1].wait(30)
            sched.begin_step()
            fwd.acquire("u0")  # a root unit: held over the forward, released by the backward thread
            fwd.run(env.keys[1:])
            forward_done[step].set()

    def backward_thread():
        for step in range(5):
            assert forward_done[step].wait(30)
            bwd.run(env.keys[1:][::-1])
            fwd.release("u0")  # a hold taken on the other thread
            bwd.use("u0")
            sched.end_step()
            backward_done[step].set()

    run_threads(forward_thread, backward_thread)
    st = sched.stats()
    assert [s.kind for s in st.history] == ["recorded"] + ["replayed"] * 4
    assert all(s.on_demand == 0 and s.duplicate_reads == 0 for s in st.history[1:])
    assert env.checker.violations == [] and env.holds() == {}


@pytest.mark.parametrize("engine", ENGINES)
def test_two_threads_acquiring_at_once(make_env, engine):
    # Interleaving differs every step, so traces keep diverging: the point is that nothing
    # deadlocks, no unit is ever another's data, the budgets hold and nothing is left held.
    env = make_env(12, engine=engine, pool_count=6, pool_timeout=30)
    sched = env.scheduler(bucket=2 * UNIT, live=5 * UNIT, reuse=3 * UNIT)
    barrier = threading.Barrier(2)

    def worker(seed, keys):
        rng = random.Random(seed)
        con = Consumer(env, sched)
        for _ in range(8):
            barrier.wait(30)
            if seed == 0:
                sched.begin_step()
            barrier.wait(30)
            for k in keys + keys[::-1]:
                con.acquire(k)
                if rng.random() < 0.3:
                    con.use(rng.choice(env.keys))  # nested, sometimes the other thread's unit
                con.release(k)
            barrier.wait(30)
            if seed == 0:
                sched.end_step()

    run_threads(lambda: worker(0, env.keys[:6]), lambda: worker(1, env.keys[6:]))
    assert sched.stats().steps == 8
    assert env.checker.violations == [] and env.holds() == {}
    env.cold()
    assert env.store.pool.stats().in_use == 0


def test_acquires_of_the_same_unit_from_two_threads_share_one_fetch(make_env):
    env = make_env(4)
    sched = env.scheduler(bucket=UNIT, live=4 * UNIT)
    barrier = threading.Barrier(4)
    got = {}

    def take(i):
        con = Consumer(env, sched)
        barrier.wait(30)
        got[i] = con.acquire("u2").data_ptr()
        barrier.wait(30)
        con.release("u2")

    run_threads(*[lambda i=i: take(i) for i in range(4)])
    assert len(set(got.values())) == 1
    assert len(env.checker.fetches("u2")) == 1
    assert env.holds() == {}
