"""Random budgets, paths, eval steps and aborts against the real store: the invariants always hold."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.schedule.conftest import Consumer

KiB = 1 << 10
SIZES = [4, 8, 4, 12, 4, 8, 4, 4]  # KiB
KEYS = [f"u{i}" for i in range(len(SIZES))]


@st.composite
def scenarios(draw):
    paths = draw(
        st.lists(
            st.lists(st.sampled_from(KEYS[1:]), min_size=1, max_size=8), min_size=1, max_size=3
        )
    )
    steps = draw(
        st.lists(
            st.tuples(
                st.integers(0, len(paths) - 1),
                st.sampled_from(["train", "train", "train", "eval", "abort"]),
                st.booleans(),  # the root unit u0 is held through the forward
            ),
            min_size=1,
            max_size=8,
        )
    )
    return dict(
        bucket=draw(st.sampled_from([0, 4, 8, 16, 64])) * KiB,
        live=draw(st.sampled_from([8, 16, 24, 48, 512])) * KiB,
        reuse=draw(st.sampled_from([0, 8, 32, 10**6])) * KiB,
        paths=paths,
        steps=steps,
    )


@pytest.fixture
def env(make_env):
    # 32 KiB of pool: the largest working set (u0 held with u3) is 16 KiB.
    return make_env(
        sizes=[n * KiB for n in SIZES], pool_count=8, pool_size=4 * KiB, pool_timeout=30
    )


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(sc=scenarios())
def test_invariants_hold_whatever_the_model_does(env, sc):
    env.cold()
    env.checker.reset()
    sched = env.scheduler(bucket=sc["bucket"], live=sc["live"], reuse=sc["reuse"])
    con = Consumer(env, sched)
    try:
        for path_i, kind, root in sc["steps"]:
            path = sc["paths"][path_i]
            sched.begin_step()
            try:
                if root:
                    con.acquire("u0")
                for i, k in enumerate(path):
                    con.use(k)
                    if kind == "abort" and i == len(path) // 2:
                        raise RuntimeError("a failing forward")
                if root:
                    con.release("u0")
                if kind == "train":
                    con.run(path[::-1])
            except RuntimeError:
                con.release_all()
                sched.abort_step()
                continue
            sched.end_step()
        stats = sched.stats()
        assert env.checker.violations == []
        assert (
            env.holds() == {}
            and stats.live_nbytes == stats.ahead_nbytes == stats.in_use_nbytes == 0
        )
        assert stats.total.peak_ahead_nbytes <= sc["bucket"]
        if sc["live"] >= 16 * KiB:
            assert (
                stats.total.peak_live_nbytes <= sc["live"] and stats.total.over_budget_demands == 0
            )
        for s in stats.history:
            assert s.on_demand + s.prefetch_hits + s.late_prefetches + s.reuse_hits == s.uses
            # A read is wasted only when a unit read ahead is given up unused (a switch, pool
            # pressure, someone else's need for the pool, the step ending early).
            assert s.duplicate_reads <= s.dropped_prefetches
    finally:
        sched.close()
        env.scheds.remove(sched)
