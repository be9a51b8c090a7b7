"""What every framework adapter shares (Lightning's Trainer, Fabric, Accelerate, transformers' Trainer);
nothing framework-specific.

- ``read_config``: a DeepSpeed-style ``config=`` (a dict, copied, or a JSON path read as DeepSpeed
  reads it); ``make_default_nvme_path``, ``zero_stage``, ``is_auto``: reading such a config.
- ``build_engine``: ``infinity.initialize`` for an adapter, refusing a module another engine already
  trains; the trained module keeps its engine (``engine_of``, see [Note: a module's engine]).
- ``EngineModule``: the engine as the ``nn.Module`` a framework calls ([Note: one backward per step]);
  transformers' Trainer calls it as ``model_wrapped``.
- Checkpoints with a framework's state as the engine checkpoint's ``client_state`` under the tag
  ``checkpoint`` (Lightning's DeepSpeed layout ``<path>/checkpoint/``, which Fabric shares), with
  the errors a user needs when a path is not one.

Nothing here imports a framework or deepspeed. Threading: the framework's training thread only.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

import infinity
from infinity.config import read_config_file
from infinity.engine import Engine

DEFAULT_NVME_PATH = "./infinity_nvme"
TAG = "checkpoint"  # Lightning's DeepSpeed strategies save under this tag; Fabric's too


# -- the config ------------------------------------------------------------------


def read_config(config: Any, *, argument: str = "config") -> dict[str, Any]:
    """``config`` (the adapter's ``argument=``) as a dict of our own (the caller's is never changed):
    a dict, or the path of a DeepSpeed-style JSON file (read as DeepSpeed reads it: hjson)."""
    if isinstance(config, (str, os.PathLike)):
        if not Path(config).is_file():
            raise FileNotFoundError(
                f"{argument}={str(config)!r} is not a file; pass a DeepSpeed-style "
                "JSON config file or a dict"
            )
        return read_config_file(config)
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    raise TypeError(
        f"{argument}= takes a DeepSpeed-style config (a dict or the path of a JSON file), "
        f"not {type(config).__name__}"
    )


def make_default_nvme_path(config: Mapping[str, Any]) -> None:
    """Creates ``./infinity_nvme`` where an offload section names it: the strategies' default swap
    folder (as ``infinity demo``'s). A path the user gave must exist; the engine says so otherwise."""
    zero = config.get("zero_optimization")
    for key in ("offload_param", "offload_optimizer"):
        node = zero.get(key) if isinstance(zero, Mapping) else None
        if (
            isinstance(node, Mapping)
            and node.get("device") == "nvme"
            and node.get("nvme_path") == DEFAULT_NVME_PATH
        ):
            os.makedirs(DEFAULT_NVME_PATH, exist_ok=True)


def zero_stage(config: Mapping[str, Any]) -> int:
    zero = config.get("zero_optimization")
    return int(zero.get("stage", 0)) if isinstance(zero, Mapping) else 0


def is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == "auto"


# -- the engine -------------------------------------------------------------------

# [Note: a module's engine]
# Under stage 3 a trained module's parameters are empty placeholders: only the engine that
# partitioned it holds the weights. So the module keeps a reference to that engine (set by
# build_engine, in the module's own __dict__ where nn.Module does not look for submodules or
# state), and an adapter handed the module again (a second Trainer evaluating it, a second
# prepare) finds the engine there, or refuses a second engine. The module owns the link: it
# lives and dies with it, no table outside the objects keeps it.
# Each precision's section under the names DeepSpeed reads it by (bfloat16 is bf16's alias).
PRECISION_SECTIONS: dict[str, tuple[str, ...]] = {"fp16": ("fp16",), "bf16": ("bf16", "bfloat16")}


def precision_section(cfg: Mapping[str, Any], dtype: str) -> Mapping[str, Any] | None:
    """The config's ``dtype`` ("fp16" or "bf16") section under any of its names, None if absent."""
    for key in PRECISION_SECTIONS[dtype]:
        node = cfg.get(key)
        if isinstance(node, Mapping):
            return node
    return None


_ENGINE_ATTR = "_infinity_engine"


def engine_of(module: nn.Module) -> Engine | None:
    """The engine ``build_engine`` made for ``module`` (None if none did)."""
    engine = module.__dict__.get(_ENGINE_ATTR)
    return engine if isinstance(engine, Engine) else None


def mark_stepped_by_engine(optimizer: torch.optim.Optimizer) -> None:
    """[Note: the engine steps in the optimizer's place] The engine maps the torch optimizer onto
    its own (sharing its param group dicts) and never calls its step(). torch's LRScheduler checks,
    at its first step, that its optimizer's step() ran, and would warn that the schedule skips its
    first value, which it does not: every engine update counts as one."""
    optimizer._opt_called = True  # type: ignore[attr-defined]


def build_engine(
    module: nn.Module,
    config: dict[str, Any],
    optimizer: Any = None,
    lr_scheduler: Any = None,
    **values: Any,
) -> Any:
    """``infinity.initialize(module, config, optimizer, lr_scheduler, **values)`` for an adapter: a
    module another engine trains is refused (see [Note: a module's engine]), the default swap folder
    made. Returns what ``initialize`` returns (an InferenceEngine without an optimizer)."""
    if engine_of(module) is not None:
        raise RuntimeError(
            f"this {type(module).__name__} is already trained by an infinity engine (another Trainer, Fabric or "
            "prepare() set it up; under stage 3 only that engine holds its weights). Keep using that one, "
            "or save a checkpoint with it and resume a freshly built module from that checkpoint"
        )
    if optimizer is not None:
        mark_stepped_by_engine(optimizer)
    make_default_nvme_path(config)
    engine = infinity.initialize(
        module, config, optimizer=optimizer, lr_scheduler=lr_scheduler, **values
    )
    if isinstance(engine, Engine):
        module.__dict__[_ENGINE_ATTR] = engine
    return engine


# [Note: one backward per step]
# The engine counts micro-steps in step(): backward() scales by 1/gradient_accumulation_steps and
# starts a fresh gradient window when the count says a window begins. Two backward() calls without
# a step() in between would both start one, and the first's gradients would be lost without a word.
# Accumulation is the engine's (the config's gradient_accumulation_steps, which the Trainer fills
# from accumulate_grad_batches): every backward is followed by a step, as with DeepSpeed.


class EngineModule(nn.Module):
    """The engine as an ``nn.Module``: ``forward`` is ``engine(...)`` (so every forward opens the
    stage-3 prefetch step ``engine.backward`` closes); the trained module is its child ``module`` (so
    ``train()`` / ``eval()`` reach it)."""

    def __init__(self, engine: Engine):
        super().__init__()
        self.engine = engine
        self.module = engine.module
        self._backward_pending = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        if self._backward_pending:
            raise RuntimeError(
                "backward was called twice without an optimizer step in between; with infinity the engine "
                "accumulates gradients: call optimizer.step() after every backward and set "
                "gradient_accumulation_steps in the config (the Trainer sets it from accumulate_grad_batches); "
                "the engine updates the weights once per window"
            )
        self.engine.backward(loss)
        self._backward_pending = True

    def step(self) -> None:
        self.engine.step()
        self._backward_pending = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: the engine drops its gradient at each update (a framework calls this after
        ``optimizer.step()``; ``engine.zero_grad()`` drops a window's gradient before its update)."""


# -- checkpoints --------------------------------------------------------------------


def save_client_state(
    engine: Engine, path: Any, client_state: dict[str, Any], *, what: str
) -> None:
    """``engine.save_checkpoint(path, tag="checkpoint", client_state=...)``; a value a checkpoint cannot
    hold (no pickle: JSON values and tensors only) is refused naming where it sits in ``what``."""
    try:
        engine.save_checkpoint(path, tag=TAG, client_state=client_state)
    except TypeError as e:
        raise TypeError(
            f"{e}. The {what} rides in the checkpoint as JSON values and tensors; keep such objects out of "
            "it (e.g. save_hyperparameters(ignore=[...]) for a hyper-parameter, or store its state_dict())"
        ) from None


def check_checkpoint_dir(path: Any, *, single_file_hint: str) -> Path:
    """The directory a checkpoint was saved to (``<path>/checkpoint/``), with DeepSpeed's hints for
    the usual mistakes: a subfolder or a file inside it, or a single-file checkpoint."""
    p = Path(path)
    if p.is_dir() and (p / TAG).is_dir():
        return p
    head = f"{str(path)!r} is not an infinity checkpoint (a directory holding '{TAG}/')"
    if p.is_dir() and p.name == TAG or p.is_dir() and (p.parent / TAG).is_dir():
        raise FileNotFoundError(
            f"{head}; it looks like a folder inside one: load {str(p.parent)!r} instead"
        )
    if p.is_file() and (p.parent.parent / TAG).is_dir():
        raise FileNotFoundError(
            f"{head}; it is a file inside one: load {str(p.parent.parent)!r} instead"
        )
    if p.is_file():
        raise FileNotFoundError(
            f"{head}; it is a single file, as Lightning's other strategies write: "
            f"{single_file_hint}"
        )
    raise FileNotFoundError(f"{head}; no such directory")
