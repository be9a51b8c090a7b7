"""The report of an estimate: MemoryEstimate (what estimate_memory returns), as a table for people and a dict for scripts.

``items_table`` renders one Breakdown (the pre-flight refusal and the
inference estimate print it too).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from infinity.estimate.activations import Activations
from infinity.estimate.breakdown import Breakdown
from infinity.estimate.fit import Fit
from infinity.estimate.machine import MachineView, describe_machine
from infinity.estimate.placement import describe_placement
from infinity.estimate.setting import ZeroSetting
from infinity.estimate.traffic import expected_traffic
from infinity.memory import format_nbytes


@dataclasses.dataclass(frozen=True)
class SettingEstimate:
    breakdown: Breakdown
    fit: Fit | None

    @property
    def setting(self) -> ZeroSetting:
        return self.breakdown.setting


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """What ``estimate_memory`` returns; ``table()`` renders it, ``to_dict()`` serialises it."""

    model: str
    num_params: int
    dtype: str
    device_type: str
    nodes: int
    ranks_per_node: int
    world_size: int
    baseline_nbytes: int
    baseline_source: str
    activations: Activations | None
    checkpointing: bool
    settings: tuple[SettingEstimate, ...]
    """Fastest first (see speed_key)."""
    selected: ZeroSetting | None
    """The config's own setting, when a config was given."""
    machine: MachineView | None
    recommended: SettingEstimate | None
    recommendation: str
    skipped: tuple[tuple[ZeroSetting, str], ...] = ()
    """Settings the config cannot be turned into, and why."""

    def setting(
        self,
        stage: int,
        offload_param: str = "none",
        offload_optimizer: str = "none",
        *,
        tuned: bool = False,
    ) -> SettingEstimate:
        s = ZeroSetting(stage, offload_param, offload_optimizer, tuned)  # type: ignore[arg-type]
        for e in self.settings:
            if e.setting == s:
                return e
        raise KeyError(f"no estimate for {s.label()}")

    @property
    def focus(self) -> SettingEstimate | None:
        """The setting to itemise: the config's own, else the recommended one, else the fastest."""
        if self.selected is not None:
            return self.setting(
                self.selected.stage, self.selected.offload_param, self.selected.offload_optimizer
            )
        return self.recommended or (self.settings[0] if self.settings else None)

    def table(self, *, items: bool = True) -> str:
        return render(self, items=items)

    def to_dict(self) -> dict[str, Any]:
        return as_dict(self)


def _fits(e: SettingEstimate) -> str:
    if e.fit is None:
        return "-"
    if e.fit.ok:
        return "yes"
    short = [
        n
        for n, ok in (("host", e.fit.host_ok), ("device", e.fit.device_ok), ("nvme", e.fit.nvme_ok))
        if not ok
    ]
    if e.breakdown.problems:
        short.append("config")
    return "no: " + ", ".join(short)


def _grid(rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        out.append("  ".join(cells).rstrip())
    return out


def items_table(breakdown: Breakdown) -> list[str]:
    rows = [["item", "takes", "when", "bytes", "what"]]
    for i in breakdown.items:
        if i.nbytes == 0 and i.counted:
            continue
        resource = (
            "device (cpu)"
            if i.resource == "device" and breakdown.device_type == "cpu"
            else i.resource
        )
        size = format_nbytes(i.nbytes) if i.counted else f"({format_nbytes(i.nbytes)})"
        rows.append([i.name, resource, i.phase, size, i.detail])
    return _grid(rows, {3}) + nvme_by_path_lines(breakdown)


def nvme_by_path_lines(breakdown: Breakdown) -> list[str]:
    """With several nvme_path folders, the NVMe bytes each holds (a rank stripes its swap space over them)."""
    if len(breakdown.nvme_by_path) < 2:
        return []
    return [
        "NVMe by folder (striped): "
        + ", ".join(f"{path} {format_nbytes(n)}" for path, n in breakdown.nvme_by_path)
    ]


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
        p = e.breakdown
        mark = " *" if est.selected == e.setting else ""
        mem = (
            [format_nbytes(p.ram_nbytes)]
            if cpu
            else [format_nbytes(p.device_nbytes), format_nbytes(p.host_nbytes)]
        )
        changed = ", ".join(f"{k.rsplit('.', 1)[-1]}={new:,}" for k, _old, new in p.changes) or "-"
        rows.append(
            [e.setting.label() + mark, changed]
            + mem
            + [format_nbytes(p.nvme_nbytes) if p.nvme_nbytes else "-", _fits(e)]
        )
    lines += _grid(rows, set(range(2, len(head) - 1)))
    lines.append(
        "per rank, fastest first"
        + (" (* = the config's own)" if est.selected else "")
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
        lines += ["  " + ln for ln in items_table(focus.breakdown)]
        p = focus.breakdown
        lines.append(
            f"  peak: {'RAM ' + format_nbytes(p.ram_nbytes) if cpu else 'GPU ' + format_nbytes(p.device_nbytes) + ', host ' + format_nbytes(p.host_nbytes)}"
            f"{', NVMe ' + format_nbytes(p.nvme_nbytes) if p.nvme_nbytes else ''}"
            " (init: as built + stores; train: stores + training; bracketed sizes are budgets inside other items)"
        )
        if p.layer_major_block is not None and p.runtime is not None:
            lines.append(
                f"  engine.train_batch: {p.layer_major_block} of the "
                f"{p.runtime.gradient_accumulation_steps} micro-batches per layer-major block, "
                f"{p.layer_major_blocks()} block(s) per step (zero_optimization.layer_major.block)"
            )
        if focus.fit is not None and not focus.fit.ok:
            lines += ["  does not fit: " + r for r in focus.fit.reasons]
        if p.runtime is not None and (p.setting.offload_param, p.setting.offload_optimizer) != (
            "none",
            "none",
        ):
            lines.append("")
            lines.append("where the training state rests, and what it moves per step:")
            lines += [
                "  " + ln for ln in describe_placement(p.runtime, blocks=p.layer_major_blocks())
            ]
    return "\n".join(lines)


def _breakdown_dict(p: Breakdown) -> dict[str, Any]:
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
        "layer_major_block": p.layer_major_block,
        **_traffic_dict(p),
        "items": [dataclasses.asdict(i) for i in p.items],
        "problems": [dataclasses.asdict(x) for x in p.problems],
    }


def _traffic_dict(p: Breakdown) -> dict[str, Any]:
    """The expected NVMe bytes per step of the RuntimePlan behind ``p`` (traffic.py) and, where the
    placement planner chose its homes, its budget and choice."""
    if p.runtime is None:
        return {}
    t = expected_traffic(p.runtime, blocks=p.layer_major_blocks())
    out: dict[str, Any] = {
        "nvme_read_nbytes_per_step": t.read_nbytes,
        "nvme_write_nbytes_per_step": t.write_nbytes,
    }
    c = p.runtime.chosen
    if c is not None:
        out["placement"] = {
            "budget_nbytes": c.budget_nbytes,
            "budget_source": c.budget_source,
            "need_nbytes": c.need_nbytes,
            "changes": [list(x) for x in c.changes],
            "homes": [
                {"unit": sp.index, "param": sp.param_home, **dict(sp.state_homes)}
                for sp in p.runtime.shards
            ],
        }
    return out


def as_dict(est: MemoryEstimate) -> dict[str, Any]:
    settings = []
    for e in est.settings:
        d = _breakdown_dict(e.breakdown)
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
