"""estimate_memory: per-rank device, host and NVMe bytes for every setting, checked against this machine.

Every setting (stage 0-3 × offload none/cpu/nvme for parameters and
optimizer, where valid) is derived from the user's config (their buffer
sizes, sub-group size, precision and thresholds kept; only the stage and the
offload devices changed: setting.py) and itemised (itemise.py). With a
machine view, each setting is marked as fitting or not (fit.py), and the
fastest that fits is recommended. Fastest means (``Breakdown.speed_key``):
fewest bytes moved to and from NVMe per step, then parameters and optimizer
state as close to the compute as possible, then the lowest stage (least
communication).

What an estimate is asked is one typed, frozen ``EstimateOptions`` (its ranks
and its activations grouped); ``estimate_memory(model, config=..., seq=...)``
takes the same options as keywords, by the names docs/memory.md uses.
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
from infinity.estimate.blocks import BlockTrial, block_setting, choose_block
from infinity.estimate.breakdown import Breakdown
from infinity.estimate.budget import resolve_budget
from infinity.estimate.context import RunContext
from infinity.estimate.fit import Fit, check_fit
from infinity.estimate.machine import MachineView, machine_view, runtime_baseline_nbytes
from infinity.estimate.model import describe_model
from infinity.estimate.placement import is_auto, place_in_budget
from infinity.estimate.report import MemoryEstimate, SettingEstimate
from infinity.estimate.runtime_plan import train_dtype
from infinity.estimate.setting import DEFAULT_NVME_PATH, ZeroSetting, all_settings, config_for
from infinity.estimate.traced import Inputs, model_activations
from infinity.estimate.tune import tune
from infinity.memory import format_nbytes
from infinity.models import GPTConfig

NvmePathOption = str | os.PathLike | Sequence[str | os.PathLike] | None
"""One folder or several (one per drive, striped over); None: DEFAULT_NVME_PATH."""


@dataclasses.dataclass(frozen=True)
class Ranks:
    """How many ranks run and how they share machines: ``world_size`` = ``nodes`` × ``gpus_per_node``
    (give either; the third is derived)."""

    nodes: int = 1
    gpus_per_node: int | None = None
    world_size: int | None = None

    def resolve(self) -> tuple[int, int]:
        """(world size, ranks per node), checked."""
        nodes, gpus_per_node, world_size = self.nodes, self.gpus_per_node, self.world_size
        if nodes < 1:
            raise ValueError(f"nodes must be >= 1; got {nodes}")
        if world_size is None:
            world_size = nodes * (gpus_per_node or 1)
        if gpus_per_node is None:
            if world_size % nodes:
                raise ValueError(f"world_size {world_size} is not a multiple of nodes {nodes}")
            gpus_per_node = world_size // nodes
        if world_size != nodes * gpus_per_node:
            raise ValueError(
                f"world_size {world_size} != nodes {nodes} × gpus_per_node {gpus_per_node}"
            )
        return world_size, gpus_per_node


@dataclasses.dataclass(frozen=True)
class ActivationOptions:
    """Whether and how to count activations: given ``micro_batch`` or ``seq`` (seq defaults to the
    model's maximum context, micro_batch to the config's)."""

    micro_batch: int | None = None
    seq: int | None = None
    checkpointing: bool | None = None
    """Count them with every layer checkpointed (True) or none (False); None: as the module is set up
    (transformers' gradient checkpointing, torch or infinity.checkpointing calls), none for a stand-in."""
    inputs: Inputs | None = None
    """``(micro_batch, seq) -> (args, kwargs)`` for a model whose forward takes other than infinity GPT's
    or a transformers LM's inputs."""
    layer_major: bool = False
    """Training by ``engine.train_batch`` in blocks of micro-batches, each block's alive at once and
    each array moved once per block; the block as the config's zero_optimization.layer_major.block
    sets it, "auto" chosen for each setting as initialize would ([Note: layer-major blocks] in
    infinity/estimate/blocks.py; with no machine and no host_memory_budget, the whole window)."""

    @property
    def counted(self) -> bool:
        return self.micro_batch is not None or self.seq is not None


@dataclasses.dataclass(frozen=True)
class EstimateOptions:
    """What an estimate is asked (see estimate_memory for each option's meaning)."""

    config: Any = None
    """A DeepSpeed-style config (path, dict or InfinityConfig) whose keys every setting keeps."""
    ranks: Ranks = Ranks()
    activations: ActivationOptions = ActivationOptions()
    model_config: GPTConfig | None = None
    """The shape of a parameter count's GPT stand-in."""
    precision: str | None = None
    nvme_path: NvmePathOption = None
    device: str = "auto"
    zero_init: bool | None = None
    baseline_nbytes: int | None = None
    machine: MachineView | bool = True
    settings: tuple[ZeroSetting, ...] | None = None

    def __post_init__(self) -> None:
        if self.settings is not None:
            object.__setattr__(self, "settings", tuple(self.settings))

    @classmethod
    def from_keywords(cls, **keywords: Any) -> EstimateOptions:
        """The options from estimate_memory's keywords (the flat names of _KEYWORDS)."""
        unknown = sorted(set(keywords) - set(_KEYWORDS))
        if unknown:
            raise TypeError(
                f"estimate_memory got unknown keyword(s) {', '.join(unknown)}; it takes "
                f"{', '.join(_KEYWORDS)}"
            )
        groups: dict[str, dict[str, Any]] = {"": {}, "ranks": {}, "activations": {}}
        for name, value in keywords.items():
            group, field = _KEYWORDS[name]
            groups[group][field] = value
        return cls(
            ranks=Ranks(**groups["ranks"]),
            activations=ActivationOptions(**groups["activations"]),
            **groups[""],
        )


_KEYWORDS: dict[str, tuple[str, str]] = {
    "config": ("", "config"),
    "world_size": ("ranks", "world_size"),
    "nodes": ("ranks", "nodes"),
    "gpus_per_node": ("ranks", "gpus_per_node"),
    "micro_batch": ("activations", "micro_batch"),
    "seq": ("activations", "seq"),
    "activation_checkpointing": ("activations", "checkpointing"),
    "inputs": ("activations", "inputs"),
    "layer_major": ("activations", "layer_major"),
    "model_config": ("", "model_config"),
    "precision": ("", "precision"),
    "nvme_path": ("", "nvme_path"),
    "device": ("", "device"),
    "zero_init": ("", "zero_init"),
    "baseline_nbytes": ("", "baseline_nbytes"),
    "machine": ("", "machine"),
    "settings": ("", "settings"),
}
"""estimate_memory's keyword -> (group of EstimateOptions, field): its documented flat names."""


_NOT_MEMORY = ("optimizer", "scheduler")
"""Config sections that change no allocation (the optimizer is Adam-family whatever its
hyper-parameters): dropped before loading, so their "auto" values need no arguments here."""

_HIDDEN_SIZE_KEYS = {k.rsplit(".", 1)[1] for k in HIDDEN_SIZE_KEYS} | {
    "prefetch_bucket_size",
    "param_persistence_threshold",
}


def estimate_config(
    config: Any, world_size: int, precision: str | None, hidden_size: int | None
) -> InfinityConfig:
    """The config every setting of an estimate starts from (the inference estimate's too): loaded as initialize loads it, less _NOT_MEMORY, with
    the ZeRO sizes written "auto" derived from the model's hidden size (as HF's integration does)."""
    if isinstance(config, InfinityConfig):
        cfg = (
            config
            if config.world_size == world_size
            else load_config(config.to_dict(), world_size=world_size)
        )
    else:
        raw = (
            read_config_file(config)
            if isinstance(config, (str, os.PathLike))
            else dict(config or {})
        )
        raw = {k: v for k, v in raw.items() if k not in _NOT_MEMORY}
        zero = raw.get("zero_optimization")
        extra: dict[str, Any] = {}
        if (
            hidden_size
            and isinstance(zero, dict)
            and any(zero.get(k) == "auto" for k in _HIDDEN_SIZE_KEYS)
        ):
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


def _recommendation(
    rec: SettingEstimate | None, ests: Sequence[SettingEstimate], ranks: int
) -> str:
    if not ests or ests[0].fit is None:
        return ""
    if rec is None:
        least = min(
            ests,
            key=lambda e: (
                e.breakdown.ram_nbytes
                if e.breakdown.device_type == "cpu"
                else e.breakdown.host_nbytes
            ),
        )
        return (
            "nothing fits this machine; the least host memory is "
            f"{format_nbytes(least.breakdown.ram_nbytes if least.breakdown.device_type == 'cpu' else least.breakdown.host_nbytes)}"
            f" per rank with {least.setting.words()} ({'; '.join(least.fit.reasons) if least.fit else ''})"
        )
    p = rec.breakdown
    parts = []
    if p.nvme_nbytes:
        paths = ", ".join(
            path if len(p.nvme_by_path) == 1 else f"{path}: {format_nbytes(n * ranks)}"
            for path, n in p.nvme_by_path
        )
        parts.append(f"{format_nbytes(p.nvme_nbytes * ranks)} at nvme_path ({paths})")
    if p.device_type == "cpu":
        parts.append(f"{format_nbytes(p.ram_nbytes * ranks)} of RAM")
    else:
        parts.append(f"{format_nbytes(p.host_nbytes * ranks)} of host RAM")
        parts.append(f"{format_nbytes(p.device_nbytes)} per GPU")
    words = rec.setting.words()
    if rec.setting.offload_param == "nvme" and not any(
        i.name.startswith("parameter swap files") for i in p.items
    ):
        words += " (offload_param.max_in_cpu keeps every parameter in host memory)"
    return f"fits with {words}; needs {', '.join(parts)} ({p.keys()})"


def nvme_path_value(nvme_path: NvmePathOption) -> NvmePath:
    """An estimate's nvme_path option as a config value: one folder, or a list of them (one per drive)."""
    if nvme_path is None:
        return DEFAULT_NVME_PATH
    if isinstance(nvme_path, (str, os.PathLike)):
        return os.fspath(nvme_path)
    paths = tuple(os.fspath(p) for p in nvme_path)
    return paths[0] if len(paths) == 1 else paths


def _estimate_all(cfg, selected, wanted, nvme_path, itemise, tune_cfg, machine, ranks_per_node):
    """Itemises every wanted setting (the config's own as is), reads the machine, checks fits, and adds a
    tuned breakdown for each setting that does not fit as configured. Returns (estimates, view, skipped)."""
    configs, skipped = [], []
    for s in wanted:
        try:
            configs.append(cfg if s == selected else config_for(cfg, s, nvme_path))
        except ConfigError as refused:
            skipped.append((s, str(refused)))
    breakdowns = [itemise(c) for c in configs]
    view: MachineView | None
    if machine is True:
        view = machine_view(dict.fromkeys(path for b in breakdowns for path, _ in b.nvme_by_path))
    else:
        view = machine or None

    def fit(b: Breakdown) -> Fit | None:
        return check_fit(b, view, ranks_per_node=ranks_per_node) if view is not None else None

    ests = [SettingEstimate(b, fit(b)) for b in breakdowns]
    for c, e in zip(configs, list(ests), strict=True):
        if e.fit is not None and e.fit.ok:
            continue
        tuned_cfg, changes = tune_cfg(c)
        if changes:
            b = itemise(tuned_cfg, changes)
            ests.append(SettingEstimate(b, fit(b)))
    return ests, view, skipped


def estimate_memory(
    model_or_param_count: nn.Module | int | float | GPTConfig,
    options: EstimateOptions | None = None,
    /,
    **keywords: Any,
) -> MemoryEstimate:
    """Per-rank device, host and NVMe bytes of every setting, what fits here, and the fastest that fits.

    ``model_or_param_count``: an nn.Module (its own units are used; it is not
    modified), a GPTConfig, or a parameter count (a GPT-shaped stand-in of that
    size, shaped by ``model_config`` when given). The options: an EstimateOptions, or
    these keywords (not both):
    ``config``: a DeepSpeed-style
    config (path, dict or InfinityConfig) whose keys (buffer sizes, sub_group_size,
    thresholds, precision) every setting keeps; without one, DeepSpeed's defaults
    and ``precision`` (default bf16). ``world_size`` = ``nodes × gpus_per_node``
    (give either). ``micro_batch`` / ``seq``: count activations (either given; seq defaults to the
    model's maximum context): a module's are counted in one forward of it on fake tensors (any
    architecture, infinity/estimate/traced.py; ``inputs(micro_batch, seq) -> (args, kwargs)`` for a
    model whose forward takes other than infinity GPT's or a transformers LM's inputs), a GPT stand-in's
    from measured coefficients. ``activation_checkpointing``: count them with every layer checkpointed
    (True) or none (False); None: as the module is set up (transformers' gradient checkpointing, torch
    or infinity.checkpointing calls), none for a stand-in. ``layer_major``: training by
    ``engine.train_batch`` in blocks of micro-batches (the config's zero_optimization.layer_major.block,
    "auto" chosen per setting as initialize would): a block's micro-batches alive at once, each array
    on NVMe moved once per block.
    ``device``: "auto" (CUDA when available), "cpu" or "cuda". ``zero_init``: the
    model is built under infinity.zero.Init at stage 3 (default: detected for a
    module, assumed for a count). ``baseline_nbytes``: the process baseline
    (default: measured in this process, less the model). ``machine``: True to read
    this machine, a MachineView, or False for no fit check. ``settings``: only these.
    """
    if options is not None and keywords:
        raise TypeError("estimate_memory takes an EstimateOptions or keywords, not both")
    return _estimate(model_or_param_count, options or EstimateOptions.from_keywords(**keywords))


def _estimate(
    model_or_param_count: nn.Module | int | float | GPTConfig, opts: EstimateOptions
) -> MemoryEstimate:
    world_size, gpus_per_node = opts.ranks.resolve()
    device = opts.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda'; got {device!r}")
    act = opts.activations
    spec = describe_model(model_or_param_count, model_config=opts.model_config, seq=act.seq)
    cfg = estimate_config(
        opts.config, world_size, opts.precision, spec.gpt.d_model if spec.gpt else None
    )
    zero_init = opts.zero_init
    if (
        zero_init is None
    ):  # [Note: a model on the meta device]; a count is taken as built under zero.Init
        zero_init = spec.built_under_zero_init()
    if opts.baseline_nbytes is None:
        baseline_nbytes = max(0, runtime_baseline_nbytes() - spec.built_nbytes)
        baseline_source = "measured in this process" + (
            ", less the model" if spec.built_nbytes else ""
        )
    else:
        baseline_nbytes, baseline_source = opts.baseline_nbytes, "given"
    acts = None
    checkpointing = bool(act.checkpointing)
    if act.counted:
        mb = act.micro_batch or cfg.train_micro_batch_size_per_gpu
        acts, detected = model_activations(
            spec,
            micro_batch=mb,
            seq=act.seq,
            dtype=train_dtype(cfg),
            inputs=act.inputs,
            device_type=device,
        )
        if act.checkpointing is None:
            checkpointing = detected
    own = cfg.zero_optimization
    selected = (
        ZeroSetting(own.stage, own.offload_param.device, own.offload_optimizer.device)
        if opts.config is not None
        else None
    )

    ctx = RunContext(
        spec=spec,
        held_nbytes=baseline_nbytes + spec.built_nbytes,
        zero_init=zero_init,
        activations=acts,
        device_type=device,
        world_size=world_size,
        ranks_per_node=gpus_per_node,
        checkpointing=checkpointing,
    )
    machine = opts.machine

    def itemise_block(c: InfinityConfig, changes, block: int | None) -> tuple[Breakdown, bool]:
        """The breakdown with ``block`` micro-batches per layer-major block (None: the loop), and
        whether it fits the budget ("auto" sections) or the machine (fixed ones; no machine: yes)."""
        ctx_k = dataclasses.replace(ctx, block=block)
        if is_auto(c):  # the placement planner's choice within the budget, on this machine
            view = machine if isinstance(machine, MachineView) else machine_view()
            budget, source = resolve_budget(c, view, gpus_per_node)
            runtime = place_in_budget(
                spec.module, c, ctx_k, budget_nbytes=budget, budget_source=source
            )
            assert runtime.chosen is not None
            return ctx_k.itemise(c, runtime, changes), runtime.chosen.need_nbytes <= budget
        b = ctx_k.itemise(c, None, changes)
        seen = machine if isinstance(machine, MachineView) else machine_view() if machine else None
        limit = resolve_budget(c, seen, gpus_per_node)[0] if seen and c.host_budget else None
        fits = seen is None or (
            check_fit(
                b, seen, ranks_per_node=gpus_per_node, held_nbytes=ctx.held_nbytes * gpus_per_node
            ).host_ok
            and (limit is None or ctx.host_need(b) <= limit)
        )
        return b, fits

    def itemise(c: InfinityConfig, changes=()) -> Breakdown:
        if not act.layer_major:
            return itemise_block(c, changes, None)[0]
        made: dict[int, Breakdown] = {}

        def trial(k: int) -> BlockTrial:
            b, fits = itemise_block(c, changes, k)
            made[k] = b
            assert b.runtime is not None
            return BlockTrial(k, b.runtime, fits, ctx.host_need(b))

        chosen = choose_block(c.gradient_accumulation_steps, block_setting(c), trial)
        return made[chosen.block]

    wanted = list(opts.settings) if opts.settings is not None else all_settings()
    if (
        selected is not None
        and "auto" in (selected.offload_param, selected.offload_optimizer)
        and selected not in wanted
    ):
        wanted.append(selected)
    ests, view, skipped = _estimate_all(
        cfg,
        selected,
        wanted,
        nvme_path_value(opts.nvme_path),
        itemise,
        lambda c: tune(spec, c, world_size),
        machine,
        gpus_per_node,
    )
    ests.sort(key=lambda e: e.breakdown.speed_key())
    rec = next((e for e in ests if e.fit is not None and e.fit.ok), None)
    return MemoryEstimate(
        model=spec.description,
        num_params=spec.num_params,
        dtype=str(train_dtype(cfg)).removeprefix("torch."),
        device_type=device,
        nodes=opts.ranks.nodes,
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
