"""DeepSpeed's warmup lr schedules as torch LRSchedulers: WarmupLR, WarmupDecayLR, WarmupCosineLR.

Same parameter names, defaults and formulas as DeepSpeed's
``deepspeed/runtime/lr_schedules.py``, so its configs and its per-step lrs
carry over; built on ``torch.optim.lr_scheduler.LRScheduler`` so that torch
tooling (``get_last_lr``, ``state_dict``) works. ``build_scheduler`` makes
one from the config's ``scheduler`` section.

[Note: step counting]
DeepSpeed counts ``last_batch_iteration`` from -1 (built, not yet stepped);
torch counts ``last_epoch`` from 0 (its constructor takes one step). Here
``last_batch_iteration == last_epoch - 1`` always, so the optimizer's k-th
step (k = 1, 2, ...) runs with DeepSpeed's lr at iteration k - 2: the
starting lr before the first ``scheduler.step()``, then the schedule at
iteration 0, 1, ... -- exactly DeepSpeed's sequence when the scheduler is
stepped after every optimizer step.

Deliberate differences from DeepSpeed: an unknown ``warmup_type`` is an
error (DeepSpeed logs and falls back to log); a ``warmup_max_lr`` left unset
means each param group's own lr (DeepSpeed's WarmupLR takes the first group's
lr for all groups); ``load_state_dict`` takes torch's full state or
DeepSpeed's ``{"last_batch_iteration": k}``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from infinity.config import SchedulerConfig, load_config

logger = logging.getLogger("infinity.optim")

LrArg = float | Sequence[float]


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    # DeepSpeed accepts a wrapper holding the optimizer in .optimizer (its fp16/ZeRO wrappers).
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    raise TypeError(f"{type(optimizer).__name__} is not a torch.optim.Optimizer")


def _per_group(optimizer: torch.optim.Optimizer, value: LrArg, name: str) -> list[float]:
    n = len(optimizer.param_groups)
    if isinstance(value, Sequence):
        if len(value) != n:
            raise ValueError(
                f"expected {n} values for {name} (one per param group), got {len(value)}"
            )
        values = [float(v) for v in value]
    else:
        values = [float(value)] * n
    for v in values:
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"{name} must be >= 0 and finite, got {value!r}")
    return values


class _Warmup(LRScheduler):
    """What the three schedules share: the warmup ramp and DeepSpeed's step counting. Each schedule
    defines ``lrs_at(iteration)``: the lr of every param group at DeepSpeed iteration ``iteration``
    (>= -1)."""

    lrs_at: Callable[[int], list[float]]

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_num_steps: int,
        warmup_type: str,
        last_batch_iteration: int,
    ) -> None:
        if (
            isinstance(warmup_num_steps, bool)
            or not isinstance(warmup_num_steps, int)
            or warmup_num_steps <= 0
        ):
            raise ValueError(
                f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}"
            )
        if warmup_type not in ("log", "linear"):
            raise ValueError(f"warmup_type must be 'log' or 'linear', got {warmup_type!r}")
        if (
            isinstance(last_batch_iteration, bool)
            or not isinstance(last_batch_iteration, int)
            or last_batch_iteration < -1
        ):
            raise ValueError(
                f"last_batch_iteration must be an integer >= -1, got {last_batch_iteration!r}"
            )
        # As in DeepSpeed: a 1-step warmup acts as 2 steps (log(1) would divide by zero).
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        super().__init__(optimizer, last_epoch=-1)
        if last_batch_iteration != -1:
            self._set_iteration(last_batch_iteration)

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's step counter: -1 before the first step() (see [Note: step counting])."""
        return self.last_epoch - 1

    def _warmup_fraction(self, iteration: int) -> float:
        if self.warmup_type == "log":
            return self.inverse_log_warm_up * math.log(iteration + 1)
        return iteration / self.warmup_num_steps

    def get_lr(self) -> list[float]:  # type: ignore[override]
        return self.lrs_at(self.last_epoch - 1)

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advances one optimizer step, or jumps to ``last_batch_iteration`` (DeepSpeed's signature)."""
        if last_batch_iteration is None:
            super().step()
            return
        self._step_count += 1
        self._set_iteration(last_batch_iteration)

    def _set_iteration(self, iteration: int) -> None:
        self.last_epoch = iteration + 1
        groups = self.optimizer.param_groups
        for group, lr in zip(groups, self.lrs_at(iteration), strict=True):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self._last_lr = [
            g["lr"].clone() if isinstance(g["lr"], torch.Tensor) else g["lr"] for g in groups
        ]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Torch's state, or a DeepSpeed scheduler's ``{"last_batch_iteration": k}``."""
        if "last_epoch" not in state_dict and "last_batch_iteration" in state_dict:
            self.last_epoch = int(state_dict["last_batch_iteration"]) + 1
            return
        super().load_state_dict(state_dict)


class WarmupLR(_Warmup):
    """Warm every param group's lr from warmup_min_lr to warmup_max_lr over warmup_num_steps, then hold.

    lr(i) = min + (max - min) * g(i), where g(i) = log(i + 1) / log(N) (log) or i / N
    (linear) for i < N = max(2, warmup_num_steps), and 1 after; before the first step
    (i = -1) lr = min. ``warmup_max_lr=None`` means each group's own lr.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_min_lr: LrArg = 0.0,
        warmup_max_lr: LrArg | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        optimizer = _torch_optimizer(optimizer)
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = (
            None if warmup_max_lr is None else _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        )
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return self._warmup_fraction(iteration)
        return 1.0

    def lrs_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_lrs)
        maxes = self.max_lrs if self.max_lrs is not None else [float(b) for b in self.base_lrs]
        gamma = self._gamma(iteration)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, maxes, strict=True)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay that reaches 0 at total_num_steps.

    After warmup g(i) = max(0, (T - i) / max(1, T - N)) with T = total_num_steps.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_lr: LrArg = 0.0,
        warmup_max_lr: LrArg | None = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        if (
            isinstance(total_num_steps, bool)
            or not isinstance(total_num_steps, int)
            or total_num_steps <= 0
        ):
            raise ValueError(f"total_num_steps must be a positive integer, got {total_num_steps!r}")
        self.total_num_steps = total_num_steps
        super().__init__(
            optimizer,
            warmup_min_lr,
            warmup_max_lr,
            warmup_num_steps,
            warmup_type,
            last_batch_iteration,
        )
        if total_num_steps < self.warmup_num_steps:
            logger.warning(
                "total_num_steps %d is less than warmup_num_steps %d",
                total_num_steps,
                warmup_num_steps,
            )

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return self._warmup_fraction(iteration)
        span = max(1.0, float(self.total_num_steps - self.warmup_num_steps))
        return max(0.0, float(self.total_num_steps - iteration) / span)


