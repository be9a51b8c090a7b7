"""tune: the sizing keys of an NVMe setting, derived from the model instead of guessed (DeepSpeed #1005, #3506).

DeepSpeed's defaults are sized for nothing in particular: ``sub_group_size``
1e9 makes this runtime's optimizer pool 3 × 1e9 × 16 B = 45 GiB of pinned
memory, ``max_in_cpu`` 1e9 keeps up to 1e9 parameter elements in host memory
although the user asked for NVMe, and ``buffer_size`` 1e8 is either far too
big or too small for the largest layer. The rules here:

- ``sub_group_size``: SUB_GROUP_TARGET elements (an optimizer pool near
  1 GiB; reads and writes of tens of MiB, well past the disk's block size),
  or a sixteenth of the rank's state if that is less (the pool then costs
  3/16 of what it streams), but never below the largest shard (a sub-group
  never splits one); rounded up to 1 Mi elements; only ever lowered.
- ``offload_param.max_in_cpu``: 0 — every partitioned parameter on NVMe.
- ``offload_param.buffer_size``: what the parameter pool should hold, with
  the buffer count kept: two consecutive sub-groups of shards (the step then
  reads one while it updates the other; RuntimePlan.sub_group_param_nbytes),
  and one sub-group plus the partitioner's working set of NVMe units (the
  stage-3 step runs behind the next forward, which holds those meanwhile;
  SchedulePlan.pool_working_set_nbytes); rounded up to 1 Mi elements.
- ``stage3_max_live_parameters``: raised to the partitioner's working set
  where it is below it (the prefetch scheduler refuses it otherwise).
"""

from __future__ import annotations

import dataclasses
import math

from infinity.config import InfinityConfig
from infinity.estimate.model import ModelSpec
from infinity.estimate.runtime_plan import (
    OPTIMIZER_POOL_BUFFERS,
    STATE_NBYTES_PER_ELEMENT,
    plan_runtime,
)
from infinity.memory import round_up

SUB_GROUP_TARGET = (1 << 30) // (OPTIMIZER_POOL_BUFFERS * STATE_NBYTES_PER_ELEMENT)
"""Elements per optimizer sub-group that make a 1 GiB optimizer pool."""

_ROUND = 1 << 20


def tune(
    spec: ModelSpec, cfg: InfinityConfig, world_size: int
) -> tuple[InfinityConfig, list[tuple[str, int, int]]]:
    """``cfg`` with its NVMe sizing keys set by the rules above, and the (key, old, new) changes."""
    zero = cfg.zero_optimization
    off = zero.offload_param
    base = plan_runtime(spec.module, cfg, world_size=world_size)
    units = base.units
    changes: list[tuple[str, int, int]] = []
    sub = int(zero.sub_group_size)
    largest = max((u.layout.shard_numel for u in units), default=0)
    total = sum(u.layout.shard_numel for u in units)
    if zero.offload_optimizer.device == "nvme" or off.device == "nvme":
        target = max(largest, round_up(min(SUB_GROUP_TARGET, -(-total // 16)), _ROUND))
        if 0 < target < sub:  # 0: a model without parameters, nothing to size
            changes.append(("zero_optimization.sub_group_size", sub, target))
            sub = target
    new_off = off
    live = zero.stage3_max_live_parameters
    sched = base.schedule  # None below stage 3
    if sched is not None and sched.budget.max_live_nbytes < sched.working_set_nbytes:
        new_live = round_up(-(-sched.working_set_nbytes // base.itemsize) * world_size, _ROUND)
        changes.append(("zero_optimization.stage3_max_live_parameters", live, new_live))
        live = new_live
    if off.device == "nvme" and zero.stage == 3:
        if off.max_in_cpu:
            changes.append(("zero_optimization.offload_param.max_in_cpu", off.max_in_cpu, 0))
        new_off = dataclasses.replace(off, max_in_cpu=0)
        planned = plan_runtime(
            spec.module,
            _with(cfg, sub, new_off, live),
            world_size=world_size,
            unit_map=base.unit_map,
        )
        if planned.nvme_units():
            assert planned.schedule is not None  # stage 3
            held = round_up(planned.schedule.pool_working_set_nbytes, 4096)
            per_group = planned.sub_group_param_nbytes()
            need = max(two_consecutive(per_group), max(per_group, default=0) + held)
            size = round_up(math.ceil(need / off.buffer_count / base.itemsize), _ROUND)
            if size != off.buffer_size:
                changes.append(
                    ("zero_optimization.offload_param.buffer_size", off.buffer_size, size)
                )
                new_off = dataclasses.replace(new_off, buffer_size=size)
    if not changes:
        return cfg, []
    return _with(cfg, sub, new_off, live), changes


def _with(cfg: InfinityConfig, sub_group_size: int, offload_param, max_live: int) -> InfinityConfig:
    zero = dataclasses.replace(
        cfg.zero_optimization,
        sub_group_size=sub_group_size,
        offload_param=offload_param,
        stage3_max_live_parameters=max_live,
    )
    return dataclasses.replace(cfg, zero_optimization=zero)


def two_consecutive(per_group: list[int]) -> int:
    """The most parameter-pool bytes two consecutive sub-groups take (one read while the other is updated)."""
    return max(
        [a + b for a, b in zip(per_group, per_group[1:], strict=False)] + per_group, default=0
    )
