"""initialize(): from a model and a DeepSpeed-style config to a training engine.

``infinity.initialize`` (infinity.inference.initialize) is this, or the
inference engine when nothing makes an optimizer at stage 3; both start from
``start`` (process group, config, device).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from infinity.config import ConfigError, InfinityConfig, load_config
from infinity.engine.engine import Engine
from infinity.estimate import plan_runtime_for_rank, preflight
from infinity.zero.collectives import DataParallelGroup


def _bootstrap_distributed() -> DataParallelGroup:
    """Joins the process group torchrun describes (gloo on CPU, NCCL on GPU); world size 1 needs none."""
    if (
        dist.is_available()
        and not dist.is_initialized()
        and int(os.environ.get("WORLD_SIZE", "1")) > 1
    ):
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return DataParallelGroup()


def compute_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def initialize(
    model: nn.Module,
    config: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any = None,
    **auto_values: Any,
) -> Engine:
    """Builds the engine. ``config``: a path (hjson/JSON) or dict in DeepSpeed's schema.

    Keyword arguments fill the config's ``"auto"`` values as HF's trainer fills
    them from its TrainingArguments, under infinity's names (``lr=``,
    ``weight_decay=``, ``train_micro_batch_size_per_gpu=``, ``bf16=`` ...) or
    HF's (``learning_rate=``, ``max_grad_norm=``, ``warmup_steps=`` ...): a
    value the config writes must agree, an argument with nothing to fill is
    ignored, an unknown name is a TypeError ([Note: the argument table] in
    infinity/config/arguments.py). The ZeRO sizes written "auto" follow the
    model's hidden size (``model.config``, as HF reads it) unless
    ``hidden_size=`` is given. With no optimizer section and none passed,
    ``lr=`` gives the HF Trainer's default AdamW. A config with an ``activation_checkpointing``
    section gives the engine its own checkpoint settings ([Note: whose checkpoint settings]).
    """
    group, cfg, device = start(model, config, optimizer, **auto_values)
    return training_engine(
        model, cfg, optimizer=optimizer, lr_scheduler=lr_scheduler, group=group, device=device
    )


def start(
    model: nn.Module, config: Any, optimizer: torch.optim.Optimizer | None, **auto_values: Any
) -> tuple[DataParallelGroup, InfinityConfig, torch.device]:
    """What every engine starts from: the process group torchrun describes, the config loaded with its
    "auto" values filled, the compute device."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"initialize() needs an nn.Module, got {type(model).__name__}")
    if next(iter(model.parameters()), None) is None:
        raise ValueError(
            f"initialize() needs a model with parameters, and {type(model).__name__} has none (a pure "
            "function): there is nothing to train, offload or stream; call the module directly, without "
            "an engine"
        )
    group = _bootstrap_distributed()
    cfg = load_config(
        config, world_size=group.world_size, optimizer=optimizer, model=model, **auto_values
    )
    return group, cfg, compute_device()


QUANT_KEYS = (
    "weight_quantization.quantized_initialization",
    "zero_optimization.zero_quantized_nontrainable_weights",
)


def check_quantised_base(model: nn.Module, cfg: InfinityConfig) -> None:
    """[Note: a quantised frozen base] A training engine quantises only what does not train: with
    weight_quantization.quantized_initialization or zero_quantized_nontrainable_weights, the matrix
    parameters (2-D and up) with ``requires_grad=False`` when initialize runs rest quantised on NVMe
    and are dequantised after each read (infinity/weights/quant.py), with no gradient, master, optimizer
    state or write-back; trainable parameters rest in their dtype. Refused here, before anything is
    allocated, naming the parameter and the fix: a stage below 3 (no parameter store to quantise in); a
    trainable matrix under quantized_initialization alone (it asks to quantise every matrix, and a
    quantised weight cannot be updated); a frozen matrix whose rows (last dimension) do not divide into
    the groups (groups run along rows, DeepSpeed's group_dim 1)."""
    zero = cfg.zero_optimization
    quant = cfg.weight_quantization.quantized_initialization
    if quant is None and not zero.zero_quantized_nontrainable_weights:
        return
    asked = QUANT_KEYS[0] if quant is not None else QUANT_KEYS[1]
    if zero.stage != 3:
        raise ConfigError(
            f"{asked} quantises weights at rest in the stage-3 parameter store, and "
            f"zero_optimization.stage is {zero.stage}; set the stage to 3"
        )
    group = quant.group_size if quant is not None else 64
    matrices = [(n, p) for n, p in model.named_parameters() if p.dim() >= 2]
    if not zero.zero_quantized_nontrainable_weights:
        trained = [n for n, p in matrices if p.requires_grad]
        if trained:
            raise ConfigError(
                f"{asked} quantises every matrix parameter, and {trained[0]!r} trains "
                f"(requires_grad=True{f', as do {len(trained) - 1} more' if len(trained) > 1 else ''}); "
                "a quantised weight cannot be updated. Freeze it (requires_grad_(False), as "
                "peft.get_peft_model does for a LoRA base), or set "
                "zero_optimization.zero_quantized_nontrainable_weights to true to quantise only the "
                "frozen weights and train the others in their dtype"
            )
    frozen = [(n, p) for n, p in matrices if not p.requires_grad]
    ragged = [(n, p) for n, p in frozen if p.shape[-1] % group]
    if ragged:
        name, p = ragged[0]
        rows = math.gcd(*(q.shape[-1] for _, q in frozen))
        fits = [g for g in (256, 128, 64, 32, 16, 8, 4, 2) if rows % g == 0]
        fix = (
            f"set weight_quantization.quantized_initialization.group_size to {fits[0]}, which "
            "divides every frozen matrix's rows"
            if fits
            else "no group size of 2 or more divides every frozen matrix's rows: leave "
            f"{name!r} trainable, or leave {asked} out"
        )
        raise ConfigError(
            f"{asked}: the frozen parameter {name!r} {tuple(p.shape)} has rows of {p.shape[-1]} "
            f"elements, which do not divide into groups of {group}; {fix}"
        )


def training_engine(
    model: nn.Module,
    cfg: InfinityConfig,
    *,
    optimizer: torch.optim.Optimizer | None,
    lr_scheduler: Any,
    group: DataParallelGroup,
    device: torch.device,
) -> Engine:
    """The training engine for a loaded config: planned, checked before anything is allocated, built."""
    check_quantised_base(model, cfg)
    # One plan: the pre-flight check reads it, the engine allocates it ([Note: one sizing model]); with an
    # offload device "auto", the placement planner chose where the state rests ([Note: the placement planner]).
    plan, context = plan_runtime_for_rank(model, cfg, group=group, device=device)
    # Refuses (PreflightError: plan, shortfall, fix) before anything is allocated; "preflight": false skips it.
    preflight(model, cfg, device=device, group=group, runtime=plan, context=context)
    return Engine(
        model,
        cfg,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        group=group,
        device=device,
        plan=plan,
    )
