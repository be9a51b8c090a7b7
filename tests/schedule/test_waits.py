"""A caller waiting for the scheduler's fetch lock says who holds it ([Note: no silent waits])."""

from __future__ import annotations

import logging
import threading

import pytest

from infinity.aio import waits
from tests.schedule.conftest import UNIT, Consumer


@pytest.fixture(autouse=True)
def fast_log(monkeypatch):
    monkeypatch.setattr(waits, "LOG_EVERY_S", 0.05)


def test_a_wait_for_the_fetch_lock_names_the_thread_holding_it(make_env, caplog):
    env = make_env(3, pool_count=1, pool_timeout=60)
    sched = env.scheduler(bucket=0, live=3 * UNIT)
    a, b = Consumer(env, sched), Consumer(env, sched)
    env.fetch_outside("u2")  # the pool's only room is held outside: u0's fetch waits for it
    errors: list[BaseException] = []

    def run(consumer, key):
        try:
            consumer.use(key)
        except BaseException as e:
            errors.append(e)

    ta = threading.Thread(target=run, args=(a, "u0"), name="fetcher-a")
    with caplog.at_level(logging.WARNING):
        ta.start()
        while env.store.pool.stats().waiting == 0:
            threading.Event().wait(0.001)
        tb = threading.Thread(target=run, args=(b, "u1"), name="fetcher-b")
        tb.start()
        threading.Event().wait(0.5)
        env.release_outside("u2")
        ta.join(30)
        tb.join(30)
    assert not ta.is_alive() and not tb.is_alive() and errors == []
    lines = [r.getMessage() for r in caplog.records]
    assert any(
        "scheduler 'prefetch''s fetch lock" in m and "held by thread fetcher-a" in m for m in lines
    ), lines
    assert any("pinned buffer space in pool 'sched-test-pool'" in m for m in lines), lines
