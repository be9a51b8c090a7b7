"""initialize(): from a model and a DeepSpeed-style config to a training engine.

``infinity.initialize`` (infinity.inference.initialize) is this, or the
inference engine when nothing makes an optimizer at stage 3; both start from
``start`` (process group, config, device).
"""

from __future__ import annotations

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
    quant = cfg.weight_quantization.quantized_initialization
    if quant is not None:
        raise ConfigError(
            "weight_quantization.quantized_initialization keeps weights quantised for inference, and this "
            "engine trains (an optimizer was passed, configured or made from lr=); drop the section to "
            "train, or call infinity.initialize with no optimizer at stage 3 for the inference engine"
        )
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
