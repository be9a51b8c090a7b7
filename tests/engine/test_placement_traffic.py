"""No second read of a unit in a step while memory can hold it: what the planner and the pool save is not read.

Measured on the engine's own counters (the parameter store's bytes read, the
prefetch scheduler's reads and re-reads per step), fp32 stage 3, after the
first step (step 0 records the trace and reads on demand):

- the planner, given a budget that holds every parameter shard, keeps them all
  in host memory (fp32 shards are their own master: the densest saving) and no
  parameter byte is read, while optimizer arrays still rest on NVMe;
- parameters on NVMe with a pool that holds all of them: the backward takes
  what the forward read and the next forward what the step wrote, so no unit
  is read again, in any micro-step;
- the same with a pool of two units: the backward has to read units again
  (the counters see re-reads, so the two checks above can fail).
"""

import pytest
import torch

from infinity.estimate.runtime_plan import PARAM
from tests.engine.models import MODELS
from tests.engine.reference import _forced, batch, engine_config
from tests.engine.test_placement_equivalence import only

STEPS = 4


def _train(engine, gas: int) -> list[tuple[int, int, int]]:
    """Per optimizer step after the first: (parameter bytes read, scheduler reads, scheduler re-reads)."""
    store = engine.runtime.param_store
    rows = []
    for step in range(STEPS):
        before = store.stats().read.nbytes if store is not None else 0
        reads = rereads = 0
        for micro in range(gas):
            x, y = batch(step, micro, 0)
            engine.backward(engine(x, y))
            engine.step()
            last = engine.prefetch_stats().last if engine.prefetch_stats() is not None else None
            reads += last.reads if last is not None else 0
            rereads += last.rereads if last is not None else 0
        engine.synchronize()
        if step:
            rows.append(
                ((store.stats().read.nbytes if store is not None else 0) - before, reads, rereads)
            )
    return rows


def _pool_config(nvme_dir, gas: int, buffer_count: int) -> dict:
    cfg = engine_config(3, "auto", "auto", nvme_dir, gas=gas)
    largest = max(p.numel() for p in MODELS["gpt"]().parameters())
    cfg["zero_optimization"]["offload_param"].update(buffer_count=buffer_count, buffer_size=largest)
    return cfg


@pytest.mark.parametrize("gas", [1, 2])
def test_the_planner_keeps_every_parameter_the_budget_holds_and_reads_none(gas, nvme_dir):
    import infinity
    from infinity.config import load_config
    from infinity.estimate.context import run_context
    from infinity.estimate.placement import place_in_budget

    cfg = engine_config(3, "auto", "auto", nvme_dir, gas=gas)
    for key in ("buffer_count", "buffer_size"):
        del cfg["zero_optimization"]["offload_param"][key]  # the planner sizes the pool
    torch.manual_seed(0)
    probe = MODELS["gpt"]()
    ctx = run_context(probe, load_config(cfg), device="cpu", world_size=1)
    low = place_in_budget(probe, load_config(cfg), ctx, budget_nbytes=0, budget_source="probe")
    params = sum(
        u.layout.shard_nbytes
        for sp, u in zip(low.shards, low.units, strict=True)
        if sp.param_home == "nvme"
    )
    assert params, "at the least budget some parameters rest on NVMe"
    cfg["host_memory_budget"] = low.chosen.need_nbytes + params
    torch.manual_seed(0)
    engine = infinity.initialize(MODELS["gpt"](), cfg)
    try:
        plan = engine.runtime.plan
        assert all(sp.param_home == "cpu" for sp in plan.shards)
        assert any(
            h == "nvme" for sp in plan.shards for _, h in sp.state_homes
        )  # the budget is not everything
        assert _train(engine, gas) == [(0, 0, 0)] * (STEPS - 1)
    finally:
        engine.close()


@pytest.mark.parametrize("gas", [1, 2])
def test_a_pool_that_holds_every_unit_reads_none_again(gas, nvme_dir):
    torch.manual_seed(0)
    engine = _forced(MODELS["gpt"](), _pool_config(nvme_dir, gas, buffer_count=16), only(PARAM))
    try:
        plan = engine.runtime.plan
        assert sum(sp.param_home == "nvme" for sp in plan.shards) >= 8
        assert _train(engine, gas) == [(0, 0, 0)] * (STEPS - 1)
    finally:
        engine.close()


def test_a_pool_of_two_units_reads_units_again_in_the_backward(nvme_dir):
    torch.manual_seed(0)
    engine = _forced(MODELS["gpt"](), _pool_config(nvme_dir, 1, buffer_count=2), only(PARAM))
    try:
        rows = _train(engine, 1)
        assert all(nbytes > 0 and rereads > 0 for nbytes, _, rereads in rows), rows
    finally:
        engine.close()
