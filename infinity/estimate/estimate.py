"""estimate_memory: per-rank device, host and NVMe bytes for every setting, checked against this machine.

Every setting (stage 0-3 × offload none/cpu/nvme for parameters and
optimizer, where valid) is derived from the user's config (their buffer
sizes, sub-group size, precision and thresholds kept; only the stage and the
offload devices changed) and itemised by plan.py. With a machine view, each
setting is marked as fitting or not, and the fastest that fits is
recommended. Fastest means (see ``speed_key``): fewest bytes moved to and
from NVMe per step, then parameters and optimizer state as close to the
compute as possible, then the lowest stage (least communication).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from infinity.config import ConfigError, InfinityConfig, load_config, read_config_file
from infinity.config.auto import HIDDEN_SIZE_KEYS
from infinity.config.zero import NvmePath
from infinity.estimate.activations import Activations
from infinity.estimate.context import RunContext
from infinity.estimate.machine import MachineView, machine_view, runtime_baseline_nbytes
from infinity.estimate.model import describe_model
from infinity.estimate.placement import is_auto, plan_placement, resolve_budget
from infinity.estimate.plan import Setting, SettingPlan, all_settings
from infinity.estimate.runtime_plan import train_dtype
from infinity.estimate.traced import Inputs, model_activations
from infinity.estimate.tune import tune
from infinity.memory import format_nbytes
from infinity.models import GPTConfig
from infinity.zero import init as zero_init_mod

DEFAULT_NVME_PATH = "./infinity_nvme"
"""Where settings that put state on NVMe swap when the config names no nvme_path (the demo's default)."""

_TIER_RANK = {"none": 0, "cpu": 1, "auto": 1, "nvme": 2}


@dataclasses.dataclass(frozen=True)
class Fit:
    """Whether a setting fits this machine, per resource, and why not."""

    ok: bool
    host_ok: bool
    device_ok: bool
    nvme_ok: bool
    reasons: tuple[str, ...]
    """One line per shortfall (or config problem), naming what is short and by how much."""


@dataclasses.dataclass(frozen=True)
class SettingEstimate:
    plan: SettingPlan
    fit: Fit | None

    @property
    def setting(self) -> Setting:
        return self.plan.setting


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
    selected: Setting | None
    """The config's own setting, when a config was given."""
    machine: MachineView | None
    recommended: SettingEstimate | None
    recommendation: str
    skipped: tuple[tuple[Setting, str], ...] = ()
    """Settings the config cannot be turned into, and why."""

    def setting(
        self, stage: int, offload_param: str = "none", offload_optimizer: str = "none", *, tuned: bool = False
    ) -> SettingEstimate:
        s = Setting(stage, offload_param, offload_optimizer, tuned)  # type: ignore[arg-type]
        for e in self.settings:
            if e.setting == s:
                return e
        raise KeyError(f"no estimate for {s.label()}")

    @property
    def focus(self) -> SettingEstimate | None:
        """The setting to itemise: the config's own, else the recommended one, else the fastest."""
        if self.selected is not None:
            return self.setting(self.selected.stage, self.selected.offload_param, self.selected.offload_optimizer)
        return self.recommended or (self.settings[0] if self.settings else None)

    def table(self, *, items: bool = True) -> str:
        from infinity.estimate.report import render

        return render(self, items=items)

    def to_dict(self) -> dict[str, Any]:
        from infinity.estimate.report import as_dict

        return as_dict(self)


def speed_key(plan: SettingPlan) -> tuple:
    """Fastest first: NVMe bytes per step, then how far parameters and optimizer state are
    from the compute (none < cpu < nvme), then the stage (communication grows with it)."""
    s = plan.setting
    return (plan.nvme_traffic_nbytes, _TIER_RANK[s.offload_param], _TIER_RANK[s.offload_optimizer], s.stage, s.tuned)


_NOT_MEMORY = ("optimizer", "scheduler")
"""Config sections that change no allocation (the optimizer is Adam-family whatever its
hyper-parameters): dropped before loading, so their "auto" values need no arguments here."""

_HIDDEN_SIZE_KEYS = {k.rsplit(".", 1)[1] for k in HIDDEN_SIZE_KEYS} | {
    "prefetch_bucket_size", "param_persistence_threshold"}


def _as_config(config: Any, world_size: int, precision: str | None, hidden_size: int | None) -> InfinityConfig:
    """The config every setting starts from: loaded as initialize loads it, less _NOT_MEMORY, with
    the ZeRO sizes written "auto" derived from the model's hidden size (as HF's integration does)."""
    if isinstance(config, InfinityConfig):
        cfg = config if config.world_size == world_size else load_config(config.to_dict(), world_size=world_size)
    else:
        raw = read_config_file(config) if isinstance(config, (str, os.PathLike)) else dict(config or {})
        raw = {k: v for k, v in raw.items() if k not in _NOT_MEMORY}
        zero = raw.get("zero_optimization")
        extra = {}
        if hidden_size and isinstance(zero, dict) and any(zero.get(k) == "auto" for k in _HIDDEN_SIZE_KEYS):
            extra["hidden_size"] = hidden_size
        cfg = load_config(raw, world_size=world_size, **extra)
    if config is None and precision is None:
        precision = "bf16"  # what people train large models in; stated in the report
    if precision is not None:
        if precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"precision must be fp32, bf16 or fp16; got {precision!r}")
        cfg = dataclasses.replace(
            cfg,
            bf16=dataclasses.replace(cfg.bf16, enabled=precision == "bf16"),
            fp16=dataclasses.replace(cfg.fp16, enabled=precision == "fp16"),
        )
    return cfg