class WarmupCosineLR(_Warmup):
    """Scale every group's own lr: warm the ratio up from warmup_min_ratio to 1, then cosine to cos_min_ratio.

    ratio(i) = r0 + (1 - r0) * g(i) during warmup (g as in WarmupLR); after it,
    with p = min(1, (i - N + 1) / max(1, T - N)):
    ratio = max(0, c + (1 - c) * (1 + cos(pi * p)) / 2). Before the first step the ratio is 0.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        optimizer = _torch_optimizer(optimizer)
        if (
            isinstance(total_num_steps, bool)
            or not isinstance(total_num_steps, int)
            or total_num_steps <= 0
        ):
            raise ValueError(f"total_num_steps must be a positive integer, got {total_num_steps!r}")
        for name, v in (("warmup_min_ratio", warmup_min_ratio), ("cos_min_ratio", cos_min_ratio)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be a number in [0, 1], got {v!r}")
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        if total_num_steps < self.warmup_num_steps:
            logger.warning(
                "total_num_steps %d is less than warmup_num_steps %d",
                total_num_steps,
                warmup_num_steps,
            )

    def lr_ratio(self, iteration: int) -> float:
        """The multiplier of every group's lr at DeepSpeed iteration ``iteration``."""
        if iteration < 0:
            return 0.0
        if iteration < self.warmup_num_steps:
            frac = self._warmup_fraction(iteration)
            return self.warmup_min_ratio + frac * (1.0 - self.warmup_min_ratio)
        done = iteration - self.warmup_num_steps + 1
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, done / span)
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lrs_at(self, iteration: int) -> list[float]:
        ratio = self.lr_ratio(iteration)
        return [float(base) * ratio for base in self.base_lrs]


SCHEDULERS: dict[str, type[_Warmup]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
}


def build_scheduler(
    scheduler_config: SchedulerConfig | Mapping[str, Any], optimizer: torch.optim.Optimizer
) -> LRScheduler:
    """The schedule a config's ``scheduler`` section describes, driving ``optimizer``.

    ``scheduler_config``: a SchedulerConfig, or a DeepSpeed ``{"type": ..., "params": {...}}``
    dict (read as load_config reads it: an unsupported type is refused, listing the
    supported ones; "auto" values take their defaults or are refused).
    """
    if isinstance(scheduler_config, Mapping):
        built = load_config({"scheduler": dict(scheduler_config)}).scheduler
        assert built is not None  # a scheduler section always builds a SchedulerConfig or raises
        scheduler_config = built
    if not isinstance(scheduler_config, SchedulerConfig):
        raise TypeError(
            f"scheduler_config must be a SchedulerConfig or a dict; got {type(scheduler_config).__name__}"
        )
    params = {
        f.name: getattr(scheduler_config.params, f.name)
        for f in dataclasses.fields(scheduler_config.params)
    }
    return SCHEDULERS[scheduler_config.type](optimizer, **params)
