"""AioHandle.live: the process's open handles, closed at exit (tests/aio/test_process_safety.py
covers fork), held without callbacks ([Note: finalizers run no Python])."""

from __future__ import annotations

import gc

from infinity.aio import AioHandle
from infinity.aio.handle import LiveHandles


def test_live_handles_close_what_is_open_and_forget_what_is_closed_or_dropped(engine, monkeypatch):
    live = LiveHandles()
    monkeypatch.setattr(AioHandle, "live", live)
    a, b, c = (AioHandle(engine=engine) for _ in range(3))
    b.close()
    assert [id(h) for h in live.handles()] == [id(a), id(c)]
    del c
    gc.collect()
    assert [id(h) for h in live.handles()] == [id(a)]
    live.close_all()  # what exit runs
    assert a.closed and live.handles() == []
