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
    losses, capacity, everything = _train(
        _config(nvme_dir, buffer_count=5, buffer_size=100_000_000)
    )
    assert (
        everything <= capacity <= everything + 5 * DIRECT_ALIGNMENT
    )  # every shard at once, and no more
    assert capacity < 5 * 100_000_000 * 4 // 100
    # A pool the config asks for below the model's size is obeyed as written, with the same numbers.
    small = (
        everything * 3 // 4 // 2 // 4 // 1024 * 1024
    )  # elements: two buffers hold 3/4 of the shards
    asked, capacity, _ = _train(_config(nvme_dir, buffer_count=2, buffer_size=small))
    assert capacity == 2 * small * 4 < everything
    assert asked == losses


def test_a_written_pool_size_not_followed_is_said_once(nvme_dir, caplog):
    # buffer_count=100000 or buffer_size=1e9 were replaced by what the model needs without a word
    shards = sum(
        round_up(p.numel() * 4, DIRECT_ALIGNMENT) for p in tiny_gpt().parameters()
    )  # an upper bound
    for written, count in (({"buffer_size": 10**9}, 4), ({"buffer_count": 100_000}, 100_000)):
        caplog.clear()
        with caplog.at_level("INFO", "infinity.engine"):
            with infinity.initialize(tiny_gpt(), _config(nvme_dir, **written)) as e:
                pool = e.runtime.plan.param_store.pool
        size = written.get("buffer_size", 1 << 16)
        used = pool.buffer_nbytes // 4
        assert pool.count == count and used < size
        assert pool.count * pool.buffer_nbytes <= max(shards, count * DIRECT_ALIGNMENT)
        said = [
            r.getMessage() for r in caplog.records if "offload_param.buffer_size" in r.getMessage()
        ]
        assert said == [
            f"zero_optimization.offload_param.buffer_size={size:,} is written; {used:,} elements "
            f"({pool.buffer_nbytes:,} bytes) per buffer are used, with buffer_count={count:,}: the pool "
            "never needs more than every parameter shard that may rest on NVMe at once "
            f"({pool.count * pool.buffer_nbytes:,} bytes here)"
        ]
    caplog.clear()
    with caplog.at_level("INFO", "infinity.engine"):
        cfg = _config(nvme_dir)
        for key in ("buffer_size", "buffer_count"):  # the defaults are not the user's
            del cfg["zero_optimization"]["offload_param"][key]
        infinity.initialize(tiny_gpt(), cfg).close()
    assert not [r for r in caplog.records if "buffer_size" in r.getMessage()]
