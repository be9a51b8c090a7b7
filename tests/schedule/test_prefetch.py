"""Reading ahead on a warm trace, against the real store: order, budgets at every event, reuse, pool room."""

import itertools

import pytest

from tests.schedule.conftest import ENGINES, UNIT, Consumer, chain

KiB = 1 << 10


def assert_clean(env, sched):
    assert env.checker.events > 0, "the budget checks never ran"
    assert env.checker.violations == []
    assert env.holds() == {}, "a hold outlived its step"
    assert sched.stats().live_nbytes == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_step0_records_on_demand_then_reads_are_issued_ahead_in_trace_order(make_env, engine):
    env = make_env(12, engine=engine, recording=True)
    sched = env.scheduler(bucket=3 * UNIT, live=6 * UNIT)
    con = Consumer(env, sched)
    program = chain(env.keys)

    con.step(program)
    s0 = sched.stats().last
    assert (s0.kind, s0.on_demand, s0.prefetches, s0.reads) == ("recorded", 24, 0, 12)
    assert sched.trace is not None and list(sched.trace.keys) == program

    env.cold()
    env.checker.clear()
    env.aio.log.clear()
    con.step(program)
    s1 = sched.stats().last
    assert s1.kind == "replayed" and s1.on_demand == 0
    assert s1.prefetch_hits + s1.late_prefetches + s1.reuse_hits == 24
    # The pool (16 units) keeps what the forward released, so only the forward reads,
    # in the order of use, each before the consumer asked for it.
    assert env.checker.reads() == env.keys
    log = env.checker.log
    for k in env.keys:
        first_fetch = next(i for i, e in enumerate(log) if e[:2] == ("fetch", k))
        first_ask = next(i for i, e in enumerate(log) if e[:2] == ("acquire", k))
        assert first_fetch < first_ask, f"{k} was read on demand"
    # The same order at the I/O layer: units are registered in use order, so offsets rise.
    offsets = [r.segments[0][1] for r in env.aio.reads()]
    assert len(offsets) == 12 and offsets == sorted(offsets)
    assert s1.read_nbytes == 12 * UNIT and s1.duplicate_reads == 0
    assert s1.peak_ahead_nbytes <= 3 * UNIT and s1.peak_live_nbytes <= 6 * UNIT
    assert_clean(env, sched)


# Units of 8 KiB multiples; u0 is held through the whole forward (a root module's own
# parameters), u5 is used twice, u9 only in the backward (a loss head).
SIZES = [2, 1, 3, 1, 2, 1, 1, 4, 1, 2]
FORWARD = [("acq", "u0"), "u1", "u2", "u3", "u4", "u5", "u6", "u7", "u5", "u8", ("rel", "u0")]
BACKWARD = ["u9", "u8", "u5", "u7", "u6", "u5", "u4", "u3", "u2", "u1", "u0"]
U8 = 8 * KiB
WORKING_SET = (2 + 4) * U8  # u0 held while u7 (the largest) is in use


@pytest.mark.parametrize(
    "bucket,live,reuse",
    list(
        itertools.product([0, U8, 3 * U8, 64 * U8], [4 * U8, 8 * U8, 64 * U8], [0, 4 * U8, 64 * U8])
    ),
)
def test_budgets_hold_at_every_store_event(make_env, bucket, live, reuse):
    # pool 12 x 8 KiB: less than the 18 x 8 KiB of units, so the cache turns over.
    env = make_env(sizes=[n * U8 for n in SIZES], pool_count=12, pool_size=U8)
    sched = env.scheduler(bucket=bucket, live=live, reuse=reuse)
    con = Consumer(env, sched)
    for _ in range(4):
        con.step(FORWARD + BACKWARD)
    assert_clean(env, sched)
    st = sched.stats()
    assert [s.kind for s in st.history] == ["recorded", "replayed", "replayed", "replayed"]
    assert st.total.peak_ahead_nbytes <= bucket
    replayed = st.history[1:]
    assert all(s.duplicate_reads == 0 for s in replayed)
    if live >= WORKING_SET:
        assert st.total.peak_live_nbytes <= live and st.total.over_budget_demands == 0
    else:  # the consumer alone holds more than max_live: served anyway, nothing else held then
        assert st.total.over_budget_demands > 0
    if bucket >= 4 * U8 and live >= 64 * U8:
        assert all(s.on_demand == 0 for s in replayed)
    if bucket == 0:
        assert st.total.prefetches == 0 and all(
            s.on_demand + s.reuse_hits == s.uses for s in replayed
        )


