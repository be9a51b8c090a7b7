"""The transformers Trainer on infinity: ``InfinityTrainer(model=..., args=..., infinity_config=...)``.

A ``Trainer`` subclass that trains through an infinity engine where
``TrainingArguments(deepspeed=...)`` would train through DeepSpeed's. How the
Trainer's pieces map onto the engine (public API only: ``infinity.initialize``,
the engine's forward/backward/step, its checkpoints and ``save_pretrained``):

- The config's ``"auto"`` values are filled from ``TrainingArguments`` by the
  table HF's ``HfTrainerDeepSpeedConfig`` uses ([Note: the argument table] in
  infinity/config/arguments.py, through ``training_arguments_values``), with
  the Trainer's count of optimizer steps as ``num_training_steps``; a value the
  config writes that disagrees with ``TrainingArguments`` is refused, naming
  both (HF's ``fill_match``). ``bf16=True`` / ``fp16=True`` with no such section
  in the config adds it, enabled, as Accelerate's DeepSpeed plugin does
  ([Note: the Trainer's precision]).
- The optimizer: a config ``optimizer`` section is the engine's own; without
  one, the Trainer's (``create_optimizer``: ``args.optim``, its decay and
  no-decay param groups, or ``optimizers=``) is mapped onto the engine's
  offloaded Adam, sharing its param group dicts. The schedule: a config
  ``scheduler`` section is the engine's own; without one, the Trainer's
  (``create_scheduler``: ``lr_scheduler_type``, ``warmup_steps``), which the
  engine steps at each update. As HF's DeepSpeed path chooses.
- The training step: with ``gradient_accumulation_steps`` > 1 the window's
  batches, which the Trainer collects before its per-micro-batch loop, run
  through ``engine.train_batch`` at the window's first ``training_step``
  (layer-major: each unit read once per optimizer step), the Trainer's
  ``compute_loss`` as its ``loss_fn``; the Trainer's per-micro-batch calls get
  each micro-batch's loss ([Note: the Trainer's window, layer-major]).
  ``layer_major=False`` (or a window shorter than the config's) runs the
  Trainer's ``compute_loss`` on the engine's forward, the loss normalised as
  the Trainer normalises it, then ``engine.backward`` and ``engine.step`` for
  every micro-batch. The engine accumulates, clips (``gradient_clipping``
  from ``max_grad_norm``) and updates at the window's end, where the Trainer
  calls ``optimizer.step()`` (see [Note: the update the Trainer asks for]).
- Checkpoints go through the Trainer's own flow: ``checkpoint-N/`` holds what
  ``save_model`` writes, the engine checkpoint under ``checkpoint-N/infinity/``
  (weights, Adam moments, schedule, step counts) in place of ``optimizer.pt`` /
  ``scheduler.pt`` (none with ``save_only_model``), and the Trainer's
  ``trainer_state.json`` and RNG states; ``save_total_limit`` rotates them as
  the Trainer does; ``train(resume_from_checkpoint=...)`` restores the engine
  and lets the Trainer skip the batches already seen.
- The logs: every training log (the one with ``loss``) also holds the engine's
  figures of the last optimizer step before it (``infinity.monitor.step_metrics``:
  step time, exposed I/O, NVMe bytes and GB/s, prefetch outcomes, pools, peak
  host memory, the forward/backward/step times), so ``log_history`` and every
  ``report_to`` integration get them.
- ``save_model`` is the Trainer's own: ``model.save_pretrained``, which on the
  engine's model streams the weights (``model.safetensors`` or shards,
  ``config.json``) or, for a PEFT model, writes the adapters as PEFT does
  (``adapter_config.json``, ``adapter_model.safetensors``), see
  [Note: saving a partitioned model] in infinity/engine/saving.py; plus the
  processing class and ``training_args.bin``.

One process (the Trainer's CPU or one GPU); the model is handed to
``initialize`` as built (the Trainer does not move it to the device first: the
engine places its state). Nothing here imports deepspeed. Threading: the
Trainer's training thread only.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import Trainer
from transformers.trainer import TRAINING_ARGS_NAME

import infinity
from infinity.config import ConfigError
from infinity.config.arguments import training_arguments_values
from infinity.engine import Engine, StepRecord
from infinity.integrations._shared import EngineModule, precision_section, read_config
from infinity.monitor import step_metrics

if not hasattr(Trainer, "_prepare_for_training"):
    raise ImportError(
        "infinity.integrations.transformers needs transformers >= 5.23 (it overrides the Trainer's "
        "_prepare_for_training, which older versions do not have): pip install 'infinity-offload"
        "[transformers]'"
    )

log = logging.getLogger("infinity.integrations")

ENGINE_TAG = "infinity"  # the engine checkpoint's folder inside the Trainer's checkpoint-N/

__all__ = ["ENGINE_TAG", "InfinityTrainer", "InfinityTrainerMixin", "infinity_trainer"]


# [Note: the update the Trainer asks for]
# The Trainer calls optimizer.step() once per accumulation window, after the window's last
# micro-batch; the engine counts micro-batches and updates when its count reaches
# gradient_accumulation_steps (the config's is the Trainer's: HF's table). Micro-batch-major,
# training_step calls engine.step() after each backward that is not the window's last (it only
# counts), and EngineOptimizer.step() calls it for the last one (it updates). An epoch's last window
# may be short (k of g batches, the Trainer dividing its losses by k): its first training_step
# counts the g - k micro-batches it lacks first (engine.step() with no backward: a count), so that
# its last backward ends the engine's window too. Layer-major, engine.train_batch updates at the
# window's first training_step and EngineOptimizer.step() only takes that update as the window's
# (``window_stepped``). Either way one update per window, at the Trainer's count; a request at
# another point is an error, never a silent update at another step.


# [Note: the Trainer's precision]
# Under HF's Trainer with DeepSpeed, two layers read TrainingArguments' precision: HF's config table
# fills a bf16 / fp16 section's "auto" and refuses a written value that disagrees (fill_match), and
# Accelerate's DeepSpeed plugin (``DeepSpeedPlugin.set_mixed_precision``, accelerate 1.15) adds a
# missing section enabled for ``mixed_precision`` "bf16" / "fp16", which the Trainer sets from
# ``bf16=`` / ``fp16=``. So ``TrainingArguments(bf16=True)`` trains in bf16 whether the config has
# no bf16 section or one with "auto", and is refused against ``"bf16": {"enabled": false}``. The
# InfinityTrainer does the same: the missing section is added (``precision_sections``) before the
# table fills and checks the config, so the refusal names both settings (the config's bf16.enabled
# and the argument). Without this a config with no section would train in fp32 while the arguments
# asked for bf16, silently. (Accelerate also writes ``auto_cast: true`` into an fp16 section it adds,
# its autocast of the forward; the engine casts the parameters and needs none.)


def precision_sections(config: dict[str, Any], args: Any) -> dict[str, Any]:
    """``config`` with the bf16 / fp16 section ``args`` (TrainingArguments) ask for added, enabled,
    where the config has none ([Note: the Trainer's precision])."""
    out = dict(config)
    for flag in ("bf16", "fp16"):
        if getattr(args, flag, False) and precision_section(out, flag) is None:
            log.info(
                "TrainingArguments(%s=True) and infinity_config has no %s section: training in %s "
                "(the section added, as Accelerate's DeepSpeed plugin adds it)",
                flag,
                flag,
                flag,
            )
            out[flag] = {"enabled": True}
    return out


# [Note: the Trainer's window, layer-major]
# transformers' _run_epoch collects each window's batches (get_batch_samples, with the window's
# num_items_in_batch) before its per-micro-batch loop of training_step(model, inputs,
# num_items_in_batch), then calls optimizer.step(). get_batch_samples keeps the window; the first
# training_step runs the whole window through engine.train_batch (one read of each unit per step)
# with a loss_fn that is the Trainer's own step for one micro-batch: _prepare_inputs, compute_loss
# under compute_loss_context_manager on the engine's module, the normalisation for accumulation
# (num_items_in_batch, or 1/k). Each training_step call, the first included, returns its own
# micro-batch's loss (detached), so tr_loss, floating_point_ops, the input-token count and the
# callbacks (on_step_begin, on_substep_end, ...) see what they see micro-batch-major; what differs:
# the update has happened when the first training_step returns (on_pre_optimizer_step comes after
# it), and compute_loss runs in a micro-batch's thread ([Note: layer-major accumulation] in
# infinity/engine/layer_major.py), the g forwards interleaved before any backward (g micro-batches'
# activations at once). A call that is not the next batch of the window kept (a loop that is not
# the Trainer's) is refused, naming layer_major=False as the way out.


@dataclasses.dataclass
class _Window:
    """The accumulation window the Trainer collected (get_batch_samples)."""

    batches: list[Any]
    num_items: Any
    next: int = 0  # the batch the next training_step is given
    losses: list[torch.Tensor] | None = None  # each batch's loss, once train_batch has run them


class EngineOptimizer:
    """``trainer.optimizer``: ``step()`` is the engine's update; ``param_groups`` are the engine's."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.lr_before_step: list[float] = engine.get_lr()
        self.window_stepped = False  # engine.train_batch updated for the window

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.engine.optimizer.param_groups if self.engine.optimizer is not None else []

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("the engine's update takes no closure")
        if self.window_stepped:  # the window ran layer-major: train_batch made its update
            self.window_stepped = False
            return
        if not self.engine.is_gradient_accumulation_boundary():
            raise RuntimeError(
                f"the Trainer asked for an update at micro-batch {self.engine.micro_steps + 1}, which does not end "
                f"one of the engine's windows of gradient_accumulation_steps="
                f"{self.engine.gradient_accumulation_steps} micro-batches; call optimizer.step() once per window"
            )
        self.lr_before_step = self.engine.get_lr()
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: the engine drops its gradient at each update."""

    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError(
            "the optimizer state is the engine's: it is saved by engine.save_checkpoint (the "
            "Trainer's checkpoints hold it under checkpoint-N/infinity/)"
        )


class EngineSchedule:
    """``trainer.lr_scheduler``: the engine steps its schedule at each update, so ``step()`` does
    nothing; ``get_last_lr()`` is the lr the last update used, as the Trainer logs it."""

    def __init__(self, optimizer: EngineOptimizer):
        self.optimizer = optimizer

    def step(self, *args: Any, **kwargs: Any) -> None:
        pass

    def get_last_lr(self) -> list[float]:
        return list(self.optimizer.lr_before_step)

    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("the lr schedule is the engine's: it is saved by engine.save_checkpoint")


class InfinityTrainerMixin:
    """What makes a ``Trainer`` (or a subclass of it) train through an infinity engine: put before the
    Trainer class in the bases (``InfinityTrainer``; ``infinity_trainer(cls)`` for any subclass)."""

    def __init__(
        self, *args: Any, infinity_config: Any = None, layer_major: bool = True, **kwargs: Any
    ):
        if infinity_config is None:
            raise TypeError(
                "InfinityTrainer needs infinity_config=: a DeepSpeed-style config (a dict or the path "
                "of a JSON file), as TrainingArguments(deepspeed=...) takes"
            )
        self._infinity_config = read_config(infinity_config, argument="infinity_config")
        if not isinstance(layer_major, bool):
            raise TypeError(
                f"layer_major= takes True (accumulate layer-major through engine.train_batch) or "
                f"False (micro-batch by micro-batch); got {layer_major!r}"
            )
        self.layer_major = layer_major
        self._window: _Window | None = None
        self._engine: Engine | None = None
        self._engine_model: EngineModule | None = None
        self._last_record: StepRecord | None = None
        super().__init__(*args, **kwargs)
        self._refuse_unsupported()

    @property
    def engine(self) -> Engine | None:
        return self._engine

    def _refuse_unsupported(self) -> None:
        args = self.args
        if getattr(args, "deepspeed", None):
            raise ValueError(
                "TrainingArguments(deepspeed=...) trains through DeepSpeed; with InfinityTrainer pass "
                "the config as infinity_config= and leave deepspeed unset"
            )
        if args.fsdp:
            raise ValueError(
                "TrainingArguments(fsdp=...) shards with FSDP; InfinityTrainer's engine partitions "
                "the model itself (zero_optimization.stage in infinity_config): leave fsdp unset"
            )
        if self.model_init is not None:
            raise ValueError(
                "model_init= rebuilds the model at every train(); InfinityTrainer builds its engine "
                "once, from the model passed as model="
            )
        if args.load_best_model_at_end:
            raise ValueError(
                "load_best_model_at_end=True is not supported by InfinityTrainer: load the best "
                "checkpoint-N/ with from_pretrained (its weights are in the HF layout)"
            )
        if getattr(args, "activation_offloading", False):
            raise ValueError(
                "activation_offloading=True wraps the Trainer's training_step, which the engine's "
                "takes the place of: leave it unset (the engine's activation_checkpointing section "
                "bounds activation memory)"
            )
        if args.world_size > 1:
            raise ValueError(
                f"InfinityTrainer runs in one process; this run has world_size={args.world_size}"
            )

    # -- building the engine ----------------------------------------------------------

    def _move_model_to_device(self, model: nn.Module, device: Any) -> None:
        """The engine places the model's state (device, host memory or NVMe): not moved here."""

    def _build_engine(self, max_steps: int) -> Engine:
        config = precision_sections(copy.deepcopy(self._infinity_config), self.args)
        values = training_arguments_values(self.args, num_training_steps=max_steps)
        optimizer = None
        if "optimizer" in config and self.optimizer is not None:
            raise ValueError(
                "optimizers= passed an optimizer and infinity_config has an 'optimizer' section; keep "
                "one of them"
            )
        if "optimizer" not in config:
            optimizer = self.create_optimizer()
            # The engine steps in the torch optimizer's place (sharing its param group dicts): torch's
            # LRScheduler would warn at its first step that optimizer.step() never ran.
            optimizer._opt_called = True  # type: ignore[attr-defined]
        scheduler: Any = None
        if "scheduler" not in config:
            if optimizer is not None:
                scheduler = self.create_scheduler(max_steps, optimizer=optimizer)
            else:

                def scheduler(engine_optimizer: torch.optim.Optimizer) -> Any:
                    return self.create_scheduler(max_steps, optimizer=engine_optimizer)
        elif self.lr_scheduler is not None:
            raise ValueError(
                "optimizers= passed an lr scheduler and infinity_config has a 'scheduler' section; "
                "keep one of them"
            )
        try:
            engine = infinity.initialize(
                self.model, config, optimizer=optimizer, lr_scheduler=scheduler, **values
            )
        except ConfigError as e:
            e.add_note(
                "InfinityTrainer passes the TrainingArguments fields HF's DeepSpeed integration reads "
                "(learning_rate, gradient_accumulation_steps, bf16, ...: the table in "
                "infinity/config/arguments.py) to fill infinity_config; where the config writes a value, "
                "it must agree with the field"
            )
            raise
        engine.add_step_listener(self._keep_record)
        self._engine_model = EngineModule(engine)
        self.optimizer = EngineOptimizer(engine)  # type: ignore[assignment]
        self.lr_scheduler = EngineSchedule(self.optimizer)  # type: ignore[assignment]
        return engine

    def _prepare_for_training(
        self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: Any
    ) -> Any:
        """The Trainer's setup with the engine in place of the accelerator-prepared model and optimizer;
        a resume restores the engine from ``checkpoint-N/infinity/``."""
        if self._engine is None:
            self._engine = self._build_engine(max_steps)
        assert self._engine_model is not None
        model = self._engine_model
        self.model_wrapped = model
        if resume_from_checkpoint is not None:
            self._engine.load_checkpoint(
                self._engine_checkpoint(resume_from_checkpoint), tag=ENGINE_TAG
            )
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return model, train_dataloader

    def _wrap_model(
        self, model: nn.Module, training: bool = True, dataloader: Any = None
    ) -> nn.Module:
        # Evaluation after training runs through the engine (under stage 3 only it has the weights).
        return (
            self._engine_model
            if self._engine_model is not None
            else super()._wrap_model(model, training, dataloader)
        )

    # -- the training step ------------------------------------------------------------

    def get_batch_samples(
        self, epoch_iterator: Any, num_batches: int, device: Any
    ) -> tuple[list[Any], Any]:
        """The Trainer's, keeping the window for training_step ([Note: the Trainer's window,
        layer-major])."""
        batches, num_items = super().get_batch_samples(  # type: ignore[misc]
            epoch_iterator, num_batches, device
        )
        self._window = _Window(list(batches), num_items)
        return batches, num_items

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        """The Trainer's step (compute_loss, the loss normalised for accumulation as the Trainer does)
        with the engine in place of ``accelerator.backward``: the whole window through
        ``engine.train_batch`` at its first micro-batch when it accumulates layer-major, else
        ``engine.backward`` for this micro-batch."""
        engine = self._engine
        if engine is None:
            raise RuntimeError(
                "InfinityTrainer.training_step runs inside train(), which builds the engine"
            )
        gas = engine.gradient_accumulation_steps
        window = self._current_window(inputs)
        if window is not None and self.layer_major and gas > 1 and len(window.batches) == gas:
            return self._layer_major_step(engine, model, window, num_items_in_batch)
        if window is not None:
            if window.next == 0 and len(window.batches) < gas:
                # An epoch's short last window: count the micro-batches it lacks first, so that its
                # last backward ends the engine's window ([Note: the update the Trainer asks for]).
                for _ in range(gas - len(window.batches)):
                    engine.step()
            window.next += 1
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        loss = self._normalised(loss, num_items_in_batch)
        # The loss is already the window's share (as with DeepSpeed's scale_wrt_gas=False); the engine
        # divides by gradient_accumulation_steps itself, so it gets the loss times that count.
        engine.backward(loss * gas if gas != 1 else loss)
        if not engine.is_gradient_accumulation_boundary():
            engine.step()  # counts the micro-batch; the window's last is the Trainer's optimizer.step()
        return loss.detach()

    def _current_window(self, inputs: Any) -> _Window | None:
        """The window kept by get_batch_samples if ``inputs`` is its next batch, else None (the
        step then runs micro-batch-major); refused in the middle of a window train_batch ran."""
        window = self._window
        if window is None:
            return None
        if window.next < len(window.batches) and inputs is window.batches[window.next]:
            return window
        if window.losses is not None and window.next < len(window.batches):
            raise RuntimeError(
                f"training_step was given a batch that is not batch {window.next} of the "
                f"accumulation window get_batch_samples collected, whose update engine.train_batch "
                "has already made (layer-major); a loop or subclass that changes the batches "
                "between them trains with InfinityTrainer(..., layer_major=False)"
            )
        if window.next == 0 and self.layer_major and len(window.batches) > 1:
            log.warning(
                "InfinityTrainer: training_step was given a batch that is not the first of the "
                "window get_batch_samples collected (a subclass changed it?): this window runs "
                "micro-batch-major; pass layer_major=False to say so, or hand training_step the "
                "Trainer's batch"
            )
        self._window = None
        return None

    def _normalised(self, loss: torch.Tensor, num_items_in_batch: Any) -> torch.Tensor:
        """The loss as the Trainer's training_step normalises it for accumulation: as it is when
        compute_loss already divided by the window's item count, else over the window's batches."""
        if self.loss_is_scaled_for_ga is not None:
            scaled_for_ga = self.loss_is_scaled_for_ga
        else:
            scaled_for_ga = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or (
                self.compute_loss_func is not None
            )
        return loss if scaled_for_ga else loss / self.current_gradient_accumulation_steps

    def _layer_major_step(
        self, engine: Engine, model: nn.Module, window: _Window, num_items_in_batch: Any
    ) -> torch.Tensor:
        """This micro-batch's loss; the first runs the window through engine.train_batch
        ([Note: the Trainer's window, layer-major])."""
        if window.losses is None:
            gas = engine.gradient_accumulation_steps
            model.train()
            prepared = [self._prepare_inputs(batch) for batch in window.batches]
            normalised: dict[int, torch.Tensor] = {}

            def loss_fn(module: nn.Module, batch: Any) -> torch.Tensor:
                with self.compute_loss_context_manager():
                    loss = self.compute_loss(module, batch, num_items_in_batch=num_items_in_batch)
                loss = self._normalised(loss, num_items_in_batch)
                normalised[id(batch)] = loss.detach()
                return loss * gas  # train_batch divides each by gradient_accumulation_steps

            assert isinstance(self.optimizer, EngineOptimizer)
            self.optimizer.lr_before_step = engine.get_lr()
            engine.train_batch(prepared, loss_fn=loss_fn)
            self.optimizer.window_stepped = True
            window.losses = [normalised[id(batch)] for batch in prepared]
        loss = window.losses[window.next]
        window.next += 1
        return loss

    def _clip_grad_norm(self, model: nn.Module) -> None:
        """The engine clips at its update (``gradient_clipping`` is ``max_grad_norm``)."""
        return None

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> None:
        """Not known before the engine's update; logged from ``engine.last_grad_norm`` after it."""
        return None

    def _maybe_log_save_evaluate(
        self, tr_loss: Any, grad_norm: Any, *args: Any, **kwargs: Any
    ) -> None:
        # The update's gradient norm before clipping, as the Trainer logs clip_grad_norm_'s result.
        if grad_norm is None and self._engine is not None:
            grad_norm = self._engine.last_grad_norm
        super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)

    def _keep_record(self, record: StepRecord) -> None:
        self._last_record = record

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The Trainer's log; a training log (with ``loss``) gains the engine's figures of the last
        optimizer step, under infinity.monitor's names."""
        record = self._last_record
        if record is not None and "loss" in logs:
            fp16 = self._engine is not None and self._engine.config.fp16.enabled
            logs = {**logs, **step_metrics(record, fp16=fp16)}
        super().log(logs, start_time)

    def _get_learning_rate(self) -> float:
        assert isinstance(self.lr_scheduler, EngineSchedule)
        lrs = self.lr_scheduler.get_last_lr()
        return float(lrs[0]) if lrs else 0.0

    # -- checkpoints --------------------------------------------------------------------

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The engine checkpoint (weights, Adam moments, schedule, step counts) in ``output_dir/infinity/``;
        with ``save_on_each_node`` each node writes its own ranks' part of it (node-local, as
        ``checkpoint.use_node_local_storage``)."""
        if self._engine is None:
            raise RuntimeError("no engine to checkpoint: InfinityTrainer builds it in train()")
        self._engine.save_checkpoint(
            output_dir, tag=ENGINE_TAG, node_local=True if self.args.save_on_each_node else None
        )

    def _save_scaler(self, output_dir: str) -> None:
        """The fp16 loss scale is the engine's, saved in its checkpoint."""

    def _engine_checkpoint(self, checkpoint: str) -> str:
        # Node-local: a node that joined since the save holds nothing; the load fetches its part.
        if not self.args.save_on_each_node and not (Path(checkpoint) / ENGINE_TAG).is_dir():
            raise FileNotFoundError(
                f"{str(checkpoint)!r} holds no engine checkpoint ('{ENGINE_TAG}/'): resume_from_checkpoint= takes "
                "a checkpoint-N folder that InfinityTrainer saved (with save_only_model=False); to start from "
                "weights only, load them with from_pretrained and train without resuming"
            )
        return checkpoint

    def _load_from_checkpoint(
        self, resume_from_checkpoint: str, model: nn.Module | None = None
    ) -> None:
        """Checks the checkpoint; its weights are restored with the engine's state in train()."""
        self._engine_checkpoint(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Restored with the engine checkpoint."""

    def _load_scaler(self, checkpoint: str | None) -> None:
        """Restored with the engine checkpoint."""

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """The Trainer's own ``_save`` (the folder, ``save_pretrained``, the processing class,
        ``training_args.bin``): on the engine's model ``save_pretrained`` streams the weights, and a
        PEFT model writes its adapters ([Note: saving a partitioned model] in infinity/engine/saving.py).
        A model with no ``save_pretrained`` gets ``model.safetensors`` from ``engine.save_pretrained``
        (every state_dict name, streamed) where the Trainer would hold its whole state dict."""
        engine = self._engine
        if engine is None or state_dict is not None or hasattr(self.model, "save_pretrained"):
            super()._save(output_dir, state_dict)
            return
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        engine.save_pretrained(output_dir)
        if not self.args.should_save:
            return
        # the rest of what Trainer._save writes beside the weights
        tokenizer = getattr(self.data_collator, "tokenizer", None)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        elif tokenizer is not None:
            tokenizer.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))


class InfinityTrainer(InfinityTrainerMixin, Trainer):
    """``transformers.Trainer`` training through an infinity engine built from ``infinity_config``
    (a DeepSpeed-style config: dict or JSON path) and the ``TrainingArguments``. With
    ``gradient_accumulation_steps`` > 1 each window runs layer-major through
    ``engine.train_batch`` (``layer_major=False``: micro-batch by micro-batch). Every other
    argument is the Trainer's. The engine is ``trainer.engine`` once ``train()`` has built it."""