def config_for(cfg: InfinityConfig, setting: Setting, nvme_path: NvmePath) -> InfinityConfig:
    """``cfg`` with its stage and offload devices set to ``setting`` (nvme_path filled where missing)."""
    zero = cfg.zero_optimization
    p, o = zero.offload_param, zero.offload_optimizer
    p_path = p.nvme_path or o.nvme_path or nvme_path
    o_path = o.nvme_path or p.nvme_path or nvme_path
    new_zero = dataclasses.replace(
        zero,
        stage=setting.stage,
        offload_param=dataclasses.replace(
            p, device=setting.offload_param, nvme_path=p_path if setting.offload_param == "nvme" else p.nvme_path
        ),
        offload_optimizer=dataclasses.replace(
            o, device=setting.offload_optimizer,
            nvme_path=o_path if setting.offload_optimizer == "nvme" else o.nvme_path,
        ),
    )
    return dataclasses.replace(cfg, zero_optimization=new_zero)


def check_fit(
    plan: SettingPlan,
    machine: MachineView,
    *,
    ranks_per_node: int,
    held_nbytes: int = 0,
    engine_checks: bool = False,
) -> Fit:
    """Does ``plan`` (per rank) × ``ranks_per_node`` fit ``machine``?

    ``held_nbytes``: host memory the run already holds (pre-flight runs inside the
    training process: its baseline and model are allocated, not to be found again).
    Pinned pools of 2 MiB or more may come from free hugetlb pages, which
    MemAvailable does not count. ``engine_checks``: leave out what initialize refuses
    by itself before allocating (Problem.engine_refuses; with one rank per node and no
    zero.Init files, the swap space — the engine's nvme_path.check_space sees exactly that).
    """
    reasons = []
    cpu = plan.device_type == "cpu"
    need, avail = _host_need(plan, machine, ranks_per_node, held_nbytes)
    host_ok = need <= avail
    if not host_ok:
        what = "host memory (device is the CPU: device + host)" if cpu else "host memory"
        reasons.append(
            f"{what}: needs {format_nbytes(need)}{' more' if held_nbytes else ''}"
            f"{f' for {ranks_per_node} ranks' if ranks_per_node > 1 else ''}, "
            f"{format_nbytes(avail)} available"
        )
    device_ok = True
    if not cpu:
        if not machine.gpus:
            device_ok = False
            reasons.append("device memory: the plan is for CUDA, but no GPU is visible")
        else:
            free = min(g.free_nbytes for g in machine.gpus[:ranks_per_node])
            if len(machine.gpus) < ranks_per_node:
                device_ok = False
                reasons.append(f"device: {ranks_per_node} ranks per node, {len(machine.gpus)} GPU(s) visible")
            if plan.device_nbytes > free:
                device_ok = False
                reasons.append(
                    f"device memory: needs {format_nbytes(plan.device_nbytes)} per GPU, {format_nbytes(free)} free"
                )
    nvme_ok = True
    by_fs: dict[int, tuple[int, int, list[str]]] = {}
    engine_sees_it = ranks_per_node == 1 and not any(i.name.startswith("zero.Init") for i in plan.items)
    for path, n in ([] if engine_checks and engine_sees_it else plan.nvme_by_path):
        d = machine.disk(path)
        if d is None:
            continue
        need_fs, free, paths = by_fs.get(d.device, (0, d.free_nbytes, []))
        by_fs[d.device] = (need_fs + n * ranks_per_node, free, paths + [path])
    for need_fs, free, paths in by_fs.values():
        if need_fs > free:
            nvme_ok = False
            reasons.append(f"NVMe space at {', '.join(paths)}: needs {format_nbytes(need_fs)}, {format_nbytes(free)} free")
    problems = [pr for pr in plan.problems if not (engine_checks and pr.engine_refuses)]
    for pr in problems:
        reasons.append(f"config: {pr.message}; {pr.fix}")
    ok = host_ok and device_ok and nvme_ok and not problems
    return Fit(ok, host_ok, device_ok, nvme_ok, tuple(reasons))


