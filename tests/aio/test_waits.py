"""wait_until ([Note: no silent waits]): long waits log what they wait for and who holds it, end with
the cause as soon as one is known, and cost nothing extra when they end within the first slice."""

from __future__ import annotations

import logging
import threading

import pytest

from infinity.aio import waits

LOG = logging.getLogger("infinity.test.waits")


@pytest.fixture(autouse=True)
def fast_log(monkeypatch):
    monkeypatch.setattr(waits, "LOG_EVERY_S", 0.05)


def test_a_wait_that_ends_at_once_calls_ready_once_and_logs_nothing(caplog):
    calls = []
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        assert waits.wait_until(lambda s: calls.append(s) or True, what="x", log=LOG)
    assert len(calls) == 1 and caplog.records == []


def test_a_long_wait_logs_what_and_who_holds_it_then_how_long_it_took(caplog):
    done = threading.Event()
    looks = [0]

    def ready(slice_s):
        looks[0] += 1
        if looks[0] == 2:  # release the waiter only after it has logged
            threading.Timer(0.2, done.set).start()
        return done.wait(slice_s)

    with caplog.at_level(logging.WARNING, logger=LOG.name):
        assert waits.wait_until(ready, what=lambda: "the thing", holder=lambda: "thread T", log=LOG)
    lines = [r.getMessage() for r in caplog.records]
    assert any(
        m.startswith("still waiting after") and "for the thing; held by thread T" in m
        for m in lines
    ), lines
    assert lines[-1].startswith("waited ") and lines[-1].endswith("for the thing"), lines


def test_a_known_cause_ends_the_wait_with_that_error():
    stop = threading.Event()
    threading.Timer(0.1, stop.set).start()

    def cause():
        return RuntimeError("the writer died") if stop.is_set() else None

    never = threading.Event()
    with pytest.raises(RuntimeError, match="the writer died"):
        waits.wait_until(never.wait, what="x", log=LOG, cause=cause)


def test_a_timeout_returns_false():
    never = threading.Event()
    assert waits.wait_until(never.wait, what="x", log=LOG, timeout=0.2) is False
    assert waits.wait_until(never.wait, what="x", log=LOG, timeout=0.0) is False
