"""infinity.initialize: the training engine, or — with nothing to make an optimizer, at stage 3 — the inference engine.

The rule, read from the loaded config: no optimizer passed, no ``optimizer``
section (nor one made from ``lr=``), and zero_optimization.stage 3 give an
InferenceEngine; anything else is infinity.engine.initialize's training
engine (which, for a model with no trainable parameter, needs no optimizer
either: [Note: frozen units] in infinity/estimate/runtime_plan.py), with the
monitors its config enables (``tensorboard``, ``csv_monitor``, ``wandb``:
infinity.monitor) built first, so that a bad one stops the run before anything
is allocated, and attached to it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from infinity.engine import Engine
from infinity.engine.initialize import start, training_engine
from infinity.estimate import plan_runtime
from infinity.inference.engine import InferenceEngine
from infinity.inference.estimate import preflight_inference
from infinity.monitor import build_monitors

log = logging.getLogger("infinity.inference")


def initialize(
    model: nn.Module,
    config: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any = None,
    **auto_values: Any,
) -> Engine | InferenceEngine:
    """Builds the engine for ``model`` under ``config`` (a path or dict in DeepSpeed's schema).

    With an optimizer (passed, in the config, or from ``lr=``): the training engine, as
    infinity.engine.initialize documents it. With none and zero_optimization.stage 3: the
    inference engine (forward and ``generate`` with the weights streamed from their shards, no
    gradient or optimizer state), after a pre-flight check of what it allocates.
    """
    group, cfg, device = start(model, config, optimizer, **auto_values)
    if optimizer is None and cfg.optimizer is None and cfg.zero_optimization.stage == 3:
        if lr_scheduler is not None:
            raise ValueError(
                "an lr_scheduler was passed but nothing trains: with no optimizer (none passed, none in the "
                "config, no lr=) at stage 3 initialize builds the inference engine; pass an optimizer to train"
            )
        log.info(
            "no optimizer (none passed, no 'optimizer' section in the config, no lr=) at stage 3: "
            "building the inference engine (forward and generate; backward and step refuse)"
        )
        plan = plan_runtime(
            model, cfg, world_size=group.world_size, rank=group.rank, device=device, trains=False
        )
        preflight_inference(model, cfg, device=device, group=group, runtime=plan)
        return InferenceEngine(model, cfg, group=group, device=device, plan=plan)
    monitors = build_monitors(cfg, rank=group.rank)
    try:
        engine = training_engine(
            model, cfg, optimizer=optimizer, lr_scheduler=lr_scheduler, group=group, device=device
        )
    except BaseException:
        if monitors is not None:
            monitors.close()
        raise
    if monitors is not None:
        monitors.attach(engine)
    return engine
