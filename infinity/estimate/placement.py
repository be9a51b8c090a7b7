"""The placement planner: which training state lives in host memory and which on NVMe, within a budget.

Where ``offload_param.device`` or ``offload_optimizer.device`` is ``"auto"``,
``place_in_budget`` decides, per unit, where each state class of that section
rests — the parameter shard (stage 3: 16-bit, or fp32 as its own master) and
the optimizer's fp32 master, m, v and g — so that the NVMe bytes moved per
step are the fewest the host-memory budget allows. Its output is a RuntimePlan
(runtime_plan.py, [Note: placement]), which the engine allocates as it is.

[Note: the placement planner]
1. Budget (budget.py): ``host_memory_budget`` (bytes, or a fraction of the available host
   memory), else the available memory less SAFETY_MARGIN (at least
   MIN_MARGIN_NBYTES); per rank when several share a node. It bounds what the
   run needs beyond what the process holds at initialize — what the pre-flight
   check counts: state kept in host memory, pools, activations, overheads.
2. Sizes: keys of an "auto" section the config leaves unset are derived from
   the model (``auto_sizes``): the step's sub-groups, a parameter pool for the
   NVMe working set plus read-ahead, a live budget for the working set.
3. Cost: what each array moves per step if it rests on NVMe (traffic.py
   [Note: traffic model]); kept in host memory it costs its bytes of budget.
   A pool exists while anything of its class rests on NVMe and is then sized
   for all of it (runtime_plan.py), so what a placement needs in host memory
   is a fixed part (pools, activations, overheads) plus the bytes it keeps.
   The planner solves four cases — both pools, no parameter pool (every
   parameter shard kept), no optimizer pool (every optimizer array kept),
   neither — each an exact 0/1 knapsack (knapsack.py) over the arrays not
   forced, within the budget less that case's fixed part, and takes the case
   with the least traffic. Every need is the same itemisation the pre-flight
   check uses (context.py), so the choice is optimal for the budget as the
   pre-flight counts it (tests/estimate/test_placement.py enumerates).
4. Ties (equal traffic) keep, in this order: parameter shards, master, m, v,
   then g — a spilled g is written during the backward, overlapping its
   compute, where the others move during the step — and lower unit indices
   first (the next forward needs them first).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from infinity.config import InfinityConfig
from infinity.estimate.context import RunContext
from infinity.estimate.knapsack import Candidate, choose
from infinity.estimate.runtime_plan import (
    FP32_NBYTES,
    PARAM,
    Placement,
    PlacementChoice,
    RuntimePlan,
    cut_units,
    plan_runtime,
)
from infinity.estimate.traffic import (
    expected_traffic,
    frozen_param_cost,
    passes,
    spill_cost,
    worst_case_traffic,
)
from infinity.estimate.tune import two_consecutive
from infinity.memory import format_nbytes, round_up
from infinity.zero.units import UnitMap

CLASS_ORDER = (PARAM, "master", "m", "v", "g")
"""Which class is kept first when the traffic ties (point 4 of the note)."""

SUB_GROUP_NUMEL = 1 << 22
"""Elements per optimizer sub-group under "auto" (reads of 16 MiB per array), unless a sixteenth of the
state is less (the pool then costs 3/16 of what it streams); never below the largest shard."""
READ_AHEAD_BUFFERS = 1
"""Largest units the auto-sized parameter pool holds beyond what the step and the forward need at once:
room to read ahead."""
_ROUND = 1 << 20

SUB_GROUP_KEY = "zero_optimization.sub_group_size"
BUFFER_COUNT_KEY = "zero_optimization.offload_param.buffer_count"
BUFFER_SIZE_KEY = "zero_optimization.offload_param.buffer_size"
MAX_LIVE_KEY = "zero_optimization.stage3_max_live_parameters"


def is_auto(cfg: InfinityConfig) -> bool:
    """Whether a section's device is "auto" (the planner decides)."""
    zero = cfg.zero_optimization
    return "auto" in (zero.offload_param.device, zero.offload_optimizer.device)


