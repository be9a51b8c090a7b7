"""plan_runtime_for_rank: the RuntimePlan infinity.initialize allocates on this rank.

plan_runtime's, or — with an offload section whose device is "auto" — the
placement planner's within the host-memory budget (placement.py), the
smallest of the ranks' budgets so that every rank places alike. A config with
the zero_optimization.layer_major section is planned for engine.train_batch:
the block of micro-batches it runs layer-major is chosen with the plan
([Note: layer-major blocks] in blocks.py).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from infinity.config import InfinityConfig
from infinity.estimate.blocks import (
    BlockTrial,
    agree,
    block_setting,
    choose_block,
    planned_for_train_batch,
)
from infinity.estimate.budget import check_budget, resolve_budget
from infinity.estimate.context import RunContext, run_context
from infinity.estimate.fit import check_fit
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
    layer_major = planned_for_train_batch(cfg)
    if not is_auto(cfg) and not layer_major:
        return plan_runtime(
            model, cfg, world_size=group.world_size, rank=group.rank, device=device
        ), None
    ctx = run_context(model, cfg, device=device, world_size=group.world_size)
    view = machine or machine_view()
    trial = (
        _placed_trial(model, cfg, ctx, view, group, device)
        if is_auto(cfg)
        else _fixed_trial(model, cfg, ctx, view, group, device)
    )
    if not layer_major:
        plan = trial(None).plan
    else:
        gas = cfg.gradient_accumulation_steps
        chosen = choose_block(gas, block_setting(cfg), trial)
        block = agree(chosen.block, group)
        if block != chosen.block:
            chosen = trial(block)
        plan = dataclasses.replace(chosen.plan, layer_major_block=block)
        ctx = dataclasses.replace(ctx, block=block)
    check_budget(plan, cfg)
    return plan, ctx


def _placed_trial(model, cfg, ctx, view, group, device):
    """Trials with "auto" sections: the planner places the state within the budget for each block."""
    nbytes, source = resolve_budget(cfg, view, ctx.ranks_per_node)
    agreed = torch.tensor([-nbytes], dtype=torch.int64)
    group.all_reduce_max(agreed)
    if -int(agreed) != nbytes:
        nbytes, source = (
            -int(agreed),
            f"the smallest budget of the {group.world_size} ranks ({source} here)",
        )

    def trial(block: int | None) -> BlockTrial:
        plan = place_in_budget(
            model,
            cfg,
            dataclasses.replace(ctx, block=block),
            budget_nbytes=nbytes,
            budget_source=source,
            rank=group.rank,
            device=device,
        )
        assert plan.chosen is not None
        need = plan.chosen.need_nbytes
        return BlockTrial(block or 1, plan, need <= nbytes, need)

    return trial


def _fixed_trial(model, cfg, ctx, view, group, device):
    """Trials with fixed sections: one plan; a block fits when its itemisation fits the host memory
    (and host_memory_budget, when the config sets one)."""
    plan = plan_runtime(model, cfg, world_size=group.world_size, rank=group.rank, device=device)
    budget = resolve_budget(cfg, view, ctx.ranks_per_node)[0] if cfg.host_budget else None

    def trial(block: int | None) -> BlockTrial:
        c = dataclasses.replace(ctx, block=block)
        b = c.itemise(cfg, plan)
        fit = check_fit(
            b,
            view,
            ranks_per_node=c.ranks_per_node,
            held_nbytes=c.held_nbytes * c.ranks_per_node,
            engine_checks=True,
        )
        need = c.host_need(b)
        return BlockTrial(
            block or 1, plan, fit.host_ok and (budget is None or need <= budget), need
        )

    return trial
