"""A MemoryEstimate as a table for people and as a dict (JSON) for scripts."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from infinity.estimate.machine import describe_machine
from infinity.estimate.placement import describe as describe_placement
from infinity.estimate.traffic import expected_traffic
from infinity.memory import format_nbytes

if TYPE_CHECKING:
    from infinity.estimate.estimate import MemoryEstimate, SettingEstimate
    from infinity.estimate.plan import SettingPlan


def _fits(e: SettingEstimate) -> str:
    if e.fit is None:
        return "-"
    if e.fit.ok:
        return "yes"
    short = [n for n, ok in (("host", e.fit.host_ok), ("device", e.fit.device_ok), ("nvme", e.fit.nvme_ok)) if not ok]
    if e.plan.problems:
        short.append("config")
    return "no: " + ", ".join(short)


def _grid(rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        out.append("  ".join(cells).rstrip())
    return out


def items_table(plan: SettingPlan) -> list[str]:
    rows = [["item", "tier", "when", "bytes", "what"]]
    for i in plan.items:
        if i.nbytes == 0 and i.counted:
            continue
        tier = "device (cpu)" if i.tier == "device" and plan.device_type == "cpu" else i.tier
        size = format_nbytes(i.nbytes) if i.counted else f"({format_nbytes(i.nbytes)})"
        rows.append([i.name, tier, i.phase, size, i.detail])
    return _grid(rows, {3}) + nvme_by_path_lines(plan)


def nvme_by_path_lines(plan: SettingPlan) -> list[str]:
    """With several nvme_path folders, the NVMe bytes each holds (a rank stripes its swap space over them)."""
    if len(plan.nvme_by_path) < 2:
        return []
    return ["NVMe by folder (striped): "
            + ", ".join(f"{path} {format_nbytes(n)}" for path, n in plan.nvme_by_path)]


def render(est: MemoryEstimate, *, items: bool = True) -> str:
    cpu = est.device_type == "cpu"
    world = f"{est.nodes} node(s) × {est.ranks_per_node} rank(s) (world size {est.world_size})"
    lines = [
        f"model      {est.model}: {est.num_params:,} parameters, trained in {est.dtype}",
        f"ranks      {world}; compute device {'cpu (shares host memory)' if cpu else 'cuda'}",
        f"baseline   {format_nbytes(est.baseline_nbytes)} per process ({est.baseline_source})",
    ]
    if est.activations is not None:
        a = est.activations
        lines.append(
            f"activations micro-batch {a.micro_batch} × seq {a.seq}: {format_nbytes(a.peak(checkpointing=False))} "
            f"without checkpointing, {format_nbytes(a.peak(checkpointing=True))} with"
            f" ({'checkpointing assumed' if est.checkpointing else 'no checkpointing assumed'}; {a.source})"
        )
    lines.append("")
    head = ["setting", "sizes changed"] + (["RAM"] if cpu else ["GPU", "host"]) + ["NVMe", "fits"]
    rows = [head]
    for e in est.settings:
        p = e.plan
        mark = " *" if est.selected == e.setting else ""
        mem = [format_nbytes(p.ram_nbytes)] if cpu else [format_nbytes(p.device_nbytes), format_nbytes(p.host_nbytes)]
        changed = ", ".join(f"{k.rsplit('.', 1)[-1]}={new:,}" for k, _old, new in p.changes) or "-"
        rows.append([e.setting.label() + mark, changed] + mem
                    + [format_nbytes(p.nvme_nbytes) if p.nvme_nbytes else "-", _fits(e)])
    lines += _grid(rows, set(range(2, len(head) - 1)))
    lines.append(
        "per rank, fastest first" + (" (* = the config's own)" if est.selected else "")
        + (f"; a node holds {est.ranks_per_node} ranks" if est.ranks_per_node > 1 else "")
    )
    for s, why in est.skipped:
        lines.append(f"not estimated: {s.label()}: {why}")
    if est.machine is not None:
        lines.append("")
        lines.append("this machine:")
        lines += ["  " + ln for ln in describe_machine(est.machine)]
        lines.append("")
        lines.append(est.recommendation)
    focus = est.focus
    if items and focus is not None:
        lines.append("")
        lines.append(f"{focus.setting.label()}, per rank:")
        lines += ["  " + ln for ln in items_table(focus.plan)]
        p = focus.plan
        lines.append(
            f"  peak: {'RAM ' + format_nbytes(p.ram_nbytes) if cpu else 'GPU ' + format_nbytes(p.device_nbytes) + ', host ' + format_nbytes(p.host_nbytes)}"
            f"{', NVMe ' + format_nbytes(p.nvme_nbytes) if p.nvme_nbytes else ''}"
            " (init: as built + stores; train: stores + training; bracketed sizes are budgets inside other items)"
        )
        if focus.fit is not None and not focus.fit.ok:
            lines += ["  does not fit: " + r for r in focus.fit.reasons]
        if p.runtime is not None and (p.setting.offload_param, p.setting.offload_optimizer) != ("none", "none"):
            lines.append("")
            lines.append("where the training state rests, and what it moves per step:")
            lines += ["  " + ln for ln in describe_placement(p.runtime)]
    return "\n".join(lines)


def _plan_dict(p: SettingPlan) -> dict[str, Any]:
    return {
        "stage": p.setting.stage,
        "offload_param": p.setting.offload_param,
        "offload_optimizer": p.setting.offload_optimizer,
        "device_nbytes": p.device_nbytes,
        "host_nbytes": p.host_nbytes,
        "ram_nbytes": p.ram_nbytes,
        "nvme_nbytes": p.nvme_nbytes,
        "nvme_by_path": dict(p.nvme_by_path),
        "nvme_traffic_nbytes_per_step": p.nvme_traffic_nbytes,
        **_traffic_dict(p),
        "items": [dataclasses.asdict(i) for i in p.items],
        "problems": [dataclasses.asdict(x) for x in p.problems],
    }


def _traffic_dict(p: SettingPlan) -> dict[str, Any]:
    """The plan's expected NVMe bytes per step (traffic.py) and, for a planner's plan, its budget."""
    if p.runtime is None:
        return {}
    t = expected_traffic(p.runtime)
    out: dict[str, Any] = {"nvme_read_nbytes_per_step": t.read_nbytes, "nvme_write_nbytes_per_step": t.write_nbytes}
    c = p.runtime.chosen
    if c is not None:
        out["placement"] = {"budget_nbytes": c.budget_nbytes, "budget_source": c.budget_source,
                            "need_nbytes": c.need_nbytes, "changes": [list(x) for x in c.changes],
                            "homes": [{"unit": sp.index, "param": sp.param_home, **dict(sp.state_homes)}
                                      for sp in p.runtime.shards]}
    return out


def as_dict(est: MemoryEstimate) -> dict[str, Any]:
    settings = []
    for e in est.settings:
        d = _plan_dict(e.plan)
        d["fit"] = dataclasses.asdict(e.fit) if e.fit is not None else None
        settings.append(d)
    m = est.machine
    return {
        "model": est.model,
        "num_params": est.num_params,
        "dtype": est.dtype,
        "device_type": est.device_type,
        "nodes": est.nodes,
        "ranks_per_node": est.ranks_per_node,
        "world_size": est.world_size,
        "baseline_nbytes": est.baseline_nbytes,
        "baseline_source": est.baseline_source,
        "activations": dataclasses.asdict(est.activations) if est.activations else None,
        "activation_checkpointing": est.checkpointing,
        "selected": dataclasses.asdict(est.selected) if est.selected else None,
        "settings": settings,
        "skipped": [{"setting": dataclasses.asdict(s), "reason": r} for s, r in est.skipped],
        "machine": dataclasses.asdict(m) if m is not None else None,
        "recommended": dataclasses.asdict(est.recommended.setting) if est.recommended else None,
        "recommendation": est.recommendation,
    }
