"""plan_runtime_for_rank: the RuntimePlan infinity.initialize allocates on this rank.

plan_runtime's, or — with an offload section whose device is "auto" — the
placement planner's within the host-memory budget (placement.py), the
smallest of the ranks' budgets so that every rank places alike.
"""

from __future__ import annotations

import torch
from torch import nn

from infinity.config import InfinityConfig
from infinity.estimate.budget import check_budget, resolve_budget
from infinity.estimate.context import RunContext, run_context
from infinity.estimate.machine import MachineView, machine_view
from infinity.estimate.placement import is_auto, place_in_budget
from infinity.estimate.runtime_plan import RuntimePlan, plan_runtime
from infinity.zero.collectives import DataParallelGroup


def plan_runtime_for_rank(
    model: nn.Module,
    cfg: InfinityConfig,
    *,
    group: DataParallelGroup,
    device: torch.device,
    machine: MachineView | None = None,
) -> tuple[RuntimePlan, RunContext | None]:
    """initialize's plan for this rank: plan_runtime's, or with an "auto" section the placement planner's
    within the budget (the smallest of the ranks' budgets, so that every rank plans alike). Returns the
    run context it measured (None when it needed none), for the pre-flight check to reuse."""
    if not is_auto(cfg):
        return plan_runtime(
            model, cfg, world_size=group.world_size, rank=group.rank, device=device
        ), None
    ctx = run_context(model, cfg, device=device, world_size=group.world_size)
    nbytes, source = resolve_budget(cfg, machine or machine_view(), ctx.ranks_per_node)
    agreed = torch.tensor([-nbytes], dtype=torch.int64)
    group.all_reduce_max(agreed)
    if -int(agreed) != nbytes:
        nbytes, source = (
            -int(agreed),
            f"the smallest budget of the {group.world_size} ranks ({source} here)",
        )
    plan = place_in_budget(
        model, cfg, ctx, budget_nbytes=nbytes, budget_source=source, rank=group.rank, device=device
    )
    check_budget(plan, cfg)
    return plan, ctx