# [Note: Trainer subclasses on the engine]
# Libraries build on the Trainer by subclassing it (TRL's SFTTrainer, DPOTrainer, ...): their
# compute_loss, data preparation and logging are theirs, the model's forward and backward and the
# optimizer's step the Trainer's. infinity_trainer(cls) puts InfinityTrainerMixin before ``cls``, so
# the mixin's overrides (the engine built in _prepare_for_training, training_step with
# engine.backward, the engine's checkpoints and save) take the Trainer's place and ``cls``'s own
# compute_loss and log run on the engine's forward. A subclass that overrides training_step for
# more than a context around it (SFTTrainer's activation offloading) loses that override: its
# option is refused where it exists.


def infinity_trainer(trainer_class: type[Trainer]) -> type[Trainer]:
    """``trainer_class`` (a ``transformers.Trainer`` subclass, e.g. ``trl.SFTTrainer``) training
    through an infinity engine, as ``InfinityTrainer`` does for the Trainer: the new class takes the
    same arguments plus ``infinity_config=`` ([Note: Trainer subclasses on the engine])."""
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, Trainer)):
        raise TypeError(
            f"infinity_trainer takes a transformers.Trainer subclass (e.g. trl.SFTTrainer); got "
            f"{trainer_class!r}"
        )
    if issubclass(trainer_class, InfinityTrainerMixin):
        return trainer_class
    return type(
        f"Infinity{trainer_class.__name__}",
        (InfinityTrainerMixin, trainer_class),
        {"__module__": __name__, "__doc__": infinity_trainer.__doc__},
    )
