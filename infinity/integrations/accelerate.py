"""Accelerate on infinity: Accelerate places the data and knows the ranks, infinity owns model and optimizer.

``prepare`` replaces ``accelerator.prepare(model, optimizer, dataloader, scheduler)`` for a model
trained by an infinity engine; ``prepare_frozen`` serves a model that is never trained (a teacher)
from its stage-3 shards. The loop is the one Accelerate's DeepSpeed plugin asks for:

    accelerator = Accelerator(gradient_accumulation_steps=2, mixed_precision="bf16")
    model, optimizer, loader, scheduler = prepare(accelerator, model, optimizer, loader, scheduler,
                                                  config="ds_config.json")   # as many as given
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)      # engine.backward(loss): the engine scales by 1/accumulation
        optimizer.step()                # engine.step(): updates once per accumulation window
        scheduler.step()                # nothing: the engine steps the schedule at each update
        optimizer.zero_grad()           # nothing: the engine starts each window with no gradient
    accelerator.save_state("ckpt")      # the engine's checkpoint in ckpt/infinity_model/, with
    accelerator.load_state("ckpt")      # Accelerate's RNG and dataloader state beside it
    accelerator.save_model(model, "out")  # model.safetensors streamed from the engine

[Note: what prepare patches]
Accelerate's ``backward`` calls ``loss.backward()`` on anything but its own DeepSpeed engine, its
``save_state`` saves only what ``accelerator.prepare`` wrapped, and its ``unwrap_model``,
``get_state_dict`` and ``save_model`` know only its own wrappers (on an engine's stage-3 model they
would see empty placeholders: a 128-byte model.safetensors). ``prepare`` changes exactly these
things on the one ``Accelerator`` instance it is given (never the class): its ``backward`` goes to
the engine it prepared (``model.backward(loss)`` does the same without the patch); its
``unwrap_model`` returns the user's model for a prepared one; its ``get_state_dict`` gathers the
engine's weights (``engine.gathered_state_dict()``: the whole model in CPU copies, as the call means);
its ``save_model`` streams them from the engine's units into Accelerate's layout
(``model.safetensors``, or shards of ``max_shard_size`` with ``model.safetensors.index.json``; tied
weights once; ``config.json`` too for a transformers model) through ``engine.save_16bit_model``,
never the whole model in memory; and a save-state and a load-state pre-hook (Accelerate's public
``register_save_state_pre_hook`` / ``register_load_state_pre_hook``) write and read each engine's
checkpoint under ``<dir>/infinity_model[_i]/``. Any other model goes to Accelerate's own methods.
Everything else is Accelerate's: dataloaders go through ``accelerator.prepare``, RNG states ride in
``save_state``.

The "auto" values are filled as Accelerate's DeepSpeed plugin fills them (``Accelerator.
_prepare_deepspeed``, accelerate 1.15), through infinity's argument table (infinity/config/
arguments.py): ``train_micro_batch_size_per_gpu`` from the dataloader's batch size (divided by the
processes under ``split_batches``), ``gradient_accumulation_steps`` from the Accelerator (a value
the config writes wins, and the Accelerator is told, as Accelerate does), ``fp16`` / ``bf16`` from
``mixed_precision``, ``gradient_clipping`` 1.0, the ZeRO sizes from the model's hidden size, the
optimizer's hyper-parameters from the torch optimizer passed in.

Each optimizer step's figures (``infinity.monitor.step_metrics``: step time, exposed I/O, NVMe
bytes and GB/s, prefetch outcomes, pools, peak host memory, forward/backward/step times, DeepSpeed's
``Train/Samples/*`` loss and lr) go to ``accelerator.log(..., step=<optimizer steps>)``: to every
tracker ``init_trackers`` started (nothing without one, as ``accelerator.log`` does).

Nothing here imports deepspeed (nor Accelerate's DeepSpeed utilities). Threading: the training
thread only.
"""

from __future__ import annotations

import copy
import logging
import math
import os
from collections.abc import Mapping
from typing import Any

import torch
from accelerate.utils.deepspeed import DummyOptim, DummyScheduler
from torch import nn
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from infinity.engine import Engine
from infinity.inference import InferenceEngine
from infinity.integrations import _shared
from infinity.monitor import step_metrics

__all__ = ["EngineOptimizer", "EngineScheduler", "prepare", "prepare_frozen"]

log = logging.getLogger("infinity.integrations")

CHECKPOINT_TAG = (
    "infinity_model"  # Accelerate's DeepSpeed path saves its engine under "pytorch_model"
)
_REFUSED_TYPES = ("DEEPSPEED", "FSDP", "MEGATRON_LM", "XLA")
_PREPARED = "_infinity_engine_modules"  # the Accelerator attribute listing what prepare() built


