"""Faults during training stop it at once with an error that says what failed: an EIO on a background
write-back ([Note: failed write-backs] in infinity/store/write_path.py), injected through the store's
recording aio double (tests/store/conftest.py) into the handles infinity.initialize opens."""

from __future__ import annotations

import contextlib
import errno
import time

import pytest
import torch

import infinity
from infinity.aio import AioHandle
from infinity.store import StoreIOError, handles
from tests.engine.models import batch, tiny_gpt
from tests.engine.reference import engine_config
from tests.store.conftest import RecordingAio


@pytest.fixture
def recorded(monkeypatch):
    """Every aio handle a store opens is a RecordingAio around the real one."""
    made: list[RecordingAio] = []

    class Recorded:
        @staticmethod
        def from_config(cfg):
            made.append(RecordingAio(inner=AioHandle(cfg)))
            return made[-1]

    monkeypatch.setattr(handles, "AioHandle", Recorded)
    return made


def _train_step(engine, step: int) -> None:
    x, y = batch(step, 0, 0)
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()


def test_a_write_back_eio_stops_training_at_the_next_call_naming_the_write(nvme_dir, recorded):
    torch.manual_seed(0)
    engine = infinity.initialize(tiny_gpt(), engine_config(3, "nvme", "nvme", nvme_dir, gas=1))
    try:
        _train_step(engine, 0)
        for aio in recorded:
            aio.fail_next("write", errno=errno.EIO)
        t0 = time.monotonic()
        with pytest.raises((StoreIOError, RuntimeError)) as e:
            for step in range(1, 5):
                _train_step(engine, step)
        assert time.monotonic() - t0 < 60, "the failure surfaced only after a long wait"
        msg = str(e.value)
        assert not isinstance(e.value, TimeoutError) and "waited" not in msg, msg
        assert "Input/output error" in msg and "write of key" in msg, msg
        assert "/swap." in msg and "at offset" in msg, msg
        faulted = [
            s
            for s in (engine.runtime.param_store, engine.runtime.state_store)
            if s.fault is not None
        ]
        assert faulted, "no store holds the failed write-back"
        for store in faulted:
            assert store.stats().dirty_nbytes > 0, "the data that could not be written was dropped"
        # Every later engine call says the same until the write-back is retried.
        x, y = batch(9, 0, 0)
        with pytest.raises(StoreIOError, match=r"engine.forward\(\) refused.*Input/output error"):
            engine(x, y)
    finally:
        with contextlib.suppress(RuntimeError):
            engine.synchronize()  # the overlapped step may have failed on the same write
        engine.close()


def test_a_wait_for_the_overlapped_step_says_so_and_ends_if_its_thread_is_gone(monkeypatch, caplog):
    import logging
    import threading

    from infinity.aio import waits
    from infinity.engine.overlap import OverlappedStep

    monkeypatch.setattr(waits, "LOG_EVERY_S", 0.05)
    ov = OverlappedStep()
    go = threading.Event()

    def step(done):
        assert go.wait(30)
        done(0)

    ov.start(step)
    threading.Timer(0.3, go.set).start()
    with caplog.at_level(logging.WARNING, logger="infinity.engine"):
        ov.progress.wait_unit(0)
    ov.synchronize()
    lines = [r.getMessage() for r in caplog.records]
    assert any(
        "the optimizer step to update unit 0 (0 unit(s) updated so far); held by thread "
        "infinity-optimizer-step" in m
        for m in lines
    ), lines
    # A step thread that ended without saying so (killed at interpreter exit, say) is a known
    # cause: the wait ends with it instead of blocking for good.
    gone = threading.Thread(target=lambda: None, name="infinity-optimizer-step")
    gone.start()
    gone.join()
    ov.progress._thread, ov.progress._running = gone, True
    with pytest.raises(RuntimeError, match="ended without finishing the step"):
        ov.synchronize()


@pytest.mark.parametrize("failing_call", [2, 9])
def test_an_optimizer_step_that_raises_gives_back_what_it_read(
    nvme_dir, monkeypatch, caplog, failing_call
):
    """An error inside the optimizer step (the 2nd Adam call: the persistent units', stepped in the
    main thread; the 9th: the background step's) leaves no key held: the sub-group being updated and
    the one read ahead are given back, so close() finds nothing pinned in the pools."""
    import logging

    from infinity.optim import partitioned_adam

    calls = [0]
    real = partitioned_adam.adam_step

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == failing_call:
            raise RuntimeError("injected Adam failure")
        return real(*args, **kwargs)

    torch.manual_seed(0)
    engine = infinity.initialize(tiny_gpt(), engine_config(3, "nvme", "nvme", nvme_dir, gas=1))
    try:
        _train_step(engine, 0)
        monkeypatch.setattr(partitioned_adam, "adam_step", failing)
        with pytest.raises(RuntimeError, match="injected Adam failure"):
            _train_step(engine, 1)
            engine.synchronize()  # the background step's error
        assert calls[0] >= failing_call
    finally:
        with caplog.at_level(logging.WARNING, logger="infinity.store"):
            engine.close()
    held = [r.getMessage() for r in caplog.records if "still held" in r.getMessage()]
    assert held == []
