"""preflight: the check infinity.initialize runs before it allocates anything.

It itemises the RuntimePlan the engine will allocate (initialize makes it
once, for this check and for the engine) exactly as ``estimate_memory``
itemises a setting, measures what the process already holds (its
baseline and the model as built are allocated: only what comes after must
still fit), reads the machine, and raises PreflightError — with the itemised Breakdown,
the shortfall and the fix, naming the key to change — when host memory,
device memory or NVMe space cannot hold the run, or when the config would
make the runtime refuse or stall (a parameter pool too small for the
optimizer step). ``"preflight": false`` (or ``initialize(..., preflight=False)``)
skips it, with a warning.

With several ranks, every rank checks (ranks on one node share its memory
and disks: the need is multiplied by LOCAL_WORLD_SIZE) and all refuse
together (a MAX all-reduce of the verdict), so none is left waiting in a
collective. Activations are counted for one micro-batch of the config at
``max_seq_length`` tokens, or else the model's longest context (at most
PREFLIGHT_MAX_SEQ tokens; the fix then names ``max_seq_length``), in one forward of
the model on fake tensors (infinity/estimate/traced.py), with the model's own
checkpointing; for a model whose inputs or context are not known they are not
included, and the message says so.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from infinity.config import ConfigError, InfinityConfig
from infinity.estimate import rules
from infinity.estimate.breakdown import Breakdown
from infinity.estimate.context import RunContext, run_context
from infinity.estimate.fit import check_fit, host_shortfall_nbytes
from infinity.estimate.machine import MachineView, machine_view
from infinity.estimate.placement import describe_placement
from infinity.estimate.report import items_table
from infinity.estimate.runtime_plan import RuntimePlan
from infinity.estimate.setting import DEFAULT_NVME_PATH, ZeroSetting, all_settings, config_for
from infinity.estimate.tune import tune
from infinity.memory import format_nbytes
from infinity.zero.collectives import DataParallelGroup

log = logging.getLogger("infinity.estimate")


class PreflightError(ConfigError):
    """The run cannot fit this machine (or its config would stall); nothing was allocated.
    A ConfigError (a ValueError): the fix is a config change, and callers catching those keep working."""

    def __init__(self, message: str, breakdown: Breakdown, reasons: tuple[str, ...]):
        super().__init__(message)
        self.breakdown = breakdown
        self.reasons = reasons


@dataclasses.dataclass(frozen=True)
class PreflightResult:
    breakdown: Breakdown
    held_nbytes: int
    """Host memory the process held when the check ran (baseline and the model as built)."""
    machine: MachineView


def preflight(
    model: nn.Module,
    cfg: InfinityConfig,
    *,
    device: torch.device | str = "cpu",
    group: DataParallelGroup | None = None,
    machine: MachineView | None = None,
    runtime: RuntimePlan | None = None,
    context: RunContext | None = None,
) -> PreflightResult | None:
    """Checks that ``model`` trained under ``cfg`` fits; raises PreflightError (table + fix) if not.

    Returns the Breakdown it checked, or None when ``cfg.preflight`` is false.
    ``machine`` replaces the machine read from the OS (tests). ``runtime``: the RuntimePlan the
    engine will allocate (initialize's), checked as it is; by default plan_runtime's. ``context``: the
    run's context when already measured (initialize's, which the placement planner read too).
    """
    if not cfg.preflight:
        warn_preflight_skipped()
        return None
    group = group or DataParallelGroup()
    ctx = context or run_context(model, cfg, device=device, world_size=group.world_size)
    if runtime is not None and runtime.layer_major_block is not None:
        # planned for engine.train_batch: a block's micro-batches ([Note: layer-major blocks])
        ctx = dataclasses.replace(ctx, block=runtime.layer_major_block)
    spec, held, ranks, acts = ctx.spec, ctx.held_nbytes, ctx.ranks_per_node, ctx.activations

    def itemise(c: InfinityConfig, changes=(), runtime: RuntimePlan | None = None) -> Breakdown:
        return ctx.itemise(c, runtime, changes)

    own = itemise(cfg, runtime=runtime)
    view = machine or machine_view(path for path, _ in own.nvme_by_path)
    fit = check_fit(own, view, ranks_per_node=ranks, held_nbytes=held * ranks, engine_checks=True)
    failed = torch.tensor([0 if fit.ok else 1], dtype=torch.int32)
    group.all_reduce_max(failed)
    if fit.ok and not int(failed):
        return PreflightResult(own, held, view)
    if fit.ok:
        raise PreflightError(
            f"infinity.initialize: another rank's pre-flight check failed (see its error); rank {group.rank} "
            "stops too, before allocating",
            own,
            (),
        )
    fixes = _seq_fixes(cfg, acts) + _fixes(
        spec, cfg, own, view, itemise, ranks, held, group.world_size
    )
    raise PreflightError(
        _refusal(own, fit.reasons, fixes, held, ranks, group.world_size, acts is not None),
        own,
        fit.reasons,
    )


def warn_preflight_skipped() -> None:
    """The warning every pre-flight check (training's, inference's) gives when ``preflight`` is false."""
    log.warning(
        "pre-flight check skipped (preflight: false): host memory, device memory and NVMe space are "
        "not checked against this run before it allocates"
    )


def _refusal(
    own: Breakdown, reasons, fixes: list[str], held: int, ranks: int, world: int, acts: bool
) -> str:
    lines = [
        f"infinity.initialize: this run does not fit (pre-flight check; nothing has been allocated). "
        f"{own.setting.label()}, {own.dtype}, world size {world}"
        + (f", {ranks} ranks on this node" if ranks > 1 else "")
        + ":",
    ]
    lines += ["  " + r for r in reasons]
    lines.append(
        f"It would allocate per rank (this process holds {format_nbytes(held)} already: its baseline and the model"
        + (
            ""
            if acts
            else "; activations not included: its inputs or context length are not known (infinity GPT "
            "and transformers LMs are traced; estimate_memory(model, inputs=...) for others)"
        )
        + "):"
    )
    lines += ["  " + ln for ln in items_table(own)]
    if own.runtime is not None and own.runtime.chosen is not None:
        lines.append("Where the placement planner put the state, and what that moves per step:")
        lines += ["  " + ln for ln in describe_placement(own.runtime)]
    lines.append(
        "Fix:"
        if fixes
        else "Fix: no setting of stage and offload fits this machine;"
        " use a machine with more memory or disk, or a smaller model"
    )
    lines += ["  - " + f for f in fixes]
    lines.append(
        '  - or skip this check with "preflight": false in the config (the run may then be killed '
        "by the OOM killer or fail when the disk fills)"
    )
    return "\n".join(lines)


def _fixes(spec, cfg, own, view, itemise, ranks, held, world_size) -> list[str]:
    """Config changes that make the run fit, best first: the config's own setting with its sizes
    tuned, then the fastest other setting (tuned if need be) that fits."""
    out: list[str] = []
    for pr in own.problems:
        if not pr.engine_refuses:
            out.append(pr.fix)
    out += _pool_fixes(
        own, host_shortfall_nbytes(own, view, ranks_per_node=ranks, held_nbytes=held * ranks), ranks
    )

    def fits(p: Breakdown) -> bool:
        return check_fit(
            p, view, ranks_per_node=ranks, held_nbytes=held * ranks, engine_checks=True
        ).ok

    def need(p: Breakdown) -> str:
        mem = (
            f"RAM {format_nbytes(p.ram_nbytes)}"
            if p.device_type == "cpu"
            else (f"host {format_nbytes(p.host_nbytes)}, GPU {format_nbytes(p.device_nbytes)}")
        )
        return mem + (f", NVMe {format_nbytes(p.nvme_nbytes)}" if p.nvme_nbytes else "")

    tuned_cfg, changes = tune(spec, cfg, world_size)
    if changes:
        p = itemise(tuned_cfg, changes)
        verdict = "fits" if fits(p) else "still does not fit"
        out.append(f"set {_changes(changes)}: {verdict} ({need(p)} per rank)")
        if verdict == "fits":
            return out
    path = next((path for path, _ in own.nvme_by_path), None) or DEFAULT_NVME_PATH
    candidates = []
    for s in all_settings():
        if s == ZeroSetting(
            own.setting.stage, own.setting.offload_param, own.setting.offload_optimizer
        ):
            continue
        try:
            c = config_for(cfg, s, path)
        except ConfigError:
            continue
        p = itemise(c)
        if not fits(p):
            c, ch = tune(spec, c, world_size)
            if not ch:
                continue
            p = itemise(c, ch)
            if not fits(p):
                continue
        candidates.append(p)
    if candidates:
        best = min(candidates, key=Breakdown.speed_key)
        out.append(
            f"{'or ' if out else ''}set {best.keys()}: fits ({need(best)} per rank; the fastest setting that does)"
        )
    return out


def _seq_fixes(cfg: InfinityConfig, acts) -> list[str]:
    """Activations were sized for the model's context, a guess: name the key that states the truth."""
    if acts is None or cfg.max_seq_length is not None:
        return []
    return [
        f"if no micro-batch is {acts.seq} tokens long (the model's context, which activations are "
        "sized for here), set max_seq_length to the longest sequence you train"
    ]


def _pool_fixes(own: Breakdown, short_nbytes: int, ranks: int) -> list[str]:
    """Host memory is short, and a pool bigger than the run needs could give it back alone: name the
    keys that size the pool (the parameter pool's are buffer_count and buffer_size)."""
    out: list[str] = []
    rt = own.runtime
    if short_nbytes <= 0 or rt is None:
        return out
    for label, store in (("parameter pool", rt.param_store), ("optimizer pool", rt.state_store)):
        pool = store.pool if store is not None else None
        if pool is None or not pool.keys:
            continue
        mapped = rules.mapped_nbytes(pool.capacity_nbytes, huge_pages=True)
        if (
            mapped - rules.mapped_nbytes(pool.need_nbytes, huge_pages=True)
        ) * ranks >= short_nbytes:
            out.append(
                f"the {label} is what does not fit: {pool.count} × {format_nbytes(pool.buffer_nbytes)} buffers "
                f"({format_nbytes(mapped)}) where it needs {format_nbytes(pool.need_nbytes)} at once; lower "
                + " or ".join(pool.keys)
            )
    return out


def _changes(changes) -> str:
    return ", ".join(f"{k} to {new:,} (now {old:,})" for k, old, new in changes)
