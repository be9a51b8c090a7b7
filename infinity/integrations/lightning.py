"""The Lightning Trainer on infinity: ``Trainer(strategy="infinity_stage_3_offload_nvme")``.

``InfinityStrategy`` takes Lightning's ``DeepSpeedStrategy`` keyword arguments with their meanings
(stage, offload_optimizer, offload_parameters, remote_device, offload_*_device, nvme_path, buffer
sizes, max_in_cpu, pin_memory, the aio knobs, the fp16 loss-scale knobs, config=, ...), so code
written against Lightning's DeepSpeed guide runs with the class (or the registered name) swapped.
Importing this module registers ``infinity``, ``infinity_stage_1``, ``infinity_stage_2``,
``infinity_stage_2_offload``, ``infinity_stage_3``, ``infinity_stage_3_offload`` and
``infinity_stage_3_offload_nvme`` (nvme_path ``./infinity_nvme``) in Lightning's StrategyRegistry.

How Lightning's pieces map onto the engine (public API only: ``infinity.initialize``, the engine's
forward/backward/step and checkpoints, ``infinity.zero.Init``, ``GatheredParameters``):
- ``configure_model`` (and the older ``configure_sharded_model``) runs under ``zero.Init``
  (``model_sharded_context``); ``setup`` builds the engine with the optimizer from
  ``configure_optimizers``, whose type and hyper-parameters (param groups) the engine maps onto its
  offloaded Adam. Its lr scheduler stays Lightning's: the engine's optimizer shares the very param
  group dicts, so each scheduler step reaches the engine. A ``scheduler`` section in the config is
  the engine's own, stepped at each update and saved with its checkpoints.
- ``Trainer(accumulate_grad_batches=...)`` and ``gradient_clip_val`` fill the config's
  ``gradient_accumulation_steps`` and ``gradient_clipping``; the engine accumulates and clips
  (``handles_gradient_accumulation``), so Lightning calls ``optimizer_step`` on every batch.
- ``InfinityPrecision``: backward is ``engine.backward``; ``optimizer_step`` runs the closure then
  ``engine.step``; "32-true", "bf16-true" / "bf16-mixed", "16-true" / "16-mixed" train in the
  engine's fp32 / bf16 / fp16 (fp32 master weights). Lightning's own precision plugins, chosen from
  ``Trainer(precision=...)``, become this one. On CPU, Lightning turns "16-mixed" into "bf16-mixed"
  before any strategy sees it; pass ``precision_plugin=InfinityPrecision("16-mixed")`` for fp16.
- Checkpoints (``ModelCheckpoint``, ``trainer.save_checkpoint``, ``fit(ckpt_path=...)``):
  ``engine.save_checkpoint(path, tag="checkpoint", client_state=...)`` with Lightning's checkpoint
  dict (loops, callbacks, lr schedulers, hyper-parameters; not ``state_dict`` and
  ``optimizer_states``, which the engine holds) as the client state; a resume restores the
  engine (weights, Adam moments, step counts, RNG) and hands Lightning back its dict, so training
  continues exactly where it stopped.
- The figures: after each optimizer step of a fit, every logger of the Trainer
  (``trainer.loggers``) gets ``log_metrics`` of the engine's step record
  (``infinity.monitor.step_metrics``: step time, exposed I/O, NVMe bytes and
  GB/s, prefetch outcomes, pools, peak host memory, forward/backward/step
  times, and DeepSpeed's ``Train/Samples/*`` loss and lr) at the Trainer's
  ``global_step``.
- One engine per module: validate/test/predict after fit use the fitted engine; a module set up by
  another Trainer's engine is refused for a new fit (under stage 3 only that engine holds the
  weights).

Runs on CPU (gloo) and CUDA (NCCL), one process or several (Lightning's DDP launchers). Nothing
here imports deepspeed. Threading: Lightning's training thread only.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Generator, Mapping
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import (
    DeepSpeedPrecision,
    HalfPrecision,
    MixedPrecision,
    Precision,
)
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import WarningCache, rank_zero_info, rank_zero_warn
from torch.optim import LBFGS

from infinity.engine import Engine, StepRecord
from infinity.integrations import _lightning_shared as lightning_shared
from infinity.integrations import _shared
from infinity.monitor import step_metrics

__all__ = ["InfinityPrecision", "InfinityStrategy"]

log = logging.getLogger("infinity.integrations")
_warnings = WarningCache()  # each says its piece once


class InfinityPrecision(Precision):
    """Precision plugin for InfinityStrategy: the engine does backward, step and the dtype.

    ``precision``: "32-true", "bf16-true", "bf16-mixed", "16-true" or "16-mixed". The 16-bit ones
    train the module in that dtype with fp32 master weights (DeepSpeed's bf16 / fp16 modes, fp16
    with dynamic loss scaling); floating-point inputs and buffers are cast to it.
    """

    def __init__(self, precision: str = "32-true") -> None:
        self._dtype, _ = lightning_shared.check_precision(precision, "InfinityStrategy")
        self.precision = precision  # type: ignore[assignment]

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return lightning_shared.cast_floating_buffers(module, self._dtype)

    def convert_input(self, data: Any) -> Any:
        return lightning_shared.convert_floats(data, self._dtype)

    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        return (
            lightning_shared.default_dtype(self._dtype)
            if self.precision.endswith("-true")
            else contextlib.nullcontext()
        )

    def module_init_context(self) -> contextlib.AbstractContextManager:
        return self.tensor_init_context()

    def backward(
        self,
        tensor: torch.Tensor,
        model: LightningModule,
        optimizer: Any,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        if is_overridden("backward", model):
            _warnings.warn(
                "LightningModule.backward is overridden, but InfinityStrategy runs the engine's backward "
                "instead (it scales, reduces and offloads the gradients)"
            )
        trainer = model.trainer
        if model.automatic_optimization and trainer.accumulate_grad_batches > 1:
            # Lightning's automatic optimization hands backward loss / accumulate_grad_batches, and the
            # engine divides by gradient_accumulation_steps (the same number) itself: undone here, so
            # the gradients are plain Lightning's.
            tensor = tensor * trainer.accumulate_grad_batches
        _strategy_of(model).engine_module.backward(tensor)

    def optimizer_step(
        self, optimizer: Any, model: LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if isinstance(optimizer, LBFGS):
            raise MisconfigurationException(
                "LBFGS re-evaluates the loss inside its step, which the engine's "
                "offloaded Adam cannot do; use Adam or AdamW with InfinityStrategy"
            )
        result = closure()
        self._after_closure(model, optimizer)
        if model.automatic_optimization and result is None:
            raise MisconfigurationException(
                "training_step returned None (skipping backward), which InfinityStrategy cannot do: the engine "
                "counts every batch towards its accumulation window; return the loss"
            )
        _strategy_of(model).engine_module.step()
        return result

    def clip_gradients(
        self,
        optimizer: Any,
        clip_val: float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """The engine clips (the config's gradient_clipping, set from Trainer(gradient_clip_val=...))."""


def _strategy_of(model: LightningModule) -> InfinityStrategy:
    strategy = model.trainer.strategy
    if not isinstance(strategy, InfinityStrategy):
        raise TypeError(
            f"InfinityPrecision works with InfinityStrategy; this Trainer's strategy is a "
            f"{type(strategy).__name__}"
        )
    return strategy


def _as_infinity_precision(plugin: Precision | None) -> InfinityPrecision | None:
    """Lightning picks a precision plugin from Trainer(precision=...) before it hands it to the
    strategy; the stock ones become InfinityPrecision with the same precision name."""
    if plugin is None or isinstance(plugin, InfinityPrecision):
        return plugin
    if type(plugin) in (Precision, HalfPrecision, MixedPrecision, DeepSpeedPrecision):
        return InfinityPrecision(plugin.precision)
    raise ValueError(
        f"InfinityStrategy cannot use the precision plugin {type(plugin).__name__} (precision "
        f"{getattr(plugin, 'precision', '?')!r}): the engine trains in {', '.join(lightning_shared.PRECISIONS)}; pass "
        "Trainer(precision=...) with one of those"
    )


class InfinityStrategy(DDPStrategy):
    """Lightning's DeepSpeedStrategy, running on infinity's engine. Arguments as DeepSpeedStrategy's.

    Knobs left at None take the engine's defaults: DeepSpeed's config defaults (``params_buffer_count``
    5, ``params_buffer_size`` 1e8, ``max_in_cpu`` 1e9 elements kept in host memory before NVMe, ...),
    and for the aio knobs infinity's own (measured: ``infinity tune nvme``). The signature is
    DeepSpeedStrategy's, hence its length.
    ``nvme_path`` defaults to ``./infinity_nvme`` (each rank swaps under ``rank<N>/`` there). The
    Lightning 1.x names in older guides are accepted: ``cpu_offload`` (= ``offload_optimizer``),
    ``cpu_offload_params`` (= ``offload_parameters``), ``cpu_offload_use_pin_memory`` (= ``pin_memory``).
    ``start_method``: Lightning's DDP launcher ("popen" runs the script once per device).
    """

    strategy_name = "infinity"

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
        logging_batch_size_per_gpu: str | int = "auto",
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
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        exclude_frozen_parameters: bool = False,
        start_method: str = "popen",
        cpu_offload: bool | None = None,
        cpu_offload_params: bool | None = None,
        cpu_offload_use_pin_memory: bool | None = None,
    ) -> None:
        args = dict(
            locals()
        )  # DeepSpeedStrategy's keyword arguments, for lightning_shared.configure_strategy
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,  # type: ignore[arg-type]
        )
        for name, alias in (
            ("offload_optimizer", cpu_offload),
            ("offload_parameters", cpu_offload_params),
            ("pin_memory", cpu_offload_use_pin_memory),
        ):  # Lightning 1.x's names
            if alias is not None:
                args[name] = alias
        lightning_shared.configure_strategy(self, args)
        self._engine_module: _shared.EngineModule | None = None

    # -- precision -------------------------------------------------------------------

    @property
    def precision_plugin(self) -> InfinityPrecision:
        plugin = self._precision_plugin
        return plugin if plugin is not None else InfinityPrecision()  # type: ignore[return-value]

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = _as_infinity_precision(plugin)

    # -- the engine --------------------------------------------------------------------

    @property
    def engine(self) -> Engine | None:
        """The engine training this strategy's module (None before ``setup``)."""
        return self._engine_module.engine if self._engine_module is not None else None

    @property
    def engine_module(self) -> _shared.EngineModule:
        if self._engine_module is None:
            raise RuntimeError(
                "InfinityStrategy has no engine yet: it is built when the Trainer sets up "
                "(trainer.fit/validate/test/predict)"
            )
        return self._engine_module

    @property
    def zero_stage_3(self) -> bool:
        return _shared.zero_stage(self.config) == 3

    @property
    def handles_gradient_accumulation(self) -> bool:
        return True

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # The engine loads into itself, so it must exist first. A single-file checkpoint
        # (load_full_weights) under stages 0-2 loads into the whole module before the engine is built.
        return not (self.load_full_weights and not self.zero_stage_3)

    @property
    def lightning_restore_optimizer(self) -> bool:
        if self.load_full_weights and self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            rank_zero_warn(
                "load_full_weights=True: the file's weights are loaded, the optimizer starts afresh "
                "(a single-file checkpoint holds no offloaded optimizer state)"
            )
        return False

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def setup_environment(self) -> None:
        devices = self.parallel_devices or []
        if (
            devices
            and devices[0].type == "cuda"
            and [d.index for d in devices] != list(range(len(devices)))
        ):
            raise RuntimeError(
                f"InfinityStrategy runs rank r on cuda:r, and devices {[d.index for d in devices]} were selected; "
                "select GPUs with CUDA_VISIBLE_DEVICES instead (e.g. CUDA_VISIBLE_DEVICES="
                f"{','.join(str(d.index) for d in devices)})"
            )
        super().setup_environment()

    def _format_config(self) -> None:
        """Fills what the Trainer decides into the config, once (DeepSpeed's ``_format_config``)."""
        if self._config_formatted:
            return
        module = self.lightning_module
        trainer = module.trainer if module is not None else None
        cfg = self.config
        if trainer is not None:
            lightning_shared.fill(
                cfg,
                "gradient_accumulation_steps",
                trainer.accumulate_grad_batches,
                source=f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches})",
            )
            if trainer.gradient_clip_val is not None:
                lightning_shared.fill(
                    cfg,
                    "gradient_clipping",
                    float(trainer.gradient_clip_val),
                    source=f"Trainer(gradient_clip_val={trainer.gradient_clip_val})",
                )
            if _shared.is_auto(cfg.get("train_micro_batch_size_per_gpu", "auto")):
                cfg["train_micro_batch_size_per_gpu"] = self._auto_select_batch_size(trainer)
        lightning_shared.add_precision(
            cfg, self.precision_plugin.precision, strategy="InfinityStrategy", fp16=self._fp16
        )
        self._config_formatted = trainer is not None

    @staticmethod
    def _auto_select_batch_size(trainer: Trainer) -> int:
        """The train loader's batch size (only the config's batch arithmetic and the memory estimate
        read it), else 1, as DeepSpeedStrategy does."""
        source = trainer.fit_loop._data_source
        if source.is_defined():
            sampler = getattr(source.dataloader(), "batch_sampler", None)
            if getattr(sampler, "batch_size", None):
                return int(sampler.batch_size)
        return 1

    def setup(self, trainer: Trainer) -> None:
        self._format_config()
        if trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            raise MisconfigurationException(
                "InfinityStrategy clips the gradient norm (the engine's "
                "gradient_clipping); Trainer(gradient_clip_algorithm='value') is not "
                "supported: use 'norm'"
            )
        if self._layer_sync is not None:
            raise MisconfigurationException(
                "Trainer(sync_batchnorm=True) is not supported by InfinityStrategy (the "
                "engine partitions the module as it is; DeepSpeedStrategy ignores the "
                "flag): remove it, or convert the BatchNorm layers before fit"
            )
        if is_overridden("configure_gradient_clipping", self.lightning_module, LightningModule):
            rank_zero_warn(
                "LightningModule.configure_gradient_clipping is overridden, but the engine clips by "
                "Trainer(gradient_clip_val=...) itself; the hook is called and clips nothing"
            )
        self.accelerator.setup(trainer)
        module = self.lightning_module
        self.model = self.precision_plugin.convert_module(module)
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._engine_module = _shared.EngineModule(self._engine_for(module, fitting, trainer))
        self.model = self._engine_module
        self.setup_precision_plugin()
        self.barrier()

    def _engine_for(self, module: LightningModule, fitting: bool, trainer: Trainer) -> Engine:
        existing = _shared.engine_of(module)
        if existing is not None and (not fitting or (self.engine is existing)):
            return existing  # evaluation after fit, or fit again with this Trainer: the engine carries on
        if not fitting:
            return _shared.build_engine(module, lightning_shared.evaluation_config(self.config))
        if "optimizer" in self.config:
            rank_zero_info(
                "the config has an 'optimizer' section: it is used, and configure_optimizers is not called"
            )
            self.optimizers, self.lr_scheduler_configs = [], []
            engine = _shared.build_engine(module, self.config)
        else:
            super().setup_optimizers(trainer)  # configure_optimizers
            if len(self.optimizers) != 1:
                raise MisconfigurationException(
                    f"InfinityStrategy trains with one optimizer; configure_optimizers returned {len(self.optimizers)}"
                )
            engine = _shared.build_engine(module, self.config, optimizer=self.optimizers[0])
        # Lightning steps the user's lr scheduler; it moves the shared param group dicts.
        self.optimizers = [engine.optimizer]
        fp16 = engine.config.fp16.enabled
        engine.add_step_listener(lambda record: _log_step(trainer, record, fp16=fp16))
        return engine

    def on_train_start(self) -> None:
        trainer = self.lightning_module.trainer
        batches, window = trainer.num_training_batches, trainer.accumulate_grad_batches
        if window > 1 and batches != float("inf") and batches % window:
            rank_zero_warn(
                f"an epoch has {batches} batches, not a multiple of accumulate_grad_batches={window}: the engine "
                "carries its accumulation window over the epoch's end (as DeepSpeed does), where Lightning's other "
                "strategies update on the epoch's last batch; make the batches a multiple of it to train as they do"
            )
        super().on_train_start()

    def setup_optimizers(self, trainer: Trainer) -> None:
        """The optimizer is set up with the engine, in ``setup``."""

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def model_to_device(self) -> None:
        """The engine places the parameters (its units, on the compute device as they are used)."""

    def teardown(self) -> None:
        # Not Strategy.teardown's lightning_module.cpu(): the engine owns where the parameters live,
        # and keeps them for evaluation after fit.
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # -- building the model ------------------------------------------------------------------

    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        if self.zero_stage_3:
            if empty_init is False:
                raise ValueError(
                    "empty_init=False cannot be honoured under stage 3 (zero.Init partitions the "
                    "parameters as they are built); leave empty_init unset"
                )
            yield
            return
        with super().tensor_init_context(empty_init=empty_init):
            yield

    @contextlib.contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """configure_model / configure_sharded_model run under ``infinity.zero.Init`` at stage 3."""
        self._format_config()
        with lightning_shared.sharded_context(self.config, self.remote_device, self.nvme_path):
            yield

    # -- checkpoints -------------------------------------------------------------------

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Empty: the checkpoint's weights are the engine's (save_checkpoint drops the "state_dict"
        entry); the module's state_dict() would gather the whole model into host memory for nothing
        ([Note: saving a partitioned model] in infinity/engine/saving.py)."""
        return {}

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                "Trainer.save_checkpoint(..., storage_options=...) is not supported by InfinityStrategy: "
                "the engine writes the checkpoint itself, without a CheckpointIO"
            )
        filepath = self.broadcast(filepath)
        client_state = {
            k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")
        }
        _shared.save_client_state(
            self.engine_module.engine, filepath, client_state, what="Lightning checkpoint"
        )

    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if self.load_full_weights:
            return super().load_checkpoint(self.broadcast(checkpoint_path), weights_only)
        _shared.check_checkpoint_dir(
            checkpoint_path,
            single_file_hint=("load it with InfinityStrategy(load_full_weights=True)"),
        )
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        client_state = self.engine_module.engine.load_checkpoint(
            checkpoint_path,
            tag=_shared.TAG,
            load_optimizer_states=fitting,
            load_lr_scheduler_states=fitting,
            load_module_only=not fitting,
        )
        if not isinstance(client_state, dict):
            raise MisconfigurationException(
                f"{str(checkpoint_path)!r} is an infinity checkpoint without Lightning's "
                "state; resume from a checkpoint a Trainer saved"
            )
        return client_state

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """The engine loaded the weights in ``load_checkpoint``; a single file (load_full_weights) is
        read here: into the whole module before the engine exists (stages 0-2), or module by module
        into the stage-3 shards through GatheredParameters."""
        if not self.load_full_weights:
            return
        if not self.zero_stage_3:
            super().load_model_state_dict(checkpoint, strict=strict)
            return
        lightning_shared.load_gathered(
            self.lightning_module,
            checkpoint["state_dict"],
            strict=strict,
            rank=self.global_rank,
            broadcast=self.broadcast,
        )

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """The engine restored the optimizer in ``load_checkpoint``."""

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The engine saves the optimizer; Lightning's checkpoint dict carries none."""
        return {}

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        lightning_shared.register_names(strategy_registry, cls)


lightning_shared.register_names(StrategyRegistry, InfinityStrategy)


def _log_step(trainer: Trainer, record: StepRecord, *, fp16: bool) -> None:
    """One optimizer step's figures to each of the Trainer's loggers (their own rank-zero rule)."""
    if not trainer.loggers:
        return
    metrics = step_metrics(record, fp16=fp16)
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)
