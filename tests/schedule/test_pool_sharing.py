"""Others on the same pool: what the scheduler holds on its own judgement is given up when they wait.

The engine runs the optimizer step behind the next forward, fetching the same
store's keys from another thread, and the forward waits at a gate until each
unit is updated. Neither may wait forever for pool memory the scheduler sits
on: the scheduler is a reclaimer of the pool.
"""

import threading

import pytest
import torch

from tests.schedule.conftest import ENGINES, UNIT, Consumer, chain


@pytest.mark.parametrize("engine", ENGINES)
def test_a_waiting_fetch_takes_the_room_the_scheduler_holds(make_env, engine):
    # Pool of 6 units; the scheduler holds 1 in use + 4 prefetched. Another thread needs 3
    # units at rest while the model's thread is idle (makes no scheduler calls).
    env = make_env(10, engine=engine, pool_count=6, pool_timeout=10)
    sched = env.scheduler(bucket=4 * UNIT, live=6 * UNIT, reuse=10**9)
    con = Consumer(env, sched)
    con.step(chain(env.keys[:7]))
    env.cold()
    sched.begin_step()
    con.acquire("u0")
    assert len(env.holds()) == 5
    got = {}

    def outsider():
        for k in ("u7", "u8", "u9"):
            got[k] = env.fetch_outside(k)

    t = threading.Thread(target=outsider)
    t.start()
    t.join(20)
    assert not t.is_alive(), "the other pool user waited for room the scheduler held"
    assert all(torch.equal(got[k], env.data[k]) for k in got)
    for k in got:
        env.release_outside(k)
    con.release("u0")
    con.run(chain(env.keys[:7])[1:])
    sched.end_step()
    s = sched.stats().last
    # The reclaimed units had been read ahead and were read again when used: wasted reads,
    # the price of yielding, at most one per unit given up.
    assert s.reclaimed >= 2 and s.duplicate_reads <= s.reclaimed
    assert env.checker.violations == [] and env.holds() == {}


@pytest.mark.parametrize("gate_prefetch", [True, False])
def test_forward_overlapped_with_an_optimizer_step_on_the_same_pool(make_env, gate_prefetch):
    # The engine's overlapped step: a thread updates every unit in forward order (read,
    # change in place, mark dirty, release, evict), the forward waits for each unit's
    # update before acquiring it. Reuse keeps units for the backward, so without the
    # reclaimer the kept units fill the 4-unit pool and the optimizer waits forever
    # while the forward waits for the optimizer.
    env = make_env(8, pool_count=4, pool_timeout=10)
    done: set[str] = set()
    cv = threading.Condition()
    ready = (lambda k: k in done) if gate_prefetch else None
    sched = env.scheduler(bucket=2 * UNIT, live=4 * UNIT, reuse=10**9, ready=ready)
    con = Consumer(env, sched)
    con.step(chain(env.keys))
    for _ in range(3):
        with cv:
            done.clear()

        def optimizer():
            for k in env.keys:
                t = env.fetch_outside(k)
                t.add_(1.0)
                env.store.mark_dirty(k)
                env.data[k] = env.data[k] + 1.0
                env.release_outside(k)
                if env.store.spec(k).holds == 0:
                    env.store.evict(k)
                with cv:
                    done.add(k)
                    cv.notify_all()
                sched.poke()

        opt = threading.Thread(target=optimizer)
        sched.begin_step()
        opt.start()
        for k in env.keys:  # forward, gated per unit
            with cv:
                assert cv.wait_for(lambda k=k: k in done, 20), f"the optimizer never updated {k}"
            con.use(k)  # checks the data is the updated data
        opt.join(20)
        assert not opt.is_alive(), "the optimizer step is stuck waiting for pool memory"
        con.run(env.keys[::-1])  # backward
        sched.end_step()
    st = sched.stats()
    # A prefetched unit given up to the optimizer is read again when used: at most one
    # wasted read per unit given up.
    assert all(s.duplicate_reads <= s.reclaimed for s in st.history)
    if gate_prefetch:
        assert st.total.not_ready > 0
    assert env.checker.violations == [] and env.holds() == {}
