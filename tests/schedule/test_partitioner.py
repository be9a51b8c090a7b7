"""The stage-3 partitioner with PrefetchScheduler as its ShardSource: the same numbers as fetching on demand.

Built as infinity/engine/build.py builds it (units in the store, GradHooks
reducing into a sink), with the engine's bracket around each micro-batch
(begin_step before forward, end_step after backward; an eval forward under
no_grad is bracketed too). Compared with StoreShardSource and with the plain
module: losses and gradient shards equal, and from step 1 on the units arrive
by prefetch.
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
from tests.engine.models import MODELS, batch

CPU = torch.device("cpu")
STEPS = 5


class DictSink:
    """The GradSink the optimizer would be: one fp32 gradient shard per unit."""

    def __init__(self, units):
        self.grads = {u.index: torch.zeros(u.layout.shard_numel) for u in units}

    def open(self, index, *, first):
        if first:
            self.grads[index].zero_()
        return self.grads[index]

    def close(self, index, *, final):
        pass


def run(model_name, path, make_source):
    torch.manual_seed(0)
    model = MODELS[model_name]()
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
            if hasattr(model, "step"):
                model.step = step
            x, y = batch(step, 0, 0)
            source.begin_step()
            reducer.begin_micro(last=True)
            loss = model(x, y)
            loss.backward()
            source.end_step()
            losses.append(loss.item())
            grads.append({i: g.clone() for i, g in sink.grads.items()})
            reducer.end_window()  # the optimizer took them: the next step's grads start afresh
            source.begin_step()  # an eval forward between training steps
            with torch.no_grad():
                losses.append(model(*batch(step, 99, 0)).item())
            source.end_step()
        stats = source.stats() if isinstance(source, PrefetchScheduler) else None
        held = {k: store.spec(k).holds for k in store.keys() if store.spec(k).holds}
        persistent = {u.key for u in units.units if u.persistent}
    finally:
        part.remove()
        hooks.remove()
        if isinstance(source, PrefetchScheduler):
            source.close()
        store.close()
    assert set(held) <= persistent, f"non-persistent units still held after the steps: {held}"
    return losses, grads, stats


def reference(model_name):
    torch.manual_seed(0)
    model = MODELS[model_name]()
    losses = []
    for step in range(STEPS):
        if hasattr(model, "step"):
            model.step = step
        losses.append(model(*batch(step, 0, 0)).item())
        with torch.no_grad():
            losses.append(model(*batch(step, 99, 0)).item())
    return losses


def scheduler_source(store, units):
    largest = max(units.units, key=lambda u: u.layout.shard_nbytes)
    total = sum(u.layout.shard_numel for u in units.units)
    return PrefetchScheduler.for_engine(
        store,
        prefetch_bucket_size=2 * largest.layout.shard_numel,
        max_live_parameters=total,
        max_reuse_distance=largest.layout.shard_numel,
        itemsize=4,
        largest_unit_nbytes=largest.layout.shard_nbytes,
        largest_unit=repr(largest.module_name),
    )


@pytest.mark.parametrize("model_name", ["gpt", "twice", "alternating"])
def test_partitioner_over_the_scheduler_matches_on_demand_fetching(model_name, nvme_dir):
    want = reference(model_name)
    base_losses, base_grads, _ = run(
        model_name, nvme_dir, lambda store, _u: StoreShardSource(store)
    )
    losses, grads, stats = run(model_name, nvme_dir, scheduler_source)
    assert losses == base_losses
    assert losses == pytest.approx(want, rel=1e-6)
    for got, base in zip(grads, base_grads, strict=True):
        assert all(torch.equal(got[i], base[i]) for i in base)
    kinds = [s.kind for s in stats.history]
    train, evals = stats.history[0::2], stats.history[1::2]
    assert kinds[0] == "recorded" and all(s.kind == "short" for s in evals)
    if model_name == "alternating":  # even and odd steps take different branches
        assert kinds[2] == "diverged" and [s.kind for s in train[2:]] == ["replayed"] * (STEPS - 2)
        assert all(s.trace_switches == 1 and s.on_demand == 1 for s in train[2:])
    else:
        assert all(s.kind == "replayed" and s.on_demand == 0 for s in train[1:])
    assert all(s.duplicate_reads == 0 for s in stats.history)
