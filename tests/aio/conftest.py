"""Fixtures of the aio tests: the engine parameter every test runs under, and a handle on it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from infinity.aio import AioHandle, built_with_io_uring, io_uring_status

ENGINES = ("io_uring", "threads")


def _io_uring_skip_reason() -> str:
    if not built_with_io_uring():
        return "this build has no io_uring back end (liburing was not found at build time)"
    why = io_uring_status()
    return f"io_uring is not available in this process: {why}" if why else ""


@pytest.fixture(params=ENGINES)
def engine(request) -> str:
    """Every aio test runs once per back end (STYLE: parametrized over the fallback-mode enum)."""
    if request.param == "io_uring" and (why := _io_uring_skip_reason()):
        pytest.skip(why)
    return request.param


@pytest.fixture
def handle(engine) -> Iterator[AioHandle]:
    with AioHandle(engine=engine, block_size=64 << 10, queue_depth=8) as h:
        yield h
