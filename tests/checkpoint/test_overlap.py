"""Checkpoints under the stage-3 engine's overlapped optimizer step and its store cache: a save taken
while the step still runs in the background holds the state after the step; updated shards left cached
and dirty in the store are saved with their current values and stay cached; a load into an engine with
a step in flight and dirty cached shards ends with exactly the loaded state (nothing stale shadows it).

The step is held back deterministically: the background step waits for an event that only
``synchronize()`` sets, so a checkpoint call that did not synchronize first would see the old state."""

from __future__ import annotations

import contextlib
import threading

import pytest

from tests.checkpoint.helpers import N_STEPS, assert_same, config, make_engine, snapshot, train


@contextlib.contextmanager
def step_held_back(engine):
    """The overlapped step starts but does no work until someone waits for it: ``synchronize()``, or
    a fetch waiting for a unit's update (the next forward).

    Each step gets a gate of its own: ``start`` itself synchronizes with the step before it (through
    the patched ``synchronize``), which must not open the gate of the step being started."""
    overlap = engine.runtime.overlap
    progress = overlap.progress
    gates: list[threading.Event] = []
    start, sync, wait_unit = overlap.start, overlap.synchronize, progress.wait_unit

    def held_start(step):
        gate = threading.Event()

        def held(done):
            gate.wait()
            step(done)

        start(held)  # runs releasing_sync for the step before this gate is listed
        gates.append(gate)

    def open_gates():
        for gate in gates:
            gate.set()

    def releasing_sync():
        open_gates()
        sync()

    def releasing_wait_unit(index):
        open_gates()
        wait_unit(index)

    overlap.start, overlap.synchronize, progress.wait_unit = (
        held_start,
        releasing_sync,
        releasing_wait_unit,
    )
    try:
        yield
    finally:
        open_gates()
        del overlap.start, overlap.synchronize, progress.wait_unit  # the class's methods again


@pytest.fixture
def dirty_cache(monkeypatch):
    """Updated shards stay cached *dirty*: the optimizer writes them home right away only when no one
    else holds them, so a shard held across the step stays dirty; this makes every shard so."""
    import infinity.optim.partitioned_adam as partitioned_adam

    monkeypatch.setattr(partitioned_adam, "_flush_unheld", lambda store, key: None)


@pytest.fixture
def swap(tmp_path):
    (tmp_path / "swap").mkdir()
    (tmp_path / "swap2").mkdir()
    return tmp_path


@pytest.mark.parametrize("model", ["gpt", "tied"])
def test_save_waits_for_the_step_in_flight_and_reads_dirty_cached_shards(model, swap, dirty_cache):
    a, _ = make_engine(model, config(3, "nvme", "nvme", swap / "swap"), seed=0)
    b, _ = make_engine(model, config(3, "nvme", "nvme", swap / "swap2"), seed=1)
    try:
        assert a.overlap_step
        with step_held_back(a):
            train(a, 0, N_STEPS)
            assert a.runtime.overlap.running  # the last step is still to run
            a.save_checkpoint(swap / "ckpt")
        assert not a.runtime.overlap.running
        dirty = a.runtime.param_store.stats().dirty_nbytes
        assert dirty > 0  # updated shards stay cached, not yet written home
        expected = snapshot(a)
        assert (
            a.runtime.param_store.stats().dirty_nbytes == dirty
        )  # the save did not write them out
        b.load_checkpoint(swap / "ckpt")
        assert_same(snapshot(b), expected)
    finally:
        a.close()
        b.close()


def test_load_into_an_engine_with_a_step_in_flight_and_dirty_cache(swap, dirty_cache):
    a, _ = make_engine("gpt", config(3, "nvme", "nvme", swap / "swap"), seed=0)
    b, _ = make_engine("gpt", config(3, "nvme", "nvme", swap / "swap2"), seed=1)
    try:
        train(a, 0, N_STEPS)
        a.save_checkpoint(swap / "ckpt")
        expected = snapshot(a)
        with step_held_back(b):
            train(b, 0, N_STEPS + 1)  # other weights, other step counts, its last step held back
            assert b.runtime.overlap.running
            b.load_checkpoint(swap / "ckpt")
        assert not b.runtime.overlap.running
        assert_same(snapshot(b), expected)
        # ... and training on from there matches the engine that saved it.
        assert train(b, N_STEPS, 1) == train(a, N_STEPS, 1)
        assert_same(snapshot(b), snapshot(a))
    finally:
        a.close()
        b.close()


def test_save_16bit_model_waits_for_the_step_in_flight(swap):
    import safetensors.torch

    from tests.checkpoint.helpers import weights

    a, _ = make_engine("gpt", config(3, "nvme", "nvme", swap / "swap"), seed=0)
    try:
        with step_held_back(a):
            train(a, 0, 3)  # WarmupLR: the first two steps run at lr 0
            assert a.runtime.overlap.running
            out = a.save_16bit_model(swap)
        saved = safetensors.torch.load_file(out)
        for name, w in weights(a).items():
            assert_same(saved[name], w, name)
    finally:
        a.close()
