"""Accelerate on infinity: Accelerate places the data and knows the ranks, infinity owns model and optimizer.

``prepare`` replaces ``accelerator.prepare(model, optimizer, dataloader, scheduler)`` for a model
trained by an infinity engine; ``prepare_frozen`` serves a model that is never trained (a teacher)
from its stage-3 shards. The loop is the one Accelerate's DeepSpeed plugin asks for:

    accelerator = Accelerator(gradient_accumulation_steps=2, mixed_precision="bf16")
    model, optimizer, loader, scheduler = prepare(accelerator, model, optimizer, loader, scheduler,
                                                  config="ds_config.json")
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)      # engine.backward(loss): the engine scales by 1/accumulation
        optimizer.step()                # engine.step(): updates once per accumulation window
        scheduler.step()                # nothing: the engine steps the schedule at each update
        optimizer.zero_grad()           # nothing: the engine starts each window with no gradient
    accelerator.save_state("ckpt")      # the engine's checkpoint in ckpt/infinity_model/, with
    accelerator.load_state("ckpt")      # Accelerate's RNG and dataloader state beside it

[Note: what prepare patches]
Accelerate's ``backward`` calls ``loss.backward()`` on anything but its own DeepSpeed engine, and
its ``save_state`` saves only what ``accelerator.prepare`` wrapped. ``prepare`` changes exactly
three things on the one ``Accelerator`` instance it is given (never the class): its ``backward``
goes to the engine it prepared (``model.backward(loss)`` does the same without the patch), and a
save-state and a load-state pre-hook (Accelerate's public ``register_save_state_pre_hook`` /
``register_load_state_pre_hook``) write and read each engine's checkpoint under
``<dir>/infinity_model[_i]/``. Everything else is Accelerate's own: the dataloader goes through
``accelerator.prepare``, RNG states ride in ``save_state``.

The "auto" values are filled as Accelerate's DeepSpeed plugin fills them (``Accelerator.
_prepare_deepspeed``, accelerate 1.15), through infinity's argument table (infinity/config/
arguments.py): ``train_micro_batch_size_per_gpu`` from the dataloader's batch size (divided by the
processes under ``split_batches``), ``gradient_accumulation_steps`` from the Accelerator (a value
the config writes wins, and the Accelerator is told, as Accelerate does), ``fp16`` / ``bf16`` from
``mixed_precision``, ``gradient_clipping`` 1.0, the ZeRO sizes from the model's hidden size, the
optimizer's hyper-parameters from the torch optimizer passed in.

Nothing here imports deepspeed (nor Accelerate's DeepSpeed utilities). Threading: the training
thread only.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

import infinity
from infinity.engine import Engine
from infinity.inference import InferenceEngine
from infinity.integrations import _lightning_shared as shared

__all__ = ["EngineOptimizer", "EngineScheduler", "prepare", "prepare_frozen"]

log = logging.getLogger("infinity.integrations")

CHECKPOINT_TAG = "infinity_model"  # Accelerate's DeepSpeed path saves its engine under "pytorch_model"
_REFUSED_TYPES = ("DEEPSPEED", "FSDP", "MEGATRON_LM", "XLA")
_PREPARED = "_infinity_engine_modules"  # the Accelerator attribute listing what prepare() built


def _check_accelerator(accelerator: Any) -> None:
    kind = getattr(getattr(accelerator, "distributed_type", None), "name", None)
    if kind is None or not hasattr(accelerator, "prepare"):
        raise TypeError(f"prepare() takes an accelerate.Accelerator first, not {type(accelerator).__name__}")
    if kind in _REFUSED_TYPES:
        raise ValueError(
            f"this Accelerator runs with distributed_type {kind}: infinity's engine owns the model and "
            "optimizer, so create the Accelerator without a DeepSpeed, FSDP, Megatron or XLA plugin "
            "(Accelerator() or `accelerate launch` with the multi-CPU/GPU config) and pass the DeepSpeed-"
            "style config to prepare(..., config=...)"
        )
    if accelerator.mixed_precision == "fp8":
        raise ValueError("mixed_precision='fp8' is not supported by infinity's engine; use 'bf16', 'fp16' or 'no'")


def _read(config: Any) -> dict[str, Any]:
    if config is None:
        raise TypeError("config= is required: a DeepSpeed-style config dict or the path of its JSON file")
    cfg = shared.read_config(config)
    assert cfg is not None
    return cfg


def _auto_or_absent(cfg: Mapping[str, Any], key: str) -> bool:
    return key not in cfg or shared.is_auto(cfg[key])


# Each precision's section under the names DeepSpeed reads it by (bfloat16 is bf16's alias).
_SECTIONS: dict[str, tuple[str, ...]] = {"fp16": ("fp16",), "bf16": ("bf16", "bfloat16")}


def _section(cfg: Mapping[str, Any], dtype: str) -> Mapping[str, Any] | None:
    for key in _SECTIONS[dtype]:
        node = cfg.get(key)
        if isinstance(node, Mapping):
            return node
    return None


def _precision(cfg: dict[str, Any], mixed_precision: str) -> dict[str, Any]:
    """Accelerate's ``DeepSpeedPlugin.set_mixed_precision``: the section of the mixed precision is
    added where missing, "auto" ``enabled`` flags take it, another dtype enabled is refused."""
    out: dict[str, Any] = {}
    if mixed_precision in ("fp16", "bf16"):
        other = "bf16" if mixed_precision == "fp16" else "fp16"
        node = _section(cfg, other)
        if node is not None and node.get("enabled") is True:
            raise ValueError(
                f"the Accelerator's mixed_precision is {mixed_precision!r} and the config enables {other}; "
                f"make them agree (Accelerator(mixed_precision={other!r}), or remove the {other} section)"
            )
        if _section(cfg, mixed_precision) is None:
            cfg[mixed_precision] = {"enabled": True}
    for name in ("fp16", "bf16"):
        node = _section(cfg, name)
        if node is not None and shared.is_auto(node.get("enabled")):
            out[name] = mixed_precision == name
    return out


def _micro_batch(accelerator: Any, dataloader: Any) -> int:
    if dataloader is None:
        raise ValueError(
            "train_micro_batch_size_per_gpu is \"auto\" and no dataloader was passed: pass the training "
            "dataloader to prepare(), or write train_micro_batch_size_per_gpu in the config"
        )
    batch_size = getattr(dataloader, "batch_size", None)
    if not isinstance(batch_size, int):
        raise ValueError(
            f"train_micro_batch_size_per_gpu is \"auto\" and the dataloader's batch_size is {batch_size!r} "
            "(Accelerate fills it from an integer batch_size): write train_micro_batch_size_per_gpu in the "
            "config, or give the DataLoader a batch_size"
        )
    if accelerator.split_batches:
        batch_size //= accelerator.num_processes
    return batch_size


def _accumulation(cfg: dict[str, Any], accelerator: Any) -> dict[str, Any]:
    if _auto_or_absent(cfg, "gradient_accumulation_steps"):
        return {"gradient_accumulation_steps": accelerator.gradient_accumulation_steps}
    written = cfg["gradient_accumulation_steps"]
    if written != accelerator.gradient_accumulation_steps:
        log.warning("gradient accumulation steps: the Accelerator has %s, the config %s; using the config's "
                    "(as Accelerate's DeepSpeed plugin does)", accelerator.gradient_accumulation_steps, written)
        accelerator.gradient_accumulation_steps = written
    return {}


def auto_values(accelerator: Any, cfg: dict[str, Any], dataloader: Any = None) -> dict[str, Any]:
    """The keyword arguments ``infinity.initialize`` fills the config's "auto" values with, as
    Accelerate's DeepSpeed plugin fills them; adds the mixed precision's section to ``cfg``."""
    values = _precision(cfg, accelerator.mixed_precision)
    if _auto_or_absent(cfg, "train_micro_batch_size_per_gpu"):
        values["train_micro_batch_size_per_gpu"] = _micro_batch(accelerator, dataloader)
    values.update(_accumulation(cfg, accelerator))
    if shared.is_auto(cfg.get("gradient_clipping")):
        values["gradient_clipping"] = 1.0  # Accelerate's default (DeepSpeedPlugin gradient_clipping)
    return values


class EngineOptimizer:
    """The optimizer ``prepare`` returns: ``step()`` is ``engine.step()`` (the update happens at the end
    of each accumulation window), ``zero_grad()`` does nothing (each window starts without gradient),
    as Accelerate's DeepSpeed optimizer wrapper. ``param_groups`` are the engine optimizer's (their lr
    is the schedule's); its state lives in the engine (save it with ``accelerator.save_state``)."""

    def __init__(self, model: shared.EngineModule):
        self.model = model
        self.optimizer = model.engine.optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def defaults(self) -> dict[str, Any]:
        return getattr(self.optimizer, "defaults", {})

    def step(self, closure: Any = None) -> Any:
        result = None
        if closure is not None:
            with torch.enable_grad():
                result = closure()
        self.model.step()
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: engine.step() ends each accumulation window (see Engine.zero_grad to drop one)."""

    @property
    def step_was_skipped(self) -> bool:
        """Always False: an fp16 overflow skips the engine's update, which counts it in skipped_steps."""
        return False

    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("the optimizer state lives in the infinity engine (partly on NVMe): save it with "
                           "accelerator.save_state(dir) after prepare(), or engine.save_checkpoint")

    def load_state_dict(self, state_dict: Any) -> None:
        raise RuntimeError("restore the optimizer state with accelerator.load_state(dir) (the engine's checkpoint)")


class EngineScheduler:
    """The lr schedule ``prepare`` returns: the engine steps the wrapped scheduler once per update, so
    ``step()`` does nothing (as Accelerate's DeepSpeed scheduler wrapper); the rest is the scheduler's."""

    def __init__(self, scheduler: Any):
        self.scheduler = scheduler

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Nothing: engine.step() steps the schedule at each update."""

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)


def _refuse_wrapped(accelerator: Any, model: nn.Module, optimizer: Any, scheduler: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"prepare() trains an nn.Module, not {type(model).__name__}")
    if isinstance(model, shared.EngineModule) or shared.engine_of(model) is not None:
        raise RuntimeError(f"this {type(model).__name__} is already trained by an infinity engine; prepare each "
                           "model once")
    if any(model is m or getattr(m, "module", None) is model for m in getattr(accelerator, "_models", [])):
        raise RuntimeError(f"this {type(model).__name__} went through accelerator.prepare already: give "
                           "infinity's prepare() the plain model (it owns model and optimizer)")
    for obj, what in ((optimizer, "optimizer"), (scheduler, "scheduler")):
        name = type(obj).__name__
        if name.startswith("Accelerated"):
            raise RuntimeError(f"the {what} is an {name} (accelerator.prepare wrapped it): pass the plain "
                               f"torch {what} to infinity's prepare()")
        if name.startswith("Dummy"):
            raise TypeError(f"accelerate.utils.{name} is a DeepSpeed placeholder: pass {what}=None to use the "
                            f"config's {what} section (its \"auto\" values filled by keyword arguments: lr=...)")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer (or None for the config's), not "
                        f"{type(optimizer).__name__}")


def _backward(accelerator: Any, loss: torch.Tensor, **kwargs: Any) -> None:
    """``accelerator.backward(loss)`` after prepare(): the engine's backward ([Note: what prepare patches])."""
    trained = getattr(accelerator, _PREPARED, [])
    if kwargs:
        raise TypeError(f"accelerator.backward(loss) on infinity's engine takes no keyword arguments; got "
                        f"{sorted(kwargs)}")
    if len(trained) != 1:
        raise RuntimeError(f"{len(trained)} models were prepared for training with infinity on this Accelerator: "
                           "call model.backward(loss) on the one the loss belongs to")
    trained[0].backward(loss)


def _register(accelerator: Any, model: shared.EngineModule) -> None:
    trained: list[shared.EngineModule] = getattr(accelerator, _PREPARED, None) or []
    index = len(trained)
    trained.append(model)
    setattr(accelerator, _PREPARED, trained)
    tag = CHECKPOINT_TAG if index == 0 else f"{CHECKPOINT_TAG}_{index}"
    if index == 0:
        accelerator.backward = lambda loss, **kwargs: _backward(accelerator, loss, **kwargs)

    def save(models: Any, weights: Any, output_dir: str) -> None:
        model.engine.save_checkpoint(output_dir, tag=tag)

    def load(models: Any, input_dir: str) -> None:
        if not os.path.isdir(os.path.join(input_dir, tag)):
            raise FileNotFoundError(f"{input_dir!r} holds no {tag}/: it was not saved by accelerator.save_state "
                                    "after infinity's prepare() (with as many models prepared)")
        model.engine.load_checkpoint(input_dir, tag=tag)

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)