def auto_sizes(
    model: nn.Module, cfg: InfinityConfig, unit_map: UnitMap, world_size: int
) -> tuple[InfinityConfig, tuple[tuple[str, int, int], ...]]:
    """``cfg`` with the sizing keys of its "auto" sections that the config leaves unset derived from the
    model, and the (key, old, new) changes. Under "auto" anything may rest on NVMe, so they are sized
    for the all-NVMe plan, the most the pools must hold:

    - sub_group_size: SUB_GROUP_NUMEL or a sixteenth of the shards, whichever is less, but no less than
      the largest shard;
    - offload_param.buffer_size: the largest shard; buffer_count: enough of them for two consecutive
      sub-groups of shards, or one and the partitioner's working set on NVMe (the overlapped step and
      the next forward hold those at once), plus READ_AHEAD_BUFFERS;
    - stage3_max_live_parameters: raised to the partitioner's working set where it is below.
    """
    zero = cfg.zero_optimization
    user = cfg.user_keys
    changes: list[tuple[str, int, int]] = []
    units = unit_map.units
    largest = max((u.layout.shard_numel for u in units), default=0)
    if SUB_GROUP_KEY not in user:
        total = sum(u.layout.shard_numel for u in units)
        sub = max(largest, min(SUB_GROUP_NUMEL, -(-total // 16)))
        if sub != zero.sub_group_size:
            changes.append((SUB_GROUP_KEY, zero.sub_group_size, sub))
            zero = dataclasses.replace(zero, sub_group_size=sub)
    cfg = dataclasses.replace(cfg, zero_optimization=zero)
    if zero.stage != 3 or zero.offload_param.device != "auto":
        return cfg, tuple(changes)
    base = plan_runtime(model, cfg, world_size=world_size, unit_map=unit_map)
    sched = base.schedule
    assert sched is not None  # stage 3
    if sched.budget.max_live_nbytes < sched.working_set_nbytes and MAX_LIVE_KEY not in user:
        live = round_up(-(-sched.working_set_nbytes // base.itemsize) * world_size, _ROUND)
        changes.append((MAX_LIVE_KEY, zero.stage3_max_live_parameters, live))
        zero = dataclasses.replace(zero, stage3_max_live_parameters=live)
    off = zero.offload_param
    nvme = base.nvme_units()
    if nvme and BUFFER_SIZE_KEY not in user and BUFFER_COUNT_KEY not in user:
        size = max(u.layout.shard_numel for u in nvme)
        per_group = base.sub_group_param_nbytes()
        held = round_up(sched.pool_working_set_nbytes, 4096)
        need = max(two_consecutive(per_group), max(per_group, default=0) + held)
        count = math.ceil(need / (size * base.itemsize)) + READ_AHEAD_BUFFERS
        for key, old, new in (
            (BUFFER_SIZE_KEY, off.buffer_size, size),
            (BUFFER_COUNT_KEY, off.buffer_count, count),
        ):
            if old != new:
                changes.append((key, old, new))
        zero = dataclasses.replace(
            zero, offload_param=dataclasses.replace(off, buffer_size=size, buffer_count=count)
        )
    return dataclasses.replace(cfg, zero_optimization=zero), tuple(changes)


@dataclasses.dataclass(frozen=True)
class _Choice:
    index: int
    cls: str
    candidate: Candidate


def candidates(plan: RuntimePlan, cfg: InfinityConfig, blocks: int | None = None) -> list[_Choice]:
    """Every array of an "auto" section that may rest in host memory or on NVMe, with what it costs
    there (its bytes) and saves (its traffic per step on NVMe; ``blocks``: trained by
    engine.train_batch in that many blocks, traffic.py)."""
    zero = cfg.zero_optimization
    gas = passes(plan, blocks)
    own_master = plan.optimizer is not None and "master" not in plan.optimizer.state_keys
    trainable = {u.index for u in plan.trainable_units()}
    out = []
    for sp, unit in zip(plan.shards, plan.units, strict=True):
        arrays: list[tuple[str, int]] = []
        if zero.stage == 3 and zero.offload_param.device == "auto" and not unit.persistent:
            arrays.append((PARAM, unit.layout.shard_nbytes))
        if zero.offload_optimizer.device == "auto":
            arrays += [(k, FP32_NBYTES * sp.numel) for k, _ in sp.state_homes]
        for cls, nbytes in arrays:
            if cls == PARAM and unit.index not in trainable:
                saved = frozen_param_cost(nbytes, gas=gas).nbytes
            else:
                saved = spill_cost(cls, nbytes, gas=gas, own_master=own_master).nbytes
            out.append(
                _Choice(
                    unit.index, cls, Candidate(nbytes, saved, (CLASS_ORDER.index(cls), unit.index))
                )
            )
    return out


def place_in_budget(
    model: nn.Module,
    cfg: InfinityConfig,
    ctx: RunContext,
    *,
    budget_nbytes: int,
    budget_source: str,
    rank: int = 0,
    device: torch.device | str = "meta",
    unit_map: UnitMap | None = None,
) -> RuntimePlan:
    """The plan of ``model`` under ``cfg`` with its "auto" sections placed within ``budget_nbytes``
    (see [Note: the placement planner]); ``ctx`` itemises what a plan needs in host memory."""
    device = torch.device(device)
    if unit_map is None:
        unit_map = cut_units(model, cfg, world_size=ctx.world_size, device=device)
    sized, changes = auto_sizes(model, cfg, unit_map, ctx.world_size)

    def make(homes: dict) -> tuple[RuntimePlan, int]:
        p = plan_runtime(
            model,
            sized,
            world_size=ctx.world_size,
            rank=rank,
            device=device,
            unit_map=unit_map,
            placement=Placement(homes),
        )
        return p, ctx.host_need(ctx.itemise(sized, p))

    base, _ = make({})
    blocks = ctx.blocks(sized.gradient_accumulation_steps)
    choices = candidates(base, sized, blocks)
    solved = []  # (fits, traffic, need, plan) of each pool case's best
    for forced in _pool_cases(choices):
        homes = {(c.index, c.cls): "cpu" for c in forced}
        plan, need = make(homes)
        free = [c for c in choices if c not in forced]
        kept = choose([c.candidate for c in free], budget_nbytes - need)
        if kept:
            homes.update({(free[i].index, free[i].cls): "cpu" for i in kept})
            plan, need = make(homes)
        solved.append(
            (need <= budget_nbytes, worst_case_traffic(plan, blocks=blocks).nbytes, need, plan)
        )
    fitting = [x for x in solved if x[0]]
    # The least traffic that fits; if nothing does, the least memory (the refusal then says how much).
    _, _, need, plan = (
        min(fitting, key=lambda x: x[1:3]) if fitting else min(solved, key=lambda x: x[2])
    )
    return dataclasses.replace(
        plan, chosen=PlacementChoice(budget_nbytes, budget_source, need, changes)
    )


def _pool_cases(choices: list[_Choice]) -> list[list[_Choice]]:
    """The arrays forced into host memory in each case the planner solves: none (both pools present),
    every parameter shard (no parameter pool), every optimizer array (no optimizer pool), both."""
    params = [c for c in choices if c.cls == PARAM]
    state = [c for c in choices if c.cls != PARAM]
    cases: list[list[_Choice]] = [[]]
    if params:
        cases.append(params)
    if state:
        cases.append(state)
    if params and state:
        cases.append(params + state)
    return cases


def _param_format(plan: RuntimePlan) -> str:
    """How parameter shards rest: their dtype, with the quantised format of those that are packed."""
    dtype = str(plan.dtype).removeprefix("torch.")
    fmt = next((f for f in plan.formats or () if f is not None), None)
    return dtype if fmt is None else f"{fmt.spec.name.lower()} / {dtype}"


def describe_placement(plan: RuntimePlan, *, blocks: int | None = None) -> list[str]:
    """A few lines on where the plan puts each state class and what it moves per step (``blocks``:
    trained by engine.train_batch in that many blocks; by default the plan's own layer-major block,
    else the micro-batch loop)."""
    if blocks is None and plan.layer_major_block is not None:
        blocks = -(-plan.gradient_accumulation_steps // plan.layer_major_block)
    lines = []
    numel = sum(u.layout.numel for u in plan.units)
    if plan.chosen is not None:
        c = plan.chosen
        lines.append(
            f"placement planner: budget {format_nbytes(c.budget_nbytes)} ({c.budget_source}); the plan "
            f"needs {format_nbytes(c.need_nbytes)} of host memory"
        )
        if c.changes:
            lines.append(
                "  sizes chosen: "
                + ", ".join(
                    f"{k.removeprefix('zero_optimization.')}={new:,}" for k, _, new in c.changes
                )
            )
    names = {
        PARAM: f"parameters ({_param_format(plan)})",
        "master": "fp32 master",
        "m": "Adam m",
        "v": "Adam v",
        "g": "gradients (fp32)",
    }
    classes = ([PARAM] if plan.stage == 3 else []) + list(
        plan.optimizer.state_keys if plan.optimizer else ()
    )
    for cls in classes:
        host, nvme = plan.state_nbytes(cls, "cpu"), plan.state_nbytes(cls, "nvme")
        units = _unit_ranges(plan, cls)
        lines.append(
            f"  {names[cls]:20s} host {format_nbytes(host):>10s}, NVMe {format_nbytes(nvme):>10s}"
            + (
                f" (on NVMe: {'' if 'units' in units else 'units '}{units})"
                if units and host and nvme
                else ""
            )
        )
    worst = worst_case_traffic(plan, blocks=blocks)
    expected = expected_traffic(plan, blocks=blocks)
    per = max(1, numel)
    lines.append(
        f"  NVMe per step: read {format_nbytes(expected.read_nbytes)}, write {format_nbytes(expected.write_nbytes)} "
        f"({expected.read_nbytes / per:.1f} / {expected.write_nbytes / per:.1f} B per parameter; with no cache "
        f"hits {format_nbytes(worst.read_nbytes)} / {format_nbytes(worst.write_nbytes)})"
    )
    return lines


def _unit_ranges(plan: RuntimePlan, cls: str, most: int = 6) -> str:
    """The unit indices whose ``cls`` rests on NVMe, as ranges ("0-3, 7"); past ``most`` ranges, a count."""
    idx = [
        sp.index
        for sp in plan.shards
        if (sp.param_home if cls == PARAM else dict(sp.state_homes).get(cls)) == "nvme"
    ]
    out, start = [], None
    for i, j in enumerate(idx):
        if start is None:
            start = j
        if i + 1 == len(idx) or idx[i + 1] != j + 1:
            out.append(f"{start}" if start == j else f"{start}-{j}")
            start = None
    if len(out) > most:
        return f"{len(idx)} of {len(plan.shards)} units"
    return ", ".join(out)
