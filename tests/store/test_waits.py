"""Long waits on the store say what they wait for ([Note: no silent waits] in infinity/aio/waits.py)."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from infinity.aio import waits

KiB = 1 << 10


@pytest.fixture(autouse=True)
def fast_log(monkeypatch):
    monkeypatch.setattr(waits, "LOG_EVERY_S", 0.05)


def test_a_fetch_waiting_for_its_read_names_the_key_and_the_read(make_store, caplog):
    store, aio = make_store(recording=True, name="params")
    store.register("w.0", (4 * KiB,), torch.float32)
    store.write("w.0", torch.ones(4 * KiB)).result(10)
    store.evict("w.0").result(10)
    gate = aio.gate_next("read")
    fut = store.fetch("w.0")
    threading.Timer(0.5, gate.set).start()  # the drive answers late
    with caplog.at_level(logging.WARNING, logger="infinity.store"):
        assert torch.equal(fut.result(30), torch.ones(4 * KiB))
    lines = [r.getMessage() for r in caplog.records]
    assert any(
        m.startswith("still waiting after")
        and "fetch of key 'w.0' in store 'params': its read of key 'w.0' (16384 bytes), started"
        in m
        for m in lines
    ), lines
    assert any(m.startswith("waited ") for m in lines), lines
    store.release("w.0")


def test_close_ends_a_fetch_waiting_for_pool_memory(make_store):
    store = make_store(pool_count=1, pool_size=16 * KiB, pool_timeout=300)
    store.register_many([("a", (4 * KiB,), torch.float32), ("b", (4 * KiB,), torch.float32)])
    store.write("a", torch.ones(4 * KiB)).result(10)
    store.write("b", torch.ones(4 * KiB)).result(10)
    store.fetch("a").result(10)  # held: b can never get in
    errors: list[BaseException] = []

    def fetch_b():
        try:
            store.fetch("b").result(60)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=fetch_b)
    t.start()
    while store.pool.stats().waiting == 0:
        threading.Event().wait(0.001)
    store.close()
    t.join(30)
    assert not t.is_alive(), "the fetch kept waiting for the pool after the store was closed"
    assert len(errors) == 1 and "is closed" in str(errors[0]), errors
