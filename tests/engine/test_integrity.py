"""Swap files changed behind the runtime's back between steps stop training with an error naming the
file, offset, key and both checksums, instead of training on wrong numbers (integrity is on by
default: offload_param.integrity / offload_optimizer.integrity; infinity/store/integrity.py)."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

import infinity
from infinity.store import Residency, StoreIOError
from tests.engine.models import batch, tiny_gpt
from tests.engine.reference import engine_config


def _train_step(engine, step: int) -> None:
    x, y = batch(step, 0, 0)
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()


def _all_home(store) -> None:
    """Writes every key home and drops it from host memory, so the next use reads the swap files."""
    store.flush_all().result(60)
    for key in store.keys():
        if store.spec(key).holds == 0:
            store.evict(key).result(60)


def _victim(store):
    """A key at rest on NVMe whose first 4 KiB are not all zero (so zeroing them changes it)."""
    for key in store.keys():
        spec = store.spec(key)
        if spec.home != "nvme" or spec.state is not Residency.AT_REST or spec.nbytes < 4096:
            continue
        path, offset, _n = store.locate(key)[0]
        with open(path, "rb") as f:
            f.seek(offset)
            if any(f.read(4096)):
                return key, path, offset
    raise AssertionError(f"store '{store.name}' has no key at rest with data to tamper with")


def _tamper(how: str, path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        if how == "zero":
            f.seek(offset)
            f.write(bytes(4096))
        elif how == "flip":
            f.seek(offset + 1000)
            b = f.read(1)[0]
            f.seek(offset + 1000)
            f.write(bytes([b ^ 0x10]))
        else:
            f.truncate(offset)
        f.flush()
        os.fsync(f.fileno())


@pytest.mark.parametrize("store_name", ["param_store", "state_store"])
@pytest.mark.parametrize("how", ["zero", "flip", "truncate"])
def test_a_swap_file_changed_between_steps_stops_training(nvme_dir, how, store_name):
    torch.manual_seed(0)
    engine = infinity.initialize(tiny_gpt(), engine_config(3, "nvme", "nvme", nvme_dir, gas=1))
    try:
        _train_step(engine, 0)
        engine.synchronize()
        # The scheduler reads ahead for the next step across the boundary; give that back, as a
        # checkpoint load does before it changes the shards behind the scheduler's back.
        engine.checkpoint_parts().trace.abort_step()
        store = getattr(engine.runtime, store_name)
        assert store.integrity, "integrity must be on by default"
        for s in (engine.runtime.param_store, engine.runtime.state_store):
            _all_home(s)
        key, path, offset = _victim(store)
        _tamper(how, path, offset)
        with pytest.raises((StoreIOError, RuntimeError)) as e:
            for step in range(1, 3):
                _train_step(engine, step)
            engine.synchronize()
        msg = str(e.value)
        mismatch = (
            "checksum mismatch for key" in msg and "with CRC32C 0x" in msg and "was written" in msg
        )
        if how == "truncate":
            # Every key from the cut on is gone: the first one read (or one whose write-back
            # refilled the file with a hole before it) is named, with its offset.
            assert path in msg and "at offset" in msg, msg
            assert "runs past the end of the file" in msg or mismatch, msg
        else:
            assert (
                f"key {key!r}" in msg and path in msg and f"at offset {offset}" in msg and mismatch
            ), msg
    finally:
        with contextlib.suppress(RuntimeError):
            engine.synchronize()
        engine.close()


def test_integrity_can_be_turned_off_per_section(nvme_dir):
    cfg = engine_config(3, "nvme", "nvme", nvme_dir, gas=1)
    cfg["zero_optimization"]["offload_param"]["integrity"] = False
    cfg["zero_optimization"]["offload_optimizer"]["integrity"] = False
    engine = infinity.initialize(tiny_gpt(), cfg)
    try:
        assert not engine.runtime.param_store.integrity and not engine.runtime.state_store.integrity
        _train_step(engine, 0)
        engine.synchronize()
        assert engine.runtime.state_store.stats().integrity_checks == 0
    finally:
        engine.close()
