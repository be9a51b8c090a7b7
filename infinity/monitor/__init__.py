"""Monitors: each optimizer step's figures written where users look (DeepSpeed's monitor sections).

``infinity.initialize`` builds them (``build_monitors``) and attaches them to
the training engine when the config enables ``tensorboard``, ``csv_monitor`` or ``wandb``; every
optimizer step's ``StepRecord`` (infinity/engine/step_record.py) becomes
events under DeepSpeed's names and this runtime's own (``events.py``), with
samples seen as the x-axis, written on rank 0 as DeepSpeed writes them. The
framework adapters forward the same figures (``step_metrics``) to their
framework's logger. TensorBoard and wandb are optional extras, imported only
when their section is enabled.

Imports only infinity.engine and infinity.config (and torch, tensorboard, wandb).
"""

from infinity.monitor.attach import Monitors, build_monitors
from infinity.monitor.events import DEEPSPEED_EVENTS, RUNTIME_EVENTS, step_events, step_metrics

__all__ = [
    "DEEPSPEED_EVENTS",
    "RUNTIME_EVENTS",
    "Monitors",
    "build_monitors",
    "step_events",
    "step_metrics",
]