def prepare(
    accelerator: Any,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    dataloader: Any = None,
    scheduler: Any = None,
    *,
    config: Any,
    **auto: Any,
) -> tuple[shared.EngineModule, EngineOptimizer, Any, EngineScheduler | None]:
    """``accelerator.prepare`` for a model trained by infinity: returns ``(model, optimizer, dataloader,
    scheduler)``. The dataloader goes through ``accelerator.prepare`` (sharded over the ranks); the
    model and optimizer become an infinity engine (``infinity.initialize(model, config, optimizer,
    lr_scheduler=scheduler)``), "auto" values filled as Accelerate's DeepSpeed plugin fills them; other
    keyword arguments fill "auto" values too (``lr=``, ``warmup_num_steps=``...). ``optimizer=None``:
    the config's optimizer section. See the module docstring for the loop and what is patched."""
    _check_accelerator(accelerator)
    _refuse_wrapped(accelerator, model, optimizer, scheduler)
    cfg = _read(config)
    values = {**auto_values(accelerator, cfg, dataloader), **auto}
    if optimizer is not None:
        optimizer._opt_called = True  # type: ignore[attr-defined]  # [Note: the engine steps in the optimizer's place]
    shared.make_default_nvme_path(cfg)
    engine = infinity.initialize(model, cfg, optimizer=optimizer, lr_scheduler=scheduler, **values)
    if not isinstance(engine, Engine):
        engine.close()
        raise ValueError("nothing to train: the config has no optimizer and none was passed (for a frozen "
                         "model use prepare_frozen(model, config))")
    em = shared.EngineModule(engine)
    _register(accelerator, em)
    # After the engine: a refused config leaves no dataloader registered with the Accelerator.
    prepared_loader = accelerator.prepare(dataloader) if dataloader is not None else None
    wrapped = EngineScheduler(engine.lr_scheduler) if engine.lr_scheduler is not None else None
    return em, EngineOptimizer(em), prepared_loader, wrapped