@pytest.mark.parametrize("reuse,kept", [(0, ["u7"]), (4 * UNIT, ["u5", "u6", "u7"])])
def test_reuse_distance_keeps_exactly_the_units_used_again_within_it(make_env, reuse, kept):
    env = make_env(8)
    sched = env.scheduler(bucket=2 * UNIT, live=16 * UNIT, reuse=reuse)
    con = Consumer(env, sched)
    con.step(chain(env.keys))
    env.checker.clear()
    con.step(chain(env.keys))
    # u_i is released at cursor i + 1 and used again at 15 - i: (14 - 2i) units of trace between.
    fetched = {k: len(env.checker.fetches(k)) for k in env.keys}
    assert [k for k, n in fetched.items() if n == 1] == kept
    assert all(n == 2 for k, n in fetched.items() if k not in kept)
    assert sched.stats().last.kept == len(kept)
    assert_clean(env, sched)


def test_kept_units_yield_to_units_needed_sooner(make_env):
    # A reuse distance that would keep everything, but max_live for 4 units: the kept set
    # slides to the units released last (needed first by the backward), Belady's choice.
    env = make_env(10, pool_count=8)
    sched = env.scheduler(bucket=2 * UNIT, live=4 * UNIT, reuse=10**9)
    con = Consumer(env, sched)
    for _ in range(3):
        con.step(chain(env.keys))
    last = sched.stats().last
    assert last.displaced > 0 and last.on_demand == 0 and last.duplicate_reads == 0
    assert sched.stats().total.peak_live_nbytes <= 4 * UNIT
    assert_clean(env, sched)


def test_a_unit_larger_than_max_live_is_served_alone(make_env):
    env = make_env(sizes=[UNIT, UNIT, 6 * UNIT, UNIT, UNIT], pool_count=10)
    sched = env.scheduler(bucket=2 * UNIT, live=4 * UNIT, reuse=10**9)
    con = Consumer(env, sched)
    for _ in range(3):
        con.step(chain(env.keys))
    st = sched.stats()
    assert all(s.over_budget_demands == 2 for s in st.history)  # its forward and its backward use
    assert st.total.peak_live_nbytes == 6 * UNIT  # nothing else held while it is
    assert_clean(env, sched)  # the checker saw live <= max(max_live, in use) at every event


def test_prefetch_waits_for_pool_room_instead_of_queueing(make_env):
    # Budgets for 10 units, a pool for 4: prefetches are deferred, never queued in the pool.
    env = make_env(12, pool_count=4)
    sched = env.scheduler(bucket=6 * UNIT, live=10 * UNIT)
    con = Consumer(env, sched)
    for _ in range(3):
        con.step(chain(env.keys))
    st = sched.stats()
    assert st.total.pool_deferrals > 0
    assert st.last.prefetch_hits + st.last.late_prefetches > 0
    assert env.store.pool.stats().waits == 0, "a fetch of ours waited in the pool queue"
    assert_clean(env, sched)


def test_an_on_demand_fetch_takes_pool_room_from_kept_units(make_env):
    # max_live and reuse allow keeping every unit, the pool holds 4, nothing is prefetched:
    # a demand that finds the pool full of kept units gives up the one needed last.
    env = make_env(10, pool_count=4)
    sched = env.scheduler(bucket=0, live=10 * UNIT, reuse=10**9)
    con = Consumer(env, sched)
    for _ in range(3):
        con.step(chain(env.keys))
    st = sched.stats()
    assert st.total.pressure_drops > 0
    assert env.store.pool.stats().waits == 0
    assert_clean(env, sched)


def test_units_held_by_others_shrink_what_the_scheduler_may_use(make_env):
    # Two of a 5-unit pool are held by someone else (e.g. an optimizer), and one of them is
    # a unit the model uses: the scheduler shares that one and works in the rest.
    env = make_env(8, pool_count=5)
    env.fetch_outside("u7")
    env.fetch_outside("u2")
    sched = env.scheduler(bucket=4 * UNIT, live=8 * UNIT)
    con = Consumer(env, sched)
    for _ in range(3):
        con.step(env.keys[:6] + env.keys[:6][::-1])
    last = sched.stats().last
    assert last.prefetch_hits > 0 and last.pool_deferrals > 0
    assert env.holds() == {"u7": 1, "u2": 1}
    env.release_outside("u7")
    env.release_outside("u2")
    assert_clean(env, sched)


def test_untraced_uses_between_steps_are_served_on_demand(make_env):
    env = make_env(4)
    sched = env.scheduler(bucket=2 * UNIT, live=4 * UNIT)
    con = Consumer(env, sched)
    con.use("u0")  # e.g. persistent units gathered at install, or after the optimizer step
    con.step(chain(env.keys))
    con.acquire("u3")
    con.step(chain(env.keys[:3]))  # u3 held across a step by someone else
    con.release("u3")
    st = sched.stats()
    assert st.untraced_uses == 2 and st.total.uses == 2 + 8 + 6
    assert_clean(env, sched)
