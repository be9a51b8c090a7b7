"""The small state of a run that is not a shard: RNG, lr schedule, loss scale, hyperparameters, step counts.

Captured as JSON (values.py) plus small tensors into each rank's rank file;
restored only after everything has been read and checked (see load.py), so
the restore functions here never see bad input from a file that passed its
checksum, and raise CheckpointMismatchError where the engine differs.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from infinity.engine.checkpoint.errors import CheckpointMismatchError
from infinity.engine.checkpoint.values import TensorSink, decode, encode

log = logging.getLogger("infinity.checkpoint")


def capture_rng(sink: TensorSink) -> Any:
    state = {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    return encode(state, sink, "RNG state")


def restore_rng(data: Any, tensors: dict[str, torch.Tensor]) -> None:
    state = decode(data, tensors, "RNG state")
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:
            log.warning(
                "the checkpoint has CUDA RNG states of %d devices and this process sees %d; CUDA RNG not restored",
                len(cuda),
                torch.cuda.device_count(),
            )
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


def param_group_of(
    param_groups: list[dict[str, Any]], params: Sequence[torch.nn.Parameter]
) -> list[int | None]:
    where = {id(p): gi for gi, g in enumerate(param_groups) for p in g["params"]}
    return [where.get(id(p)) for p in params]


def capture_hyperparameters(param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        encode({k: v for k, v in g.items() if k != "params"}, None, f"optimizer.param_groups[{i}]")
        for i, g in enumerate(param_groups)
    ]


def check_param_groups(
    saved_groups: list[Any],
    saved_of: list[Any],
    param_groups: list[dict[str, Any]],
    group_of: list[int | None],
    names: list[str],
) -> None:
    if len(saved_groups) != len(param_groups):
        raise CheckpointMismatchError(
            f"the checkpoint's optimizer has {len(saved_groups)} param group(s) and this engine's has "
            f"{len(param_groups)}; build the optimizer with the same param groups as the saved run"
        )
    if len(saved_of) != len(group_of):
        raise CheckpointMismatchError(
            f"the checkpoint covers {len(saved_of)} parameters and this engine {len(group_of)}; load a checkpoint "
            "of this model"
        )
    for name, a, b in zip(names, saved_of, group_of, strict=True):
        if a != b:
            raise CheckpointMismatchError(
                f"parameter {name!r} was in optimizer param group {a} when saved and is in group {b} now; build "
                "the optimizer with the same param groups as the saved run"
            )


def capture_scheduler(scheduler: Any, sink: TensorSink) -> Any:
    if scheduler is None:
        return None
    if not hasattr(scheduler, "state_dict"):
        raise TypeError(
            f"the lr scheduler {type(scheduler).__name__} has no state_dict(), so its position cannot be saved; "
            "use a torch.optim.lr_scheduler or a config 'scheduler' section"
        )
    return encode(scheduler.state_dict(), sink, "lr_scheduler.state_dict()")


def restore_scheduler(data: Any, scheduler: Any) -> None:
    """``data``: the decoded state_dict (None when the saved run had no scheduler)."""
    if data is None and scheduler is None:
        return
    if data is None:
        log.warning(
            "the checkpoint has no lr scheduler state; this engine's scheduler starts from its beginning"
        )
        return
    if scheduler is None:
        log.warning(
            "the checkpoint has lr scheduler state but this engine has no scheduler; it is ignored"
        )
        return
    scheduler.load_state_dict(data)
