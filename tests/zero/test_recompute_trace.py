"""The prefetch trace with activation checkpointing: the recomputation's fetches are predicted, not misses.

The partitioner over a PrefetchScheduler, wired as tests/schedule/test_partitioner.py
wires it (units on NVMe, GradHooks into a sink, begin_step / end_step around
each micro-batch), without the engine's optimizer step running beside the
forward, so that every scheduler decision is made on the model's thread and
the counts are exact. Step 0 records forward, recomputation and backward;
every later step replays it: every use is prefetched or kept (no on-demand
fetch), nothing is read twice for nothing, and the gradients are those of
fetching on demand.
"""

import pytest
import torch

from infinity.memory import BufferPool
from infinity.schedule import PrefetchScheduler
from infinity.store import TieredStore
from infinity.zero.buffers import TensorCache
from infinity.zero.collectives import DataParallelGroup
from infinity.zero.grad_hooks import GradHooks
from infinity.zero.grads import GradReducer
from infinity.zero.partitioner import Stage3Partitioner
from infinity.zero.shard_source import StoreShardSource
from infinity.zero.units import build_units
from tests.schedule.test_partitioner import DictSink, scheduler_source
from tests.zero.checkpointed import build, train_step

CPU = torch.device("cpu")
STEPS = 4


def run(name, mode, path, make_source):
    model = build(name, mode)
    model.train()
    units = build_units(model, world_size=1, persistence_threshold=100, device=CPU)
    nbytes = [u.layout.shard_nbytes for u in units.units]
    store = TieredStore(path, pool=BufferPool(len(nbytes) + 1, max(nbytes)), name="params")
    for unit in units.units:
        home = "cpu" if unit.persistent else "nvme"
        store.register(unit.key, (unit.layout.shard_numel,), unit.layout.dtype, home=home)
        full = torch.zeros(unit.layout.padded_numel)
        for p, s in zip(unit.params, unit.layout.slots, strict=True):
            full[s.offset : s.offset + s.numel] = p.data.reshape(-1)
        store.write(unit.key, full).result(30)
        if home == "nvme":
            store.evict(unit.key).result(30)
    sink = DictSink(units.units)
    group = DataParallelGroup()
    cache = TensorCache(CPU, cap_nbytes=1 << 20)
    reducer = GradReducer(units.units, group, sink, stage=3, cache=cache)
    source = make_source(store, units)
    part = Stage3Partitioner(model, units, shards=source, group=group, cache=cache, masters=None)
    hooks = GradHooks(units, reducer, partitioned=True, on_unit_done=part.release_backward)
    part.install()
    hooks.install()
    losses, grads = [], []
    try:
        for step in range(STEPS):
            source.begin_step()
            reducer.begin_micro(last=True)
            loss = train_step(model, step)
            loss.backward()
            source.end_step()
            losses.append(loss.item())
            grads.append({i: g.clone() for i, g in sink.grads.items()})
            reducer.end_window()  # taken: the next step's grads start afresh
        stats = (
            (source.stats(), len(source.trace)) if isinstance(source, PrefetchScheduler) else None
        )
        gathered = [u.module_name for u in part.gathered_units()]
    finally:
        part.remove()
        hooks.remove()
        if isinstance(source, PrefetchScheduler):
            source.close()
        store.close()
    assert gathered == [], f"units still gathered after the steps: {gathered}"
    return losses, grads, stats


def reference(name, mode):
    model = build(name, mode)
    model.train()
    return [train_step(model, step).item() for step in range(STEPS)]


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant", "deepspeed"])
@pytest.mark.parametrize("name", ["gpt2", "gpt"])
def test_the_recomputation_replays_with_no_miss_and_no_wasted_read(name, mode, nvme_dir):
    want = reference(name, mode)
    base_losses, base_grads, _ = run(
        name, mode, nvme_dir, lambda store, _u: StoreShardSource(store)
    )
    losses, grads, (stats, trace_len) = run(name, mode, nvme_dir, scheduler_source)
    assert losses == base_losses
    assert losses == pytest.approx(want, rel=1e-6)
    for got, base in zip(grads, base_grads, strict=True):
        assert all(torch.equal(got[i], base[i]) for i in base)
    history = stats.history
    assert [s.kind for s in history] == ["recorded"] + ["replayed"] * (STEPS - 1)
    assert all(s.on_demand == 0 for s in history[1:])  # the recomputation's fetches were predicted
    assert all(s.duplicate_reads == 0 and s.divergence_pos is None for s in history)
    assert (
        stats.traces == 1 and trace_len == history[0].uses
    )  # one trace: forward, recomputations, backward
