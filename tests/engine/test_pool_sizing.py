"""Pools are sized to what the model needs, capped by the config (issue 17): DeepSpeed's default
parameter pool (5 buffers × 1e8 elements: 2 GB in fp32) is never allocated for a model that cannot
fill it. (The optimizer pool is already no larger than three times the model's swapped state: a
sub-group is at most every shard. It keeps its three buffers even for fewer sub-groups: the next
step's first read can start while the last write is in flight.)

Oracles: the shards' own sizes (what the pool must be able to hold at once), and the same training with
the pool the config asks for explicitly (the cap is never a change of math)."""

from __future__ import annotations

import torch

import infinity
from infinity.aio import DIRECT_ALIGNMENT
from infinity.memory import round_up
from tests.engine.models import batch, tiny_gpt
from tests.engine.reference import engine_config


def _config(nvme_dir, **param):
    cfg = engine_config(3, "nvme", "nvme", nvme_dir, gas=1)
    cfg["zero_optimization"]["offload_param"].update(param)
    return cfg


def _train(cfg, steps=2):
    torch.manual_seed(0)
    engine = infinity.initialize(tiny_gpt(), cfg)
    try:
        losses = []
        for step in range(steps):
            loss = engine(*batch(step, 0, 0))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        rt = engine.runtime
        streamed = [u for u in rt.plan.units if not u.persistent]  # max_in_cpu 0: every one on NVMe
        assert all(rt.plan.shards[u.index].param_home == "nvme" for u in streamed)
        everything = sum(round_up(u.layout.shard_nbytes, DIRECT_ALIGNMENT) for u in streamed)
        return losses, rt.param_store.pool.capacity, everything
    finally:
        engine.close()


def test_the_default_parameter_pool_holds_the_model_not_two_gigabytes(nvme_dir):
    # DeepSpeed's defaults: buffer_count 5, buffer_size 1e8 elements.
    losses, capacity, everything = _train(_config(nvme_dir, buffer_count=5, buffer_size=100_000_000))
    assert everything <= capacity <= everything + 5 * DIRECT_ALIGNMENT  # every shard at once, and no more
    assert capacity < 5 * 100_000_000 * 4 // 100
    # A pool the config asks for below the model's size is obeyed as written, with the same numbers.
    small = everything * 3 // 4 // 2 // 4 // 1024 * 1024  # elements: two buffers hold 3/4 of the shards
    asked, capacity, _ = _train(_config(nvme_dir, buffer_count=2, buffer_size=small))
    assert capacity == 2 * small * 4 < everything
    assert asked == losses