def prepare_frozen(model: nn.Module, config: Any, *, accelerator: Any = None, **auto: Any) -> InferenceEngine:
    """A model that is never trained (a distillation teacher): its parameters in stage-3 shards (on NVMe
    where the config's ``offload_param`` says so), no gradient or optimizer state, every forward under
    ``no_grad`` in eval mode: ``infinity.initialize`` without an optimizer, i.e. the inference engine.
    ``accelerator``: fills ``fp16``/``bf16`` "auto" from its ``mixed_precision``; the batch keys
    DeepSpeed demands even here take 1 where "auto"."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"prepare_frozen() takes an nn.Module, not {type(model).__name__}")
    cfg = _read(config)
    if shared.zero_stage(cfg) != 3:
        raise ValueError(
            f"prepare_frozen serves the model from ZeRO stage-3 shards; the config has stage "
            f"{shared.zero_stage(cfg)}: set zero_optimization.stage to 3 (with offload_param device 'nvme' "
            "to keep the parameters on NVMe)"
        )
    if "optimizer" in cfg or "scheduler" in cfg:
        raise ValueError("prepare_frozen builds no optimizer: remove the config's optimizer and scheduler "
                         "sections (a frozen model has no optimizer state)")
    values: dict[str, Any] = {}
    if accelerator is not None:
        _check_accelerator(accelerator)
        values.update(_precision(cfg, accelerator.mixed_precision))
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if shared.is_auto(cfg.get(key)):
            values[key] = 1
    model.requires_grad_(False)
    shared.make_default_nvme_path(cfg)
    engine = infinity.initialize(model, copy.deepcopy(cfg), **{**values, **auto})
    assert isinstance(engine, InferenceEngine), "stage 3 without an optimizer builds the inference engine"
    return engine