def _check_accelerator(accelerator: Any) -> None:
    kind = getattr(getattr(accelerator, "distributed_type", None), "name", None)
    if kind is None or not hasattr(accelerator, "prepare"):
        raise TypeError(
            f"prepare() takes an accelerate.Accelerator first, not {type(accelerator).__name__}"
        )
    if kind in _REFUSED_TYPES:
        raise ValueError(
            f"this Accelerator runs with distributed_type {kind}: infinity's engine owns the model and "
            "optimizer, so create the Accelerator without a DeepSpeed, FSDP, Megatron or XLA plugin "
            "(Accelerator() or `accelerate launch` with the multi-CPU/GPU config) and pass the DeepSpeed-"
            "style config to prepare(..., config=...)"
        )
    if accelerator.mixed_precision == "fp8":
        raise ValueError(
            "mixed_precision='fp8' is not supported by infinity's engine; use 'bf16', 'fp16' or 'no'"
        )


def _read(config: Any) -> dict[str, Any]:
    if config is None:
        raise TypeError(
            "config= is required: a DeepSpeed-style config dict or the path of its JSON file"
        )
    cfg = _shared.read_config(config)
    assert cfg is not None
    return cfg


def _auto_or_absent(cfg: Mapping[str, Any], key: str) -> bool:
    return key not in cfg or _shared.is_auto(cfg[key])


def _precision(cfg: dict[str, Any], mixed_precision: str) -> dict[str, Any]:
    """Accelerate's ``DeepSpeedPlugin.set_mixed_precision``: the section of the mixed precision is
    added where missing, "auto" ``enabled`` flags take it, another dtype enabled is refused."""
    out: dict[str, Any] = {}
    if mixed_precision in ("fp16", "bf16"):
        other = "bf16" if mixed_precision == "fp16" else "fp16"
        node = _shared.precision_section(cfg, other)
        if node is not None and node.get("enabled") is True:
            raise ValueError(
                f"the Accelerator's mixed_precision is {mixed_precision!r} and the config enables {other}; "
                f"make them agree (Accelerator(mixed_precision={other!r}), or remove the {other} section)"
            )
        if _shared.precision_section(cfg, mixed_precision) is None:
            cfg[mixed_precision] = {"enabled": True}
    for name in ("fp16", "bf16"):
        node = _shared.precision_section(cfg, name)
        if node is not None and _shared.is_auto(node.get("enabled")):
            out[name] = mixed_precision == name
    return out


