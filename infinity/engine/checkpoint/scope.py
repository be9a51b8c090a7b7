"""What a load restores: DeepSpeed's load_checkpoint switches, and which hyperparameters they leave in use.

[Note: what a load restores]
- Always: the module's weights (the fp32 masters, and the parameters made
  from them) and buffers; the client_state is returned.
- ``load_optimizer_states`` (default True): Adam's moments and step counts
  (the user's torch optimizer's state, stage 0), the param groups'
  hyperparameters (betas, eps, weight_decay, ...) and the fp16 loss scale.
  False: the moments start afresh (zeros, step 0) on the loaded weights and
  this engine's hyperparameters and loss scale stay.
- ``load_lr_scheduler_states`` (default True): the lr scheduler's state
  (its settings and position) and the lr it gave the param groups. False:
  this engine's schedule and lr stay as configured.
- The step counters and the RNG state: restored unless ``load_module_only``.
- ``load_module_only=True``: the weights and buffers only; the optimizer,
  schedule, loss scale, counters and RNG of the engine are left as they are
  (a fresh engine's: fresh). Overrides the other two switches.
Where the checkpoint's hyperparameters or schedule differ from this
engine's, one log line names each value in use and the one not used: a
warning where the checkpoint's replace the config's, info where the config's
stay by request.

Threading: pure functions of their arguments.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

# Scheduler state that says where a schedule is, not what it is (torch's LRScheduler bookkeeping).
_POSITION_KEYS = frozenset({"last_epoch"})
# Param group keys a live lr scheduler sets: they follow the schedule, not the optimizer switch.
SCHEDULED_KEYS = ("lr", "initial_lr")


@dataclasses.dataclass(frozen=True)
class LoadScope:
    """Which parts of the saved state a load restores (see [Note: what a load restores])."""

    optimizer_states: bool
    lr_scheduler_states: bool
    module_only: bool

    @classmethod
    def of(
        cls, *, load_optimizer_states: bool, load_lr_scheduler_states: bool, load_module_only: bool
    ) -> LoadScope:
        for name, value in (
            ("load_optimizer_states", load_optimizer_states),
            ("load_lr_scheduler_states", load_lr_scheduler_states),
            ("load_module_only", load_module_only),
        ):
            if not isinstance(value, bool):
                raise TypeError(f"load_checkpoint({name}=...) takes True or False, not {value!r}")
        return cls(
            load_optimizer_states and not load_module_only,
            load_lr_scheduler_states and not load_module_only,
            load_module_only,
        )

    @property
    def run_state(self) -> bool:
        """The step counters and the RNG state."""
        return not self.module_only


@dataclasses.dataclass(frozen=True)
class Hyperparameters:
    """What a load sets in each param group, and the differences to report."""

    values: list[dict[str, Any]]  # per live param group: key -> value to set
    from_checkpoint: list[
        str
    ]  # "weight_decay 0.1 (this engine's config: 0.01) in param group 0", ...
    kept: list[str]  # "weight_decay 0.01 (the checkpoint's: 0.1) in param group 0", ...


def hyperparameters(
    saved_groups: Sequence[Mapping[str, Any]],
    live_groups: Sequence[Mapping[str, Any]],
    *,
    scope: LoadScope,
    scheduled: bool,
    schedule_restored: bool,
) -> Hyperparameters:
    """Which param group values a load sets. ``scheduled``: this engine has an lr scheduler (it sets
    lr and initial_lr); ``schedule_restored``: the checkpoint's schedule is being restored into it."""
    values: list[dict[str, Any]] = []
    used: list[str] = []
    kept: list[str] = []
    for i, (saved, live) in enumerate(zip(saved_groups, live_groups, strict=True)):
        out: dict[str, Any] = {}
        for k, v in saved.items():
            if scheduled and k in SCHEDULED_KEYS:
                if schedule_restored:
                    out[k] = v  # the lr the restored schedule gave, consistent with its position
                continue
            differs = k in live and _plain(live[k]) != _plain(v)
            if scope.optimizer_states:
                out[k] = v
                if differs:
                    used.append(f"{k} {v!r} (this engine's config: {live[k]!r}) in param group {i}")
            elif differs:
                kept.append(f"{k} {live[k]!r} (the checkpoint's: {v!r}) in param group {i}")
        values.append(out)
    return Hyperparameters(values, used, kept)


def schedule_differences(saved: Mapping[str, Any], live: Mapping[str, Any]) -> list[str]:
    """The settings (not the position) in which two lr scheduler states differ: "max_lrs [0.003] (this
    engine's config: [0.001])"."""
    out = []
    for k, v in saved.items():
        if k.startswith("_") or k in _POSITION_KEYS or k not in live:
            continue
        if _plain(live[k]) != _plain(v):
            out.append(f"{k} {_plain(v)!r} (this engine's config: {_plain(live[k])!r})")
    return out


def _plain(value: Any) -> Any:
    """Tuples as lists, so that a decoded state compares equal to a live one."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def messages(
    hyper: Hyperparameters, *, schedule: str | None, schedule_used: list[str], schedule_kept: bool
) -> list[tuple[int, str]]:
    """(log level, line) saying which values a load leaves in use where the checkpoint's and this
    engine's differ. ``schedule``: the scheduler's type name; ``schedule_used``: its settings that
    the checkpoint's replace; ``schedule_kept``: this engine's schedule stays by request."""
    out = []
    if hyper.from_checkpoint:
        out.append(
            (
                logging.WARNING,
                "resuming with the checkpoint's optimizer hyperparameters, not this engine's config: "
                + "; ".join(hyper.from_checkpoint)
                + ". Pass load_checkpoint(..., load_optimizer_states=False) to keep the config's (Adam's "
                "moments then start afresh on the loaded weights)",
            )
        )
    if hyper.kept:
        out.append(
            (
                logging.INFO,
                "keeping this engine's optimizer hyperparameters (load_optimizer_states=False): "
                + "; ".join(hyper.kept),
            )
        )
    if schedule_used:
        out.append(
            (
                logging.WARNING,
                f"resuming with the checkpoint's lr schedule ({schedule}), not this engine's config: "
                + "; ".join(schedule_used)
                + ". Pass load_checkpoint(..., load_lr_scheduler_states=False) to keep the config's schedule",
            )
        )
    if schedule_kept:
        out.append(
            (
                logging.INFO,
                f"keeping this engine's lr schedule ({schedule}) as configured, from where it "
                "is now (load_lr_scheduler_states=False); the checkpoint's schedule and its position are "
                "not loaded",
            )
        )
    return out