def _host_need(plan: SettingPlan, machine: MachineView, ranks_per_node: int, held_nbytes: int) -> tuple[int, int]:
    """(host memory the node's ranks still need, host memory available to them)."""
    per_rank_host = plan.ram_nbytes if plan.device_type == "cpu" else plan.host_nbytes
    huge = min(machine.hugetlb_free_nbytes, plan.pinned_pool_nbytes * ranks_per_node)
    return per_rank_host * ranks_per_node - held_nbytes, machine.mem_available_nbytes + huge


def host_shortfall_nbytes(plan: SettingPlan, machine: MachineView, *, ranks_per_node: int,
                          held_nbytes: int = 0) -> int:
    """How much more host memory ``plan`` needs than ``machine`` has (0 when it fits; see check_fit)."""
    need, avail = _host_need(plan, machine, ranks_per_node, held_nbytes)
    return max(0, need - avail)


def _recommendation(rec: SettingEstimate | None, ests: Sequence[SettingEstimate], ranks: int) -> str:
    if not ests or ests[0].fit is None:
        return ""
    if rec is None:
        least = min(ests, key=lambda e: e.plan.ram_nbytes if e.plan.device_type == "cpu" else e.plan.host_nbytes)
        return (
            "nothing fits this machine; the least host memory is "
            f"{format_nbytes(least.plan.ram_nbytes if least.plan.device_type == 'cpu' else least.plan.host_nbytes)}"
            f" per rank with {least.setting.words()} ({'; '.join(least.fit.reasons) if least.fit else ''})"
        )
    p = rec.plan
    parts = []
    if p.nvme_nbytes:
        paths = ", ".join(path if len(p.nvme_by_path) == 1 else f"{path}: {format_nbytes(n * ranks)}"
                          for path, n in p.nvme_by_path)
        parts.append(f"{format_nbytes(p.nvme_nbytes * ranks)} at nvme_path ({paths})")
    if p.device_type == "cpu":
        parts.append(f"{format_nbytes(p.ram_nbytes * ranks)} of RAM")
    else:
        parts.append(f"{format_nbytes(p.host_nbytes * ranks)} of host RAM")
        parts.append(f"{format_nbytes(p.device_nbytes)} per GPU")
    words = rec.setting.words()
    if rec.setting.offload_param == "nvme" and not any(i.name.startswith("parameter swap files") for i in p.items):
        words += " (offload_param.max_in_cpu keeps every parameter in host memory)"
    return f"fits with {words}; needs {', '.join(parts)} ({p.keys()})"


