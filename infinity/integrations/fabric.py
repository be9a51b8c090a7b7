"""Lightning Fabric on infinity: ``Fabric(strategy=InfinityFabricStrategy(stage=3, ...))``.

``InfinityFabricStrategy`` takes Fabric's ``DeepSpeedStrategy`` keyword arguments with their
meanings; importing this module registers the ``infinity*`` names (those of Fabric's DeepSpeed
strategies, "deepspeed" spelt "infinity") in Fabric's strategy registry. The loop is Fabric's:

    fabric = Fabric(strategy=InfinityFabricStrategy(stage=3, offload_parameters=True, ...))
    fabric.launch()
    with fabric.init_module():              # stage 3: infinity.zero.Init
        model = MyModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model, optimizer = fabric.setup(model, optimizer)   # infinity.initialize
    loss = model(batch); fabric.backward(loss); optimizer.step()   # engine.backward / engine.step
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": step})
    fabric.load(path, state)                # restores the engine, returns what state did not take

How Fabric's pieces map onto the engine:
- ``fabric.setup(model, optimizer, scheduler=...)``: ``infinity.initialize(model, config,
  optimizer=..., lr_scheduler=...)``; the optimizer's type and param groups become the engine's
  offloaded Adam (the returned optimizer is the engine's, sharing the param group dicts), and the
  scheduler is stepped by the engine at each update, as DeepSpeed's engine does.
- ``optimizer.step()`` after every ``fabric.backward`` is ``engine.step()``: accumulation is the
  config's ``gradient_accumulation_steps`` (the engine updates once per window), clipping its
  ``gradient_clipping``. ``fabric.no_backward_sync`` and ``fabric.clip_gradients`` are refused with
  that advice, as a second backward before a step is (see [Note: one backward per step]).
- ``fabric.save(path, state)``: ``engine.save_checkpoint(path, tag="checkpoint", client_state=...)``
  with everything in ``state`` but the model and its optimizer (stateful objects as their
  state_dict). ``fabric.load(path, state)`` restores the engine (weights; Adam and the schedule
  when the optimizer is in ``state``; step counts and RNG) and moves the client state into
  ``state``: a resumed loop continues exactly.
- Precisions "32-true", "bf16-true" / "bf16-mixed", "16-true" / "16-mixed": the engine's fp32 /
  bf16 / fp16 with fp32 masters. Fabric's stock precision plugins become InfinityFabricPrecision.

Nothing here imports deepspeed. Threading: the training thread only.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import (
    DeepSpeedPrecision,
    HalfPrecision,
    MixedPrecision,
    Precision,
)
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl, _Sharded
from lightning.fabric.utilities.load import _move_state_into
from torch import nn

from infinity.engine import Engine, StepRecord
from infinity.integrations import _lightning_shared as lightning_shared
from infinity.integrations import _shared
from infinity.monitor import step_metrics

__all__ = ["InfinityFabricPrecision", "InfinityFabricStrategy", "log_steps"]

log = logging.getLogger("infinity.integrations")

_ACCUMULATE = (
    "the engine accumulates gradients itself: set gradient_accumulation_steps in the config and call "
    "optimizer.step() after every fabric.backward() (the engine updates the weights once per window)"
)


class InfinityFabricPrecision(Precision):
    """Precision plugin for InfinityFabricStrategy: "32-true", "bf16-true", "bf16-mixed", "16-true" or
    "16-mixed". The 16-bit ones train the module in that dtype with fp32 master weights; floating
    inputs and buffers are cast to it, outputs back to the default dtype."""

    def __init__(self, precision: str = "32-true") -> None:
        self._dtype, _ = lightning_shared.check_precision(precision, "InfinityFabricStrategy")
        self.precision = precision  # type: ignore[assignment]

    def convert_module(self, module: nn.Module) -> nn.Module:
        return lightning_shared.cast_floating_buffers(module, self._dtype)

    def convert_input(self, data: Any) -> Any:
        return lightning_shared.convert_floats(data, self._dtype)

    def convert_output(self, data: Any) -> Any:
        return lightning_shared.convert_floats(data, torch.get_default_dtype())

    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        return (
            lightning_shared.default_dtype(self._dtype)
            if self.precision.endswith("-true")
            else contextlib.nullcontext()
        )

    def module_init_context(self) -> contextlib.AbstractContextManager:
        return self.tensor_init_context()

    def backward(
        self, tensor: torch.Tensor, model: nn.Module | None, *args: Any, **kwargs: Any
    ) -> None:
        if not isinstance(model, _shared.EngineModule):
            raise TypeError(
                "InfinityFabricPrecision back-propagates through the engine of a model set up with "
                "InfinityFabricStrategy; pass that model: fabric.backward(loss, model=model)"
            )
        model.backward(tensor)


def _as_infinity_precision(plugin: Precision | None) -> InfinityFabricPrecision | None:
    if plugin is None or isinstance(plugin, InfinityFabricPrecision):
        return plugin
    if type(plugin) in (Precision, HalfPrecision, MixedPrecision, DeepSpeedPrecision):
        return InfinityFabricPrecision(plugin.precision)
    raise ValueError(
        f"InfinityFabricStrategy cannot use the precision plugin {type(plugin).__name__} (precision "
        f"{getattr(plugin, 'precision', '?')!r}): the engine trains in {', '.join(lightning_shared.PRECISIONS)}; pass "
        "Fabric(precision=...) with one of those"
    )


class _EngineAccumulation(_BackwardSyncControl):
    """``fabric.no_backward_sync``: there is no synchronisation to skip, the engine accumulates."""

    def no_backward_sync(
        self, module: nn.Module, enabled: bool
    ) -> contextlib.AbstractContextManager:
        if enabled:
            raise RuntimeError(
                f"fabric.no_backward_sync(..., enabled=True) with InfinityFabricStrategy: {_ACCUMULATE}"
            )
        return contextlib.nullcontext()


class InfinityFabricStrategy(DDPStrategy, _Sharded):
    """Fabric's DeepSpeedStrategy, running on infinity's engine. Arguments as Fabric's DeepSpeedStrategy's
    (knobs left at None take the engine's defaults: DeepSpeed's, the aio ones infinity's own;
    ``nvme_path`` defaults to ``./infinity_nvme``). ``load_full_weights=True`` (stage 3):
    ``fabric.load`` reads a single-file checkpoint of the whole model into the shards."""

    def __init__(
        self,
        accelerator: Any = None,
        zero_optimization: bool = True,
        stage: int = 2,
        remote_device: str | None = None,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        offload_params_device: str = "cpu",
        nvme_path: str = _shared.DEFAULT_NVME_PATH,
        params_buffer_count: int | None = None,
        params_buffer_size: int | None = None,
        max_in_cpu: int | None = None,
        offload_optimizer_device: str = "cpu",
        optimizer_buffer_count: int | None = None,
        block_size: int | None = None,
        queue_depth: int | None = None,
        single_submit: bool | None = None,
        overlap_events: bool | None = None,
        thread_count: int | None = None,
        pin_memory: bool = False,
        sub_group_size: int | None = None,
        contiguous_gradients: bool | None = None,
        overlap_comm: bool | None = None,
        allgather_partitions: bool | None = None,
        reduce_scatter: bool | None = None,
        allgather_bucket_size: int | None = None,
        reduce_bucket_size: int | None = None,
        zero_allow_untested_optimizer: bool | None = None,
        logging_batch_size_per_gpu: int | None = None,
        config: Any = None,
        logging_level: int = logging.WARN,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        loss_scale: float = 0,
        initial_scale_power: int = 16,
        loss_scale_window: int = 1000,
        hysteresis: int = 2,
        min_loss_scale: int = 1,
        partition_activations: bool = False,
        cpu_checkpointing: bool = False,
        contiguous_memory_optimization: bool = False,
        synchronize_checkpoint_boundary: bool = False,
        load_full_weights: bool = False,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        exclude_frozen_parameters: bool = False,
        start_method: str = "popen",
    ) -> None:
        args = dict(
            locals()
        )  # DeepSpeedStrategy's keyword arguments, for lightning_shared.configure_strategy
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,  # type: ignore[arg-type]
        )
        self._backward_sync_control = _EngineAccumulation()
        lightning_shared.configure_strategy(self, args)
        self._engine_modules: list[_shared.EngineModule] = []

    # -- precision ---------------------------------------------------------------------

    @property
    def precision(self) -> InfinityFabricPrecision:
        plugin = self._precision
        return plugin if plugin is not None else InfinityFabricPrecision()  # type: ignore[return-value]

    @precision.setter
    def precision(self, plugin: Precision | None) -> None:
        self._precision = _as_infinity_precision(plugin)

    # -- set-up ------------------------------------------------------------------------

    @property
    def zero_stage_3(self) -> bool:
        return _shared.zero_stage(self.config) == 3

    @property
    def model(self) -> _shared.EngineModule | None:
        """The last model set up (Fabric's DeepSpeed strategy calls it its engine)."""
        return self._engine_modules[-1] if self._engine_modules else None

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def _setup_distributed(self) -> None:
        super()._setup_distributed()
        self._format_config()

    def _format_config(self) -> None:
        if self._config_formatted:
            return
        if _shared.is_auto(self.config.get("train_micro_batch_size_per_gpu", "auto")):
            self.config["train_micro_batch_size_per_gpu"] = 1
        lightning_shared.add_precision(
            self.config,
            self.precision.precision,
            strategy="InfinityFabricStrategy",
            fp16=self._fp16,
        )
        self._config_formatted = True

    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[torch.optim.Optimizer], scheduler: Any = None
    ) -> tuple[nn.Module, list[torch.optim.Optimizer], Any]:
        if len(optimizers) != 1:
            raise ValueError(
                f"InfinityFabricStrategy trains one module with one optimizer; got {len(optimizers)} "
                "optimizers (set up each model with its own optimizer)"
            )
        self._format_config()
        engine = _shared.build_engine(
            module, self.config, optimizer=optimizers[0], lr_scheduler=scheduler
        )
        return self._keep(engine), [engine.optimizer], scheduler

    def setup_module(self, module: nn.Module) -> nn.Module:
        """A module without an optimizer (evaluation): the engine that already trains it, or a new one."""
        self._format_config()
        engine = _shared.engine_of(module) or _shared.build_engine(
            module, lightning_shared.evaluation_config(self.config)
        )
        return self._keep(engine)

    def _keep(self, engine: Engine) -> _shared.EngineModule:
        em = _shared.EngineModule(engine)
        self._engine_modules.append(em)
        return em

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        raise RuntimeError(
            "InfinityFabricStrategy sets up the model and its optimizer together: "
            "model, optimizer = fabric.setup(model, optimizer)"
        )

    def module_to_device(self, module: nn.Module) -> None:
        """The engine places the parameters (its units, on the compute device as they are used)."""

    def module_init_context(
        self, empty_init: bool | None = None
    ) -> contextlib.AbstractContextManager:
        """``fabric.init_module()``: under stage 3, ``infinity.zero.Init`` (modules built inside go
        straight to their shards), in the "-true" precisions' dtype."""
        if not self.zero_stage_3:
            return super().module_init_context(empty_init=empty_init)
        if empty_init is False:
            raise ValueError(
                "empty_init=False cannot be honoured under stage 3 (zero.Init partitions the "
                "parameters as they are built); leave empty_init unset"
            )
        stack = contextlib.ExitStack()
        stack.enter_context(self.precision.module_init_context())
        stack.enter_context(self.module_sharded_context())
        return stack

    def module_sharded_context(self) -> contextlib.AbstractContextManager:
        self._format_config()
        return lightning_shared.sharded_context(self.config, self.remote_device, self.nvme_path)

    # -- the step ------------------------------------------------------------------------

    def _engine_module(self, module: nn.Module | None) -> _shared.EngineModule:
        if isinstance(module, _shared.EngineModule):
            return module
        if module is None and len(self._engine_modules) == 1:
            return self._engine_modules[0]
        if module is None and not self._engine_modules:
            raise RuntimeError(
                "no model is set up: call model, optimizer = fabric.setup(model, optimizer) first"
            )
        raise ValueError(
            "several models are set up with InfinityFabricStrategy: say which one, "
            "fabric.backward(loss, model=model)"
        )

    def backward(
        self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, **kwargs: Any
    ) -> None:
        em = self._engine_module(module)
        self.precision.pre_backward(tensor, em)
        self.precision.backward(tensor, em, *args, **kwargs)
        self.precision.post_backward(tensor, em)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """``optimizer.step()``: the step of the engine whose optimizer it is (after its closure, if any)."""
        closure: Callable[[], Any] | None = kwargs.pop("closure", None)
        if kwargs:
            raise TypeError(f"optimizer.step() takes only a closure here; got {sorted(kwargs)}")
        for em in self._engine_modules:
            if em.engine.optimizer is optimizer:
                result = None
                if closure is not None:
                    with torch.enable_grad():
                        result = closure()
                em.step()
                return result
        raise ValueError(
            "this optimizer was not set up with InfinityFabricStrategy: use the optimizer that "
            "fabric.setup(model, optimizer) returned"
        )

    def clip_gradients_norm(
        self,
        module: Any,
        optimizer: Any,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        raise RuntimeError(
            "the engine clips the gradient norm itself at each update: set gradient_clipping in the "
            "config instead of calling fabric.clip_gradients"
        )

    def clip_gradients_value(self, module: Any, optimizer: Any, clip_val: float | int) -> None:
        raise RuntimeError(
            "the engine clips the gradient norm (the config's gradient_clipping); clipping by value "
            "is not supported"
        )

    # -- checkpoints -------------------------------------------------------------------

    def _the_engine_module(self, state: Mapping[str, Any], verb: str) -> _shared.EngineModule:
        found = [v for v in state.values() if isinstance(v, _shared.EngineModule)]
        if len(found) != 1:
            raise ValueError(
                f"fabric.{verb}(path, state) with InfinityFabricStrategy needs exactly one model set up by it in "
                f"state (found {len(found)}): state={{'model': model, 'optimizer': optimizer, ...}}; save each "
                "model under its own path"
            )
        return found[0]

    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Any = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                "fabric.save(..., storage_options=...) is not supported by InfinityFabricStrategy: the "
                "engine writes the checkpoint itself"
            )
        if filter is not None:
            raise TypeError(
                "fabric.save(..., filter=...) is not supported by InfinityFabricStrategy: the engine "
                "saves its whole training state"
            )
        em = self._the_engine_module(state, "save")
        path = self.broadcast(path)
        rest = {k: v for k, v in state.items() if v is not em and v is not em.engine.optimizer}
        rest = self._convert_stateful_objects_in_state(rest, filter={})
        _shared.save_client_state(em.engine, path, rest, what="Fabric state")

    def load_checkpoint(
        self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if isinstance(state, (nn.Module, torch.optim.Optimizer)) or not state:
            raise ValueError(
                "fabric.load(path, state) with InfinityFabricStrategy needs the state to restore "
                "into: state={'model': model, 'optimizer': optimizer, ...}"
            )
        em = self._the_engine_module(state, "load")
        if self.load_full_weights:
            return self._load_full_weights(path, state, em, strict, weights_only)
        _shared.check_checkpoint_dir(
            path, single_file_hint="load it with InfinityFabricStrategy(load_full_weights=True)"
        )
        with_optimizer = any(v is em.engine.optimizer for v in state.values())
        client_state = em.engine.load_checkpoint(
            path,
            tag=_shared.TAG,
            load_optimizer_states=with_optimizer,
            load_lr_scheduler_states=with_optimizer,
            load_module_only=not with_optimizer,
        )
        if not isinstance(client_state, dict):
            raise ValueError(
                f"{str(path)!r} is an infinity checkpoint without Fabric's state; load one fabric.save wrote"
            )
        keys = {k for k, v in state.items() if v is not em and v is not em.engine.optimizer}
        if strict and keys - set(client_state):
            raise KeyError(
                f"the checkpoint has no {sorted(keys - set(client_state))}; its keys are "
                f"{sorted(client_state)} (or pass strict=False)"
            )
        _move_state_into(source=client_state, destination=state, keys=keys)
        return client_state

    def _load_full_weights(
        self,
        path: Any,
        state: dict[str, Any],
        em: _shared.EngineModule,
        strict: bool,
        weights_only: bool | None,
    ) -> dict[str, Any]:
        if not self.zero_stage_3:
            raise ValueError(
                "load_full_weights reads a whole-model file into the stage-3 shards; under stages 0-2 "
                "load the weights into the module before fabric.setup(model, optimizer)"
            )
        path = self.broadcast(path)
        checkpoint = torch.load(
            path, map_location="cpu", weights_only=True if weights_only is None else weights_only
        )
        key = next(k for k, v in state.items() if v is em)
        if key in checkpoint:  # fabric.save's layout: {"model": state_dict, ...}
            weights = checkpoint.pop(key)
            others = {k for k, v in state.items() if v is not em and v is not em.engine.optimizer}
            _move_state_into(source=checkpoint, destination=state, keys=others)
        else:  # a bare state_dict
            weights, checkpoint = checkpoint, {}
        lightning_shared.load_gathered(
            em.module, weights, strict=strict, rank=self.global_rank, broadcast=self.broadcast
        )
        return checkpoint

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        lightning_shared.register_names(strategy_registry, cls)


lightning_shared.register_names(STRATEGY_REGISTRY, InfinityFabricStrategy)


def log_steps(fabric: Any, model: nn.Module | None = None) -> None:
    """After each optimizer step of ``model``'s engine, ``fabric.log_dict`` of the step's figures
    (``infinity.monitor.step_metrics``) at ``step`` = the engine's optimizer steps so far: every
    logger given to ``Fabric(loggers=...)`` gets them (each applies its own rank-zero rule), and
    each logger's ``save()`` runs when the engine closes. ``model``: what ``fabric.setup``
    returned, or None when the strategy set up one model. Call it once per model."""
    strategy = fabric.strategy
    if not isinstance(strategy, InfinityFabricStrategy):
        raise TypeError(
            "log_steps(fabric, ...) needs a Fabric whose strategy is InfinityFabricStrategy, got "
            f"{type(strategy).__name__}; Fabric's own strategies have no engine to take figures from"
        )
    if model is None:
        engine = strategy._engine_module(None).engine
    else:
        inner = getattr(model, "module", model)  # fabric.setup's wrapper holds the user's module
        engine = _shared.engine_of(inner) or _shared.engine_of(model)
        if engine is None and isinstance(model, _shared.EngineModule):
            engine = model.engine
        if engine is None:
            raise ValueError(
                f"log_steps(fabric, model): this {type(model).__name__} is not trained by an infinity "
                "engine; pass what model, optimizer = fabric.setup(model, optimizer) returned"
            )
    fp16 = engine.config.fp16.enabled

    def log(record: StepRecord) -> None:
        fabric.log_dict(step_metrics(record, fp16=fp16), step=record.step)

    def save() -> None:
        for logger in fabric.loggers:
            logger.save()

    engine.add_step_listener(log, on_close=save)
