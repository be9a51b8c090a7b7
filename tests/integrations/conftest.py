"""Fixtures for the framework adapters: deepspeed unimportable, and no process group or
environment left behind by a Lightning run (its DDP-style strategies join a gloo group of one)."""

import gc
import os
import sys

import pytest
import torch.distributed as dist

try:
    import lightning  # noqa: F401
except ImportError:
    raise ImportError("tests/integrations need lightning (the test extra pins 2.6.6): pip install -e '.[test]'") from None


@pytest.fixture(autouse=True)
def no_deepspeed(monkeypatch):
    """``import deepspeed`` raises ImportError for the whole test: nothing on these paths may need it."""
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    yield
    leaked = sorted(m for m in sys.modules if m.startswith("deepspeed.") or (m == "deepspeed" and sys.modules[m]))
    assert not leaked, f"deepspeed modules were imported: {leaked}"


@pytest.fixture(autouse=True)
def clean_process(monkeypatch):
    before = dict(os.environ)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    for k in set(os.environ) - set(before):
        del os.environ[k]
    os.environ.update(before)
    gc.collect()  # engines hold buffer pools and swap files until they are collected