def _nvme_path(nvme_path: str | os.PathLike | Sequence[str | os.PathLike] | None) -> NvmePath:
    """estimate_memory's nvme_path= as a config value: one folder, or a list of them (one per drive)."""
    if nvme_path is None:
        return DEFAULT_NVME_PATH
    if isinstance(nvme_path, (str, os.PathLike)):
        return os.fspath(nvme_path)
    paths = tuple(os.fspath(p) for p in nvme_path)
    return paths[0] if len(paths) == 1 else paths


def _world(nodes: int, gpus_per_node: int | None, world_size: int | None) -> tuple[int, int]:
    """(world size, ranks per node) from whichever of the three were given, checked."""
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1; got {nodes}")
    if world_size is None:
        world_size = nodes * (gpus_per_node or 1)
    if gpus_per_node is None:
        if world_size % nodes:
            raise ValueError(f"world_size {world_size} is not a multiple of nodes {nodes}")
        gpus_per_node = world_size // nodes
    if world_size != nodes * gpus_per_node:
        raise ValueError(f"world_size {world_size} != nodes {nodes} × gpus_per_node {gpus_per_node}")
    return world_size, gpus_per_node


def _estimate_all(cfg, selected, wanted, nvme_path, plan, tune_cfg, machine, ranks_per_node):
    """Plans every wanted setting (the config's own as is), reads the machine, checks fits, and adds a
    tuned plan for each setting that does not fit as configured. Returns (estimates, view, skipped)."""
    configs, skipped = [], []
    for s in wanted:
        try:
            configs.append(cfg if s == selected else config_for(cfg, s, nvme_path))
        except ConfigError as e:
            skipped.append((s, str(e)))
    plans = [plan(c) for c in configs]
    if machine is True:
        view = machine_view(dict.fromkeys(path for p in plans for path, _ in p.nvme_by_path))
    else:
        view = machine or None

    def fit(p: SettingPlan) -> Fit | None:
        return check_fit(p, view, ranks_per_node=ranks_per_node) if view is not None else None

    ests = [SettingEstimate(p, fit(p)) for p in plans]
    for c, e in zip(configs, list(ests), strict=True):
        if e.fit is not None and e.fit.ok:
            continue
        tuned_cfg, changes = tune_cfg(c)
        if changes:
            p = plan(tuned_cfg, changes)
            ests.append(SettingEstimate(p, fit(p)))
    return ests, view, skipped