def _micro_batch(accelerator: Any, dataloader: Any) -> int:
    if dataloader is None:
        raise ValueError(
            'train_micro_batch_size_per_gpu is "auto" and no dataloader was passed: pass the training '
            "dataloader to prepare(), or write train_micro_batch_size_per_gpu in the config"
        )
    batch_size = getattr(dataloader, "batch_size", None)
    if not isinstance(batch_size, int):
        raise ValueError(
            f'train_micro_batch_size_per_gpu is "auto" and the dataloader\'s batch_size is {batch_size!r} '
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
        log.warning(
            "gradient accumulation steps: the Accelerator has %s, the config %s; using the config's "
            "(as Accelerate's DeepSpeed plugin does)",
            accelerator.gradient_accumulation_steps,
            written,
        )
        accelerator.gradient_accumulation_steps = written
    return {}


def auto_values(accelerator: Any, cfg: dict[str, Any], dataloader: Any = None) -> dict[str, Any]:
    """The keyword arguments ``infinity.initialize`` fills the config's "auto" values with, as
    Accelerate's DeepSpeed plugin fills them; adds the mixed precision's section to ``cfg``."""
    values = _precision(cfg, accelerator.mixed_precision)
    if _auto_or_absent(cfg, "train_micro_batch_size_per_gpu"):
        values["train_micro_batch_size_per_gpu"] = _micro_batch(accelerator, dataloader)
    values.update(_accumulation(cfg, accelerator))
    if _shared.is_auto(cfg.get("gradient_clipping")):
        values["gradient_clipping"] = (
            1.0  # Accelerate's default (DeepSpeedPlugin gradient_clipping)
        )
    return values


class EngineOptimizer:
    """The optimizer ``prepare`` returns: ``step()`` is ``engine.step()`` (the update happens at the end
    of each accumulation window), ``zero_grad()`` does nothing (each window starts without gradient),
    as Accelerate's DeepSpeed optimizer wrapper. ``param_groups`` are the engine optimizer's (their lr
    is the schedule's); its state lives in the engine (save it with ``accelerator.save_state``)."""

    def __init__(self, model: _shared.EngineModule):
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
        raise RuntimeError(
            "the optimizer state lives in the infinity engine (partly on NVMe): save it with "
            "accelerator.save_state(dir) after prepare(), or engine.save_checkpoint"
        )

    def load_state_dict(self, state_dict: Any) -> None:
        raise RuntimeError(
            "restore the optimizer state with accelerator.load_state(dir) (the engine's checkpoint)"
        )


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


def _is_dataloader(obj: Any) -> bool:
    return isinstance(obj, DataLoader) or type(obj).__name__.endswith("DataLoader")


def _sort(accelerator: Any, objects: tuple[Any, ...]) -> tuple[nn.Module, Any, Any, list[Any]]:
    """The model, optimizer (torch or DummyOptim), scheduler (torch or DummyScheduler) and
    dataloaders among ``prepare``'s objects, anything else refused naming what to pass instead."""
    models = [o for o in objects if isinstance(o, nn.Module)]
    if len(models) != 1:
        raise TypeError(
            f"prepare() trains one nn.Module per call; got {len(models)} (prepare each model with its "
            "own call, or a frozen one with prepare_frozen)"
        )
    optimizers = [o for o in objects if isinstance(o, (torch.optim.Optimizer, DummyOptim))]
    schedulers = [o for o in objects if isinstance(o, (LRScheduler, DummyScheduler))]
    for found, what in ((optimizers, "optimizer"), (schedulers, "lr scheduler")):
        if len(found) > 1:
            raise TypeError(f"prepare() takes at most one {what} (the engine's); got {len(found)}")
    for i, obj in enumerate(objects):
        if obj is None:
            raise TypeError(
                f"prepare()'s object {i} is None: to train with the config's optimizer or scheduler section, pass "
                "accelerate.utils.deepspeed.DummyOptim(model.parameters(), lr=...) / DummyScheduler(optimizer, ...) in "
                "its place (as with Accelerate's DeepSpeed plugin), or leave it out"
            )
        name = type(obj).__name__
        if name.startswith("Accelerated"):
            raise RuntimeError(
                f"object {i} is an {name} (accelerator.prepare wrapped it): pass the plain torch "
                "object to infinity's prepare()"
            )
        if not (
            isinstance(
                obj, (nn.Module, torch.optim.Optimizer, DummyOptim, LRScheduler, DummyScheduler)
            )
            or _is_dataloader(obj)
        ):
            raise TypeError(
                f"prepare()'s object {i} is a {name}: it takes the model, its optimizer, lr scheduler "
                "and dataloaders"
            )
    model = models[0]
    if isinstance(model, _shared.EngineModule) or _shared.engine_of(model) is not None:
        raise RuntimeError(
            f"this {type(model).__name__} is already trained by an infinity engine; prepare each "
            "model once"
        )
    if any(
        model is m or getattr(m, "module", None) is model
        for m in getattr(accelerator, "_models", [])
    ):
        raise RuntimeError(
            f"this {type(model).__name__} went through accelerator.prepare already: give "
            "infinity's prepare() the plain model (it owns model and optimizer)"
        )
    return (
        model,
        optimizers[0] if optimizers else None,
        schedulers[0] if schedulers else None,
        [o for o in objects if _is_dataloader(o)],
    )


def _placeholder_values(
    accelerator: Any, cfg: Mapping[str, Any], optimizer: Any, scheduler: Any
) -> dict[str, Any]:
    """What Accelerate's DeepSpeed plugin fills from DummyOptim / DummyScheduler (``_prepare_deepspeed``):
    the optimizer section's lr and weight_decay, the WarmupLR family's warmup and total steps."""
    values: dict[str, Any] = {}
    if isinstance(optimizer, DummyOptim):
        if "optimizer" not in cfg:
            raise ValueError(
                "a DummyOptim stands for the config's optimizer section, and the config has none: "
                "pass a torch optimizer, or add an optimizer section"
            )
        values.update(lr=optimizer.lr, weight_decay=optimizer.weight_decay)
    elif "optimizer" in cfg and optimizer is not None:
        raise ValueError(
            "the config has an optimizer section and a torch optimizer was passed: keep one (pass "
            "accelerate.utils.DummyOptim in the optimizer's place to use the config's)"
        )
    if isinstance(scheduler, DummyScheduler):
        if "scheduler" not in cfg:
            raise ValueError(
                "a DummyScheduler stands for the config's scheduler section, and the config has "
                "none: pass a torch lr scheduler, or add a scheduler section"
            )
        if scheduler.lr_scheduler_callable is not None:
            raise ValueError(
                "DummyScheduler(lr_scheduler_callable=...) is not supported: pass the torch lr "
                "scheduler itself"
            )
        values.update(warmup_min_lr=0, warmup_num_steps=max(1, scheduler.warmup_num_steps))
        if scheduler.total_num_steps is not None:
            total = scheduler.total_num_steps
            values["total_num_steps"] = (
                total if accelerator.split_batches else math.ceil(total / accelerator.num_processes)
            )
    return values


def _backward(accelerator: Any, loss: torch.Tensor, **kwargs: Any) -> None:
    """``accelerator.backward(loss)`` after prepare(): the engine's backward ([Note: what prepare patches])."""
    trained = getattr(accelerator, _PREPARED, [])
    if kwargs:
        raise TypeError(
            f"accelerator.backward(loss) on infinity's engine takes no keyword arguments; got "
            f"{sorted(kwargs)}"
        )
    if len(trained) != 1:
        raise RuntimeError(
            f"{len(trained)} models were prepared for training with infinity on this Accelerator: "
            "call model.backward(loss) on the one the loss belongs to"
        )
    trained[0].backward(loss)


def _ours(accelerator: Any, model: Any) -> _shared.EngineModule | None:
    """The prepared wrapper ``model`` is (or whose trained module it is), or None."""
    for em in getattr(accelerator, _PREPARED, []):
        if model is em or model is em.module:
            return em
    return None


def _patch_saving(accelerator: Any) -> None:
    """``unwrap_model``, ``get_state_dict`` and ``save_model`` answer for the engines prepare() built
    and hand everything else to Accelerate's own ([Note: what prepare patches])."""
    unwrap, get_state_dict, save_model = (
        accelerator.unwrap_model,
        accelerator.get_state_dict,
        accelerator.save_model,
    )

    def unwrap_model(
        model: Any, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
    ) -> Any:
        em = _ours(accelerator, model)
        return em.module if em is not None else unwrap(model, keep_fp32_wrapper, keep_torch_compile)

    def gathered_state_dict(model: Any, unwrap: bool = True) -> Any:
        em = _ours(accelerator, model)
        if em is None:
            return get_state_dict(model, unwrap=unwrap)
        state = em.engine.gathered_state_dict()  # the engine's weights, whole, on the CPU
        return (
            state if unwrap else {f"module.{k}": v for k, v in state.items()}
        )  # EngineModule's names

    def streamed_save_model(
        model: Any,
        save_directory: Any,
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        em = _ours(accelerator, model)
        if em is None:
            return save_model(
                model,
                save_directory,
                max_shard_size=max_shard_size,
                safe_serialization=safe_serialization,
            )
        if not safe_serialization:
            raise ValueError(
                "accelerator.save_model(..., safe_serialization=False) writes pickle, which infinity's "
                "engine does not stream: save with safe_serialization=True (safetensors)"
            )
        if os.path.isfile(save_directory):
            raise NotADirectoryError(
                f"accelerator.save_model: {str(save_directory)!r} is a file; pass a directory"
            )
        os.makedirs(save_directory, exist_ok=True)
        # What Accelerate writes (model.safetensors, or shards of max_shard_size and their index; tied
        # weights once), streamed from the engine's units; a transformers model gets its config.json too.
        em.engine.save_16bit_model(save_directory, layout="hf", max_shard_size=max_shard_size)

    accelerator.unwrap_model = unwrap_model
    accelerator.get_state_dict = gathered_state_dict
    accelerator.save_model = streamed_save_model


def _register(accelerator: Any, model: _shared.EngineModule) -> None:
    trained: list[_shared.EngineModule] = getattr(accelerator, _PREPARED, None) or []
    index = len(trained)
    trained.append(model)
    setattr(accelerator, _PREPARED, trained)
    tag = CHECKPOINT_TAG if index == 0 else f"{CHECKPOINT_TAG}_{index}"
    if index == 0:
        accelerator.backward = lambda loss, **kwargs: _backward(accelerator, loss, **kwargs)
        _patch_saving(accelerator)

    def save(models: Any, weights: Any, output_dir: str) -> None:
        model.engine.save_checkpoint(output_dir, tag=tag)

    def load(models: Any, input_dir: str) -> None:
        if not os.path.isdir(os.path.join(input_dir, tag)):
            raise FileNotFoundError(
                f"{input_dir!r} holds no {tag}/: it was not saved by accelerator.save_state "
                "after infinity's prepare() (with as many models prepared)"
            )
        model.engine.load_checkpoint(input_dir, tag=tag)

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)


def prepare(accelerator: Any, *objects: Any, config: Any, **auto: Any) -> Any:
    """``accelerator.prepare(*objects)`` for a model trained by infinity: returns as many objects as it
    is given, in their order (one object bare, as Accelerate returns it). The model (one) and its
    optimizer become an infinity engine (``infinity.initialize(model, config, optimizer,
    lr_scheduler=scheduler)``): the model comes back as the engine's ``EngineModule``, the optimizer as
    ``EngineOptimizer``, the lr scheduler as ``EngineScheduler``; dataloaders go through
    ``accelerator.prepare`` (sharded over the ranks). "auto" values are filled as Accelerate's DeepSpeed
    plugin fills them (the micro-batch from the first dataloader); keyword arguments fill "auto" values
    too (``lr=``, ``warmup_num_steps=``...). Accelerate's ``DummyOptim`` / ``DummyScheduler`` stand for
    the config's optimizer / scheduler sections, as with its DeepSpeed plugin. See the module docstring
    for the loop and what is patched."""
    _check_accelerator(accelerator)
    model, optimizer, scheduler, dataloaders = _sort(accelerator, objects)
    cfg = _read(config)
    values = {
        **auto_values(accelerator, cfg, dataloaders[0] if dataloaders else None),
        **_placeholder_values(accelerator, cfg, optimizer, scheduler),
        **auto,
    }
    engine = _shared.build_engine(
        model,
        cfg,
        optimizer=optimizer if isinstance(optimizer, torch.optim.Optimizer) else None,
        lr_scheduler=scheduler if isinstance(scheduler, LRScheduler) else None,
        **values,
    )
    if not isinstance(engine, Engine):
        engine.close()
        raise ValueError(
            "nothing to train: the config has no optimizer and none was passed (for a frozen "
            "model use prepare_frozen(model, config))"
        )
    fp16 = engine.config.fp16.enabled
    engine.add_step_listener(
        lambda record: accelerator.log(step_metrics(record, fp16=fp16), step=record.step)
    )
    em = _shared.EngineModule(engine)
    _register(accelerator, em)
    # After the engine: a refused config leaves no dataloader registered with the Accelerator.
    prepared_loaders = {id(d): accelerator.prepare(d) for d in dataloaders}
    out: list[Any] = []
    for obj in objects:
        if obj is model:
            out.append(em)
        elif obj is optimizer:
            out.append(EngineOptimizer(em))
        elif obj is scheduler:
            if engine.lr_scheduler is None:
                raise ValueError(
                    "a scheduler was passed and the engine has none: pass a torch lr scheduler, or a "
                    "DummyScheduler with a scheduler section in the config"
                )
            out.append(EngineScheduler(engine.lr_scheduler))
        else:
            out.append(prepared_loaders[id(obj)])
    return out[0] if len(out) == 1 else tuple(out)


def prepare_frozen(
    model: nn.Module, config: Any, *, accelerator: Any = None, **auto: Any
) -> InferenceEngine:
    """A model that is never trained (a distillation teacher): its parameters in stage-3 shards (on NVMe
    where the config's ``offload_param`` says so), no gradient or optimizer state, every forward under
    ``no_grad`` in eval mode: ``infinity.initialize`` without an optimizer, i.e. the inference engine.
    ``accelerator``: fills ``fp16``/``bf16`` "auto" from its ``mixed_precision``; the batch keys
    DeepSpeed demands even here take 1 where "auto"."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"prepare_frozen() takes an nn.Module, not {type(model).__name__}")
    cfg = _read(config)
    if _shared.zero_stage(cfg) != 3:
        raise ValueError(
            f"prepare_frozen serves the model from ZeRO stage-3 shards; the config has stage "
            f"{_shared.zero_stage(cfg)}: set zero_optimization.stage to 3 (with offload_param device 'nvme' "
            "to keep the parameters on NVMe)"
        )
    if "optimizer" in cfg or "scheduler" in cfg:
        raise ValueError(
            "prepare_frozen builds no optimizer: remove the config's optimizer and scheduler "
            "sections (a frozen model has no optimizer state)"
        )
    values: dict[str, Any] = {}
    if accelerator is not None:
        _check_accelerator(accelerator)
        values.update(_precision(cfg, accelerator.mixed_precision))
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if _shared.is_auto(cfg.get(key)):
            values[key] = 1
    model.requires_grad_(False)
    engine = _shared.build_engine(model, copy.deepcopy(cfg), **{**values, **auto})
    assert isinstance(engine, InferenceEngine), (
        "stage 3 without an optimizer builds the inference engine"
    )
    return engine