def estimate_memory(
    model_or_param_count: nn.Module | int | float | GPTConfig,
    *,
    config: Any = None,
    world_size: int | None = None,
    nodes: int = 1,
    gpus_per_node: int | None = None,
    micro_batch: int | None = None,
    seq: int | None = None,
    model_config: GPTConfig | None = None,
    precision: str | None = None,
    nvme_path: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
    device: str = "auto",
    activation_checkpointing: bool | None = None,
    inputs: Inputs | None = None,
    zero_init: bool | None = None,
    baseline_nbytes: int | None = None,
    machine: MachineView | bool = True,
    settings: Sequence[Setting] | None = None,
) -> MemoryEstimate:
    """Per-rank device, host and NVMe bytes of every setting, what fits here, and the fastest that fits.

    ``model_or_param_count``: an nn.Module (its own units are used; it is not
    modified), a GPTConfig, or a parameter count (a GPT-shaped stand-in of that
    size, shaped by ``model_config`` when given). ``config``: a DeepSpeed-style
    config (path, dict or InfinityConfig) whose keys (buffer sizes, sub_group_size,
    thresholds, precision) every setting keeps; without one, DeepSpeed's defaults
    and ``precision`` (default bf16). ``world_size`` = ``nodes × gpus_per_node``
    (give either). ``micro_batch`` / ``seq``: count activations (either given; seq defaults to the
    model's maximum context): a module's are counted in one forward of it on fake tensors (any
    architecture, infinity/estimate/traced.py; ``inputs(micro_batch, seq) -> (args, kwargs)`` for a
    model whose forward takes other than infinity GPT's or a transformers LM's inputs), a GPT stand-in's
    from measured coefficients. ``activation_checkpointing``: count them with every layer checkpointed
    (True) or none (False); None: as the module is set up (transformers' gradient checkpointing, torch
    or infinity.checkpointing calls), none for a stand-in.
    ``device``: "auto" (CUDA when available), "cpu" or "cuda". ``zero_init``: the
    model is built under infinity.zero.Init at stage 3 (default: detected for a
    module, assumed for a count). ``baseline_nbytes``: the process baseline
    (default: measured in this process, less the model). ``machine``: True to read
    this machine, a MachineView, or False for no fit check. ``settings``: only these.
    """
    world_size, gpus_per_node = _world(nodes, gpus_per_node, world_size)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda'; got {device!r}")
    spec = describe_model(model_or_param_count, model_config=model_config, seq=seq)
    cfg = _as_config(config, world_size, precision, spec.gpt.d_model if spec.gpt else None)
    if zero_init is None:  # a count is assumed built under zero.Init (the way to build a large model)
        is_module = isinstance(model_or_param_count, nn.Module)
        zero_init = not is_module or zero_init_mod.init_store_of(list(spec.module.parameters())) is not None
    if baseline_nbytes is None:
        baseline_nbytes = max(0, runtime_baseline_nbytes() - spec.built_nbytes)
        baseline_source = "measured in this process" + (", less the model" if spec.built_nbytes else "")
    else:
        baseline_source = "given"
    acts = None
    checkpointing = bool(activation_checkpointing)
    if micro_batch is not None or seq is not None:
        mb = micro_batch or cfg.train_micro_batch_size_per_gpu
        acts, detected = model_activations(spec, micro_batch=mb, seq=seq, dtype=train_dtype(cfg), inputs=inputs)
        if activation_checkpointing is None:
            checkpointing = detected
    own = cfg.zero_optimization
    selected = Setting(own.stage, own.offload_param.device, own.offload_optimizer.device) if config is not None else None

    ctx = RunContext(spec=spec, held_nbytes=baseline_nbytes + spec.built_nbytes, zero_init=zero_init,
                     activations=acts, device_type=device, world_size=world_size, ranks_per_node=gpus_per_node,
                     checkpointing=checkpointing)

    def plan(c: InfinityConfig, changes=()) -> SettingPlan:
        if is_auto(c):  # the placement planner's choice within the budget, on this machine
            view = machine if isinstance(machine, MachineView) else machine_view()
            budget, source = resolve_budget(c, view, gpus_per_node)
            runtime = plan_placement(spec.module, c, ctx, budget_nbytes=budget, budget_source=source)
            return ctx.itemise(c, runtime, changes)
        return ctx.itemise(c, None, changes)

    wanted = list(settings) if settings is not None else all_settings()
    if selected is not None and "auto" in (selected.offload_param, selected.offload_optimizer) \
            and selected not in wanted:
        wanted.append(selected)
    ests, view, skipped = _estimate_all(
        cfg, selected, wanted, _nvme_path(nvme_path),
        plan, lambda c: tune(spec, c, world_size), machine, gpus_per_node,
    )
    ests.sort(key=lambda e: speed_key(e.plan))
    rec = next((e for e in ests if e.fit is not None and e.fit.ok), None)
    return MemoryEstimate(
        model=spec.description,
        num_params=spec.num_params,
        dtype=str(train_dtype(cfg)).removeprefix("torch."),
        device_type=device,
        nodes=nodes,
        ranks_per_node=gpus_per_node,
        world_size=world_size,
        baseline_nbytes=baseline_nbytes,
        baseline_source=baseline_source,
        activations=acts,
        checkpointing=checkpointing,
        settings=tuple(ests),
        selected=selected,
        machine=view,
        recommended=rec,
        recommendation=_recommendation(rec, ests, gpus_per_node),
        skipped=tuple(skipped),
    )
