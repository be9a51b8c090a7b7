"""Engine: forward, backward and step for a model trained under a DeepSpeed-style config.

Called as in DeepSpeed, every micro-batch: ``loss = engine(batch)``,
``engine.backward(loss)``, ``engine.step()``. Backward scales the loss by
1/gradient_accumulation_steps (and by the fp16 loss scale); ``step`` updates
only at the accumulation boundary: it takes the global gradient norm (all
shards, all ranks), skips the step on fp16 overflow, clips, runs the
partitioned Adam over the shards (streamed from NVMe where they live there),
and advances the lr schedule.

backward(), step() and zero_grad() follow torch in any order ([Note: the
training loop's call order]); a step whose loss or gradient norm is not
finite is named, or skipped on request ([Note: non-finite steps]); both in
engine/window.py.
Only parameters with ``requires_grad`` get optimizer state; a model with
none needs no optimizer (``step`` then only counts), see [Note: frozen units]
in infinity/estimate/runtime_plan.py.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from infinity.config import ConfigError, InfinityConfig, TraceConfig
from infinity.engine import checkpoint
from infinity.engine.build import Runtime, build_runtime
from infinity.engine.layer_major import HeapTrimmer, LayerMajorForward, call_module
from infinity.engine.loss_scaler import LossScaler
from infinity.engine.notes import add_note
from infinity.engine.optimizers import choose_optimizer
from infinity.engine.saving import ModelSaving, gathered_state_dict, save_pretrained
from infinity.engine.step_record import Counters, StepClock, StepRecord
from infinity.engine.tracing import TraceWindow, output_path, predict_more_budget, trace_settings
from infinity.engine.window import Outcome, UpdateWindow, no_backward_message
from infinity.estimate.blocks import block_after_initialize
from infinity.estimate.runtime_plan import RuntimePlan, train_dtype
from infinity.host import peak_rss_nbytes
from infinity.memory import trim_heap
from infinity.optim.lr_schedules import build_scheduler
from infinity.store.errors import NvmePathError
from infinity.timeline import Timeline
from infinity.zero.checkpointing import ModelCheckpointing
from infinity.zero.collectives import DataParallelGroup

log = logging.getLogger("infinity.engine")


@runtime_checkable
class StepTrace(Protocol):
    """What the engine asks of a shard source that learns the order of fetches (the prefetch scheduler,
    stage 3): one trace step per forward + backward, or per forward without grad."""

    @property
    def step_open(self) -> bool: ...

    def begin_step(self) -> Any: ...

    def end_step(self, *, keep_for_next: bool = False) -> Any: ...

    def abort_step(self) -> Any: ...

    def prefetch_next_step(self) -> None: ...

    def stats(self) -> Any: ...


@runtime_checkable
class LRScheduler(Protocol):
    """An lr scheduler object (torch's, or one from infinity.optim.lr_schedules): initialize() also
    takes a callable that builds one from the optimizer, as DeepSpeed does."""

    def step(self) -> Any: ...


class Engine:
    def __init__(
        self,
        model: nn.Module,
        config: InfinityConfig,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any = None,
        group: DataParallelGroup | None = None,
        device: torch.device | None = None,
        plan: RuntimePlan | None = None,
    ):
        """``plan``: what to allocate (initialize passes the one its pre-flight check read); by
        default plan_runtime's for this rank."""
        self.module = model
        self.config = config
        self.group = group or DataParallelGroup()
        self.device = device or torch.device("cpu")
        self.stage = config.zero_optimization.stage
        # Refused before anything is allocated: a trace file that cannot be written.
        trace_config = trace_settings(config)
        trace_path = (
            output_path(trace_config, self.group.rank, self.group.world_size)
            if trace_config.enabled
            else None
        )
        self.gradient_accumulation_steps = config.gradient_accumulation_steps
        self.dtype = train_dtype(config)
        self.micro_steps = 0
        self.global_steps = 0
        self.skipped_steps = 0
        self._closed = False
        # This engine's activation-checkpointing settings, in force during its forward and backward
        # ([Note: whose checkpoint settings] in infinity/zero/checkpointing.py).
        self.activation_checkpointing = ModelCheckpointing.for_config(config)
        self.loss_scaler = (
            LossScaler.from_fp16_config(config.fp16)
            if config.fp16.enabled
            else LossScaler.static(1.0)
        )
        trains = any(p.requires_grad for p in dict.fromkeys(model.parameters()))
        choice = choose_optimizer(config, model, optimizer) if trains else None
        if not trains and (optimizer is not None or config.optimizer is not None):
            log.info(
                "no parameter of %s requires grad: the optimizer allocates no state and step() updates "
                "nothing",
                type(model).__name__,
            )
        try:
            self.runtime: Runtime = build_runtime(
                model, config, choice, group=self.group, device=self.device, plan=plan
            )
        except NvmePathError as e:  # nvme_path is a key of the config: refused like the others
            raise ConfigError(str(e)) from None
        self.optimizer = self.runtime.optimizer or self.runtime.passthrough
        # The prefetch scheduler (stage 3) learns one trace step per forward + backward.
        source = self.runtime.shard_source
        self._trace: StepTrace | None = source if isinstance(source, StepTrace) else None
        self.lr_scheduler = self._make_scheduler(lr_scheduler)
        self.last_grad_norm: float | None = None
        self._window = UpdateWindow()
        # Stage 3: the optimizer step runs behind the next forward (engine/overlap.py).
        self.overlap_step = self.stage == 3
        # The model's own state_dict() and save_pretrained() give the real weights
        # ([Note: saving a partitioned model] in engine/saving.py).
        self._saving = ModelSaving(self)
        # Each optimizer step's figures, for whoever listens ([Note: step records]).
        self._clock = StepClock()
        self._step_listeners: list[Callable[[StepRecord], None]] = []
        self._on_close: list[Callable[[], None]] = []
        self.last_step_record: StepRecord | None = None
        # The timeline of chosen steps, and spans into a running torch.profiler
        # ([Note: the tracing window] in engine/tracing.py).
        self._tracing = self._make_tracing(trace_config, trace_path)
        self._traced_step = -1  # the optimizer step whose first forward the window was told of
        self._block: int | None = None  # train_batch's micro-batches per layer-major block
        # train_batch's backward trims near the peak ([Note: layer-major accumulation])
        self._heap_trimmer = HeapTrimmer()

    def _make_tracing(self, settings: TraceConfig, path: Path | None) -> TraceWindow:
        rt = self.runtime
        stores = [s for s in (rt.param_store, rt.state_store) if s is not None]
        return TraceWindow(
            settings if path is not None else None,
            path,
            stores=stores,
            plan=rt.plan,
            predict=self._predict_with_more_budget,
            scheduler_stats=self._trace.stats if self._trace is not None else None,
            rank=self.group.rank,
        )

    def _predict_with_more_budget(self) -> dict[str, Any] | None:
        """The planner's plan with budget enough for the optimizer's state on NVMe ([Note: the
        tracing window]); None where the placement is not planned within a budget."""
        return predict_more_budget(self.module, self.config, self.runtime.plan, self.group)

    def _make_scheduler(self, lr_scheduler: Any) -> Any:
        if self.optimizer is None:
            if lr_scheduler is not None or self.config.scheduler is not None:
                log.info(
                    "no parameter requires grad: the lr schedule has nothing to schedule and is not built"
                )
            return None
        if lr_scheduler is not None:
            if self.config.scheduler is not None:
                raise ValueError(
                    "an lr_scheduler was passed to initialize() and the config has a 'scheduler' section; keep one"
                )
            if isinstance(lr_scheduler, LRScheduler):
                return lr_scheduler
            if callable(lr_scheduler):
                return lr_scheduler(self.optimizer)
            raise TypeError(
                f"lr_scheduler must be a scheduler (an object with step()) or a callable that builds one from "
                f"the optimizer, got {type(lr_scheduler).__name__}"
            )
        if self.config.scheduler is not None:
            return build_scheduler(self.config.scheduler, self.optimizer)
        return None

    # -- the training loop ------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward. Under stage 3 a forward with its backward is one step of the
        prefetch trace; a forward without grad (evaluation) is a step of its own."""
        self._check_open("engine.forward()")
        if self._traced_step != self.global_steps:
            self._traced_step = self.global_steps
            self._tracing.step_begins(self.global_steps)
        tl = Timeline.active
        span = tl.begin("forward", "phase", {"step": self.global_steps}) if tl is not None else None
        trace = self._trace
        self._clock.start()
        t0 = self._now()
        if trace is not None and not trace.step_open:
            trace.begin_step()
        try:
            with self.activation_checkpointing.in_force():
                out = self.module(*args, **kwargs)
        except BaseException:
            if trace is not None:
                trace.abort_step()
            raise
        finally:
            if span is not None and tl is not None:
                tl.end(span)
        if trace is not None and not torch.is_grad_enabled():
            trace.end_step()
        self._clock.forward_s += self._now() - t0
        return out

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagates ``loss`` scaled by 1/gradient_accumulation_steps (and the fp16 loss scale),
        adding to the gradient since the last update ([Note: the training loop's call order])."""
        self._check_open("engine.backward()")
        if loss.dim() != 0:
            raise ValueError(f"backward() needs a scalar loss, got shape {tuple(loss.shape)}")
        self.synchronize()
        self._clock.start()
        t0 = self._now()
        rt = self.runtime
        boundary = self.is_gradient_accumulation_boundary()
        if rt.reducer is not None:
            rt.reducer.begin_micro(last=boundary)
        scale = self.loss_scaler.scale / self.gradient_accumulation_steps
        tl = Timeline.active
        span = (
            tl.begin("backward", "phase", {"step": self.global_steps}) if tl is not None else None
        )
        try:
            with self.activation_checkpointing.in_force():
                (loss * scale if scale != 1.0 else loss).backward()
        except BaseException as e:
            self._backward_failed(e)
            raise
        finally:
            if span is not None and tl is not None:
                tl.end(span)
        self._window.completed(self.micro_steps, loss)
        trace = self._trace
        if trace is not None and trace.step_open:
            # Inside an accumulation window nothing changes the parameters before the next forward: what
            # it starts with stays held and is read ahead for ([Note: across the step boundary]).
            trace.end_step(keep_for_next=not boundary)
        self._clock.backward_s += self._now() - t0

    def train_batch(
        self,
        micro_batches: Iterable[Any] | None = None,
        *,
        data_iter: Iterator[Any] | None = None,
        return_losses: bool = False,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    ) -> Any:
        """One optimizer step over gradient_accumulation_steps micro-batches, run layer-major: each
        unit is read once per step, not once per micro-batch ([Note: layer-major accumulation] in
        engine/layer_major.py). ``micro_batches``, or as many drawn from ``data_iter``; each is
        passed to the model as ``engine(batch)`` would not unpack it: a tuple or list as positional
        arguments, a mapping as keyword arguments, anything else as the one argument. The model
        returns a scalar loss (or an output with ``.loss``, as transformers models do given
        labels). Returns the mean loss (a 0-d tensor), and with ``return_losses=True`` also the
        list of each micro-batch's loss. ``loss_fn(module, batch)``, when given, takes the model's
        place: it runs each micro-batch's forward on the engine's module (called as a plain module,
        inside that micro-batch's thread) and returns its scalar loss, e.g. a Trainer's
        ``compute_loss``. The same training as ``engine.backward(engine(batch)); engine.step()``
        (or ``engine.backward(loss_fn(...))``) for each micro-batch."""
        self._check_open("engine.train_batch()")
        batches = self._micro_batches(micro_batches, data_iter)
        g = len(batches)
        if (
            self._window.backwards
            or self._window.failed_at is not None
            or (self.micro_steps % self.gradient_accumulation_steps)
        ):
            raise RuntimeError(
                "engine.train_batch() runs a whole accumulation window, but this one already has "
                f"{self._window.backwards} backward() call(s) (micro-step {self.micro_steps}); "
                "finish it with engine.step() (or drop it with engine.zero_grad()) first"
            )
        if not torch.is_grad_enabled():
            raise RuntimeError(
                "engine.train_batch() was called under torch.no_grad() (or inference_mode): it trains; "
                "call it with gradients enabled"
            )
        if self._traced_step != self.global_steps:
            self._traced_step = self.global_steps
            self._tracing.step_begins(self.global_steps)
        k = self._layer_major_block(g)
        losses: list[torch.Tensor] = []
        diverged: str | None = None
        for first in range(0, g, k):
            block = batches[first : first + k]
            out, why = self._forward_block(block, first, g, loss_fn)
            diverged = diverged or why
            self._backward_all(out, layer_major=why is None, first=first, last=first + k >= g)
            losses += out
        if diverged is not None:
            log.warning(
                "engine.train_batch() ran step %d micro-batch-major (each unit read once per "
                "micro-batch): %s",
                self.global_steps,
                diverged,
            )
        self.micro_steps += g - 1  # the step below counts the last one
        self.step()
        mean = torch.stack([loss.detach() for loss in losses]).mean()
        return (mean, [loss.detach() for loss in losses]) if return_losses else mean

    def _forward_block(
        self,
        block: list[Any],
        first: int,
        window: int,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None,
    ) -> tuple[list[torch.Tensor], str | None]:
        """The forwards of one block's micro-batches (the ``window``'s from ``first`` on), layer-major:
        their losses, and why they stopped meeting (the rest ran micro-batch-major), or None."""
        rt = self.runtime
        trace = self._trace
        tl = Timeline.active
        self._clock.start()
        t0 = self._now()
        if trace is not None and not trace.step_open:
            trace.begin_step()
        span = tl.begin("forward", "phase", {"step": self.global_steps}) if tl is not None else None
        try:
            with self.activation_checkpointing.in_force():
                forward = (
                    (lambda batch: loss_fn(self.module, batch))
                    if loss_fn is not None
                    else (lambda batch: call_module(self.module, batch))
                )
                result = LayerMajorForward(
                    forward,
                    block,
                    meeting=list(rt.unit_map.uses) if rt.partitioner is not None else [],
                    partitioner=rt.partitioner,
                    first=first,
                    window=window,
                ).run()
            losses = [_loss_of(out, first + i, loss_fn) for i, out in enumerate(result.outputs)]
        except BaseException:
            if trace is not None:
                trace.abort_step()
            raise
        finally:
            if span is not None and tl is not None:
                tl.end(span)
        self._clock.forward_s += self._now() - t0
        return losses, result.diverged

    def _layer_major_block(self, g: int) -> int:
        """How many micro-batches train_batch runs layer-major at once ([Note: layer-major
        blocks] in infinity/estimate/blocks.py): initialize's choice when the config has
        zero_optimization.layer_major, else chosen at the first call within the memory free now."""
        plan = self.runtime.plan
        if self._block is None and plan is not None:
            self._block = plan.layer_major_block or block_after_initialize(
                self.module, self.config, device=self.device, group=self.group
            )
        return min(self._block or g, g)

    def _micro_batches(self, micro_batches: Any, data_iter: Any) -> list[Any]:
        g = self.gradient_accumulation_steps
        if (micro_batches is None) == (data_iter is None):
            raise TypeError(
                "engine.train_batch() takes the micro-batches either as a list or as data_iter=, "
                "not both and not neither"
            )
        if data_iter is not None:
            batches = []
            for _ in range(g):
                try:
                    batches.append(next(data_iter))
                except StopIteration:
                    if not batches:
                        raise
                    raise ValueError(
                        f"data_iter ended after {len(batches)} of the {g} micro-batches of one step "
                        "(gradient_accumulation_steps); drop the last partial batch (drop_last=True) "
                        "or step it with engine.backward()/engine.step()"
                    ) from None
            return batches
        if isinstance(micro_batches, (torch.Tensor, dict)) or not isinstance(
            micro_batches, Iterable
        ):
            raise TypeError(
                "engine.train_batch(micro_batches) takes a list of micro-batches, got "
                f"{type(micro_batches).__name__}"
            )
        batches = list(micro_batches)
        if len(batches) != g:
            raise ValueError(
                f"engine.train_batch() got {len(batches)} micro-batches; one optimizer step takes "
                f"gradient_accumulation_steps = {g} of them (set gradient_accumulation_steps in the "
                "config to the number of micro-batches per step)"
            )
        return batches

    def _backward_all(
        self, losses: list[torch.Tensor], *, layer_major: bool, first: int, last: bool
    ) -> None:
        """The backward of one block's losses (micro-batches ``first``... of the window; ``last``:
        the window's last block), each scaled as backward() scales it: in one autograd call
        (layer-major), or one after another."""
        self.synchronize()
        self._clock.start()
        t0 = self._now()
        rt = self.runtime
        scale = self.loss_scaler.scale / self.gradient_accumulation_steps
        tl = Timeline.active
        span = (
            tl.begin("backward", "phase", {"step": self.global_steps}) if tl is not None else None
        )
        done = 0
        try:
            with self.activation_checkpointing.in_force():
                if layer_major:
                    if rt.reducer is not None:
                        rt.reducer.begin_micro(last=last)
                    with self._heap_trimmer.during_backward(rt.grad_hooks):
                        torch.autograd.backward(
                            losses, grad_tensors=[torch.full_like(loss, scale) for loss in losses]
                        )
                    done = len(losses)
                else:
                    for i, loss in enumerate(losses):
                        if rt.reducer is not None:
                            rt.reducer.begin_micro(last=last and i == len(losses) - 1)
                        (loss * scale if scale != 1.0 else loss).backward()
                        done += 1
        except BaseException as e:
            for i, loss in enumerate(losses[:done]):
                self._window.completed(self.micro_steps + first + i, loss)
            self._backward_failed(e)
            raise
        finally:
            # the block's activations went back to its forward threads' heaps ([Note:
            # layer-major accumulation]): out of the process before the next block or the step
            trim_heap()
            if span is not None and tl is not None:
                tl.end(span)
            self._clock.backward_s += self._now() - t0
        for i, loss in enumerate(losses):
            self._window.completed(self.micro_steps + first + i, loss)
        if self._trace is not None and self._trace.step_open:
            # as backward() at a micro-batch inside the window: what the next block starts with
            # stays held ([Note: across the step boundary])
            self._trace.end_step(keep_for_next=not last)

    def _backward_failed(self, error: BaseException) -> None:
        """Settles what a backward that raised left behind, and says in ``error`` what state that is."""
        rt = self.runtime
        dropped = False
        try:
            if self._trace is not None:
                self._trace.abort_step()
            if rt.grad_hooks is not None:
                dropped = rt.grad_hooks.abort_backward()
            if rt.partitioner is not None:
                rt.partitioner.abort_backward()
        except BaseException as cleanup:
            add_note(
                error,
                f"infinity: settling the engine after this error failed too ({cleanup!r}); close "
                "the engine and resume from a checkpoint",
            )
            return
        add_note(
            error, self._window.failed(self.micro_steps, updates=self.global_steps, dropped=dropped)
        )

    def zero_grad(self) -> None:
        """Drops the gradient accumulated since the last update (DeepSpeed's ``engine.zero_grad()``,
        torch's ``optimizer.zero_grad()``): a step() before the next backward() changes nothing. The
        micro-step count stays, so the next update is still at the accumulation boundary."""
        self._check_open("engine.zero_grad()")
        self.synchronize()
        self._end_window()

    def _end_window(self) -> None:
        rt = self.runtime
        if rt.reducer is not None:
            rt.reducer.end_window()
        if rt.passthrough is not None:
            rt.passthrough.zero_grad(set_to_none=True)
        self._window = UpdateWindow()

    def step(self) -> None:
        """Updates the parameters at the accumulation boundary; otherwise only counts the micro-step
        ([Note: the training loop's call order], [Note: non-finite steps])."""
        self._check_open("engine.step()")
        tl = Timeline.active
        span = tl.begin("step", "phase", {"step": self.global_steps}) if tl is not None else None
        try:
            self._step()
        finally:
            if span is not None and tl is not None:
                tl.end(span)

    def _step(self) -> None:
        self.synchronize()
        if self.is_gradient_accumulation_boundary():
            t0 = self._now()
            self._clock.start()
            lr = self.get_lr()
            scale = self.loss_scaler.scale
            losses = [loss for _, loss in self._window.losses]
            if self._window.failed_at is not None:
                log.warning(
                    "step %d applies a gradient that holds part of a backward() that raised (micro-step "
                    "%d); call engine.zero_grad() after such an error to drop it instead",
                    self.global_steps,
                    self._window.failed_at,
                )
            if self.runtime.passthrough is not None:
                outcome = self._passthrough_step()
            elif self.runtime.optimizer is not None:
                outcome = self._partitioned_step()
            else:
                outcome = Outcome.NO_GRADIENT  # nothing to train: the update only counts
            self._end_window()
            self._tracing.step_ended()
            if self._trace is not None:
                self._trace.prefetch_next_step()  # gated per unit on the step's updates
            if self.lr_scheduler is not None and outcome is not Outcome.SKIPPED:
                self.lr_scheduler.step()
            self.global_steps += 1
            self._clock.optimizer_s += self._now() - t0
            self._record_step(losses, lr, scale, skipped=outcome is Outcome.SKIPPED)
        self.micro_steps += 1

    # -- what each step did ([Note: step records] in engine/step_record.py) -------

    def add_step_listener(
        self,
        listener: Callable[[StepRecord], None],
        *,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        """Calls ``listener(record)`` after every optimizer step with that step's StepRecord
        (infinity.monitor's writers, the framework adapters' loggers), and ``on_close()`` when the
        engine closes (a writer flushes its files). The record's differences start now."""
        if not callable(listener):
            raise TypeError(f"a step listener must be callable, got {type(listener).__name__}")
        if not self._step_listeners:
            self._clock.previous = self._counters()
        self._step_listeners.append(listener)
        if on_close is not None:
            self._on_close.append(on_close)

    def remove_step_listener(self, listener: Callable[[StepRecord], None]) -> None:
        self._step_listeners.remove(listener)

    def _now(self) -> float:
        """A wall clock; under wall_clock_breakdown the device's queued work is counted too."""
        if self.config.wall_clock_breakdown and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _counters(self) -> Counters:
        io = self.io_stats()
        prefetch = self.prefetch_stats()
        total = prefetch.total if prefetch is not None else None
        return Counters(
            read_nbytes=int(io["read_nbytes"]),
            write_nbytes=int(io["write_nbytes"]),
            io_wait_s=float(io["wait_s"]),
            fetch_stall_s=total.stall_s if total is not None else 0.0,
            prefetch_hits=total.prefetch_hits if total is not None else 0,
            late_prefetches=total.late_prefetches if total is not None else 0,
            on_demand=total.on_demand if total is not None else 0,
        )

    def _record_step(
        self, losses: list[torch.Tensor], lr: list[float], scale: float, *, skipped: bool
    ) -> None:
        """Builds this step's record when anyone reads it, hands it to the listeners, prints it at
        steps_per_print ([Note: step records])."""
        now = self._now()
        every = self.config.steps_per_print
        prints = bool(every and self.global_steps % every == 0) and self.group.rank == 0
        breakdown = self.config.wall_clock_breakdown
        if not (self._step_listeners or breakdown):
            self._clock.close_window(now, self._clock.previous)
            if prints:
                log.info("%s", self._progress_line())
            return
        times, delta = self._clock.close_window(now, self._counters())
        in_use = peak = capacity = 0
        for store in (self.runtime.param_store, self.runtime.state_store):
            if store is not None and not store.closed:
                pool = store.pool.stats()
                in_use, peak, capacity = (
                    in_use + pool.in_use,
                    peak + pool.peak_in_use,
                    capacity + pool.capacity,
                )
        mean_loss = (
            float(torch.stack([loss.double().cpu() for loss in losses]).mean()) if losses else None
        )
        record = StepRecord(
            step=self.global_steps,
            samples=self.global_steps * self.config.train_batch_size,
            loss=mean_loss,
            lr=lr[0] if lr else None,
            loss_scale=scale,
            grad_norm=self.last_grad_norm,
            skipped=skipped,
            io_wait_s=delta.io_wait_s,
            fetch_stall_s=delta.fetch_stall_s,
            read_nbytes=delta.read_nbytes,
            write_nbytes=delta.write_nbytes,
            prefetch_hits=delta.prefetch_hits,
            late_prefetches=delta.late_prefetches,
            on_demand=delta.on_demand,
            pool_in_use_nbytes=in_use,
            pool_peak_nbytes=peak,
            pool_capacity_nbytes=capacity,
            peak_host_nbytes=peak_rss_nbytes(),
            **times,
        )
        self.last_step_record = record
        if breakdown and self.group.rank == 0 and (prints or not every):
            log.info(
                "step=%d time (ms) | forward: %.2f | backward: %.2f | step: %.2f | io_wait: %.2f "
                "| total: %.2f",
                record.step,
                record.forward_s * 1e3,
                record.backward_s * 1e3,
                record.optimizer_s * 1e3,
                record.io_wait_s * 1e3,
                record.step_time_s * 1e3,
            )
        if prints:
            log.info("%s", self._progress_line())
        for listener in list(self._step_listeners):
            listener(record)

    def _progress_line(self) -> str:
        return (
            f"step={self.global_steps}, skipped={self.skipped_steps}, lr={self.get_lr()}, "
            f"grad_norm={self.last_grad_norm}, loss_scale={self.loss_scale:g}"
        )

    def _partitioned_step(self) -> Outcome:
        rt = self.runtime
        # step() calls this only with the partitioned Adam, which build.py wires with its reducer.
        assert rt.optimizer is not None and rt.reducer is not None
        if rt.reducer.deferred:  # stages 0 and 1 reduce the window's gradient once, here
            rt.reducer.reduce_window()
        has_grad = rt.reducer.window_has_grad()  # the same on every rank
        sumsq = rt.optimizer.local_grad_sumsq(has_grad)
        if self.stage == 0 and self.group.rank != 0:
            sumsq = (
                0.0  # stage 0 holds the whole gradient on every rank: rank 0's sum is everyone's
            )
        if not any(bool(f.any()) for f in has_grad):
            self._no_gradient()
            return Outcome.NO_GRADIENT
        scale = self.loss_scaler.scale
        norm, bad_losses = self._window.global_norm(self.group, sumsq, scale)
        self.last_grad_norm = norm
        if self.config.fp16.enabled and not math.isfinite(norm):
            self.skipped_steps += 1
            self.loss_scaler.update(overflow=True)
            log.warning(
                "fp16 gradients overflowed at step %d: step skipped, loss scale %g -> %g",
                self.global_steps,
                scale,
                self.loss_scaler.scale,
            )
            return Outcome.SKIPPED
        if (not math.isfinite(norm) or bad_losses) and self._nonfinite(norm, bad_losses):
            return Outcome.SKIPPED
        coef = 1.0 / scale
        clip = self.config.gradient_clipping
        if clip > 0:
            # torch.nn.utils.clip_grad_norm_'s rule, applied to the global norm.
            coef *= min(1.0, clip / (norm + 1e-6))
        if rt.partitioner is not None and self.overlap_step:
            # [engine/overlap.py] persistent units first, in this thread (forward reads
            # them without fetching); the rest in the background, gated per unit.
            persistent = {u.index for u in rt.unit_map.units if u.persistent}
            rt.partitioner.release_persistent()
            rt.optimizer.step(grad_scale=coef, has_grad=has_grad, only=persistent)
            rt.partitioner.gather_persistent()
            rest = {u.index for u in rt.unit_map.units if not u.persistent}
            stepped = rest & {s.index for s in rt.optimizer.shards}
            hyper = rt.optimizer.hyperparameters()  # before the lr schedule moves on
            optimizer = rt.optimizer

            def step_rest(done) -> None:
                for i in sorted(
                    rest - stepped
                ):  # frozen units: nothing to update, readable at once
                    done(i)
                optimizer.step(
                    grad_scale=coef,
                    has_grad=has_grad,
                    only=stepped,
                    hyper=hyper,
                    on_shard_done=done,
                )

            rt.overlap.start(step_rest)
        else:
            if rt.partitioner is not None:
                rt.partitioner.release_persistent()
            rt.optimizer.step(grad_scale=coef, has_grad=has_grad)
            if rt.partitioner is not None:
                rt.partitioner.gather_persistent()
        self.loss_scaler.update(overflow=False)
        return Outcome.APPLIED

    def _passthrough_step(self) -> Outcome:
        passthrough = self.runtime.passthrough
        assert passthrough is not None  # step() calls this only with the user's optimizer
        with_grad = [p for p in self.runtime.params if p.grad is not None]
        for grad in [p.grad for p in with_grad if p.grad is not None]:
            self.group.all_reduce_mean(grad)
        if not with_grad:
            self._no_gradient()
            return Outcome.NO_GRADIENT
        if self.config.gradient_clipping > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(with_grad, self.config.gradient_clipping))
        else:
            norm = float(
                torch.linalg.vector_norm(
                    torch.stack([torch.linalg.vector_norm(p.grad) for p in with_grad])
                )
            )
        self.last_grad_norm = norm  # the grads were all-reduced: every rank holds this norm
        _, bad_losses = self._window.global_norm(self.group, 0.0, 1.0)
        if (not math.isfinite(norm) or bad_losses) and self._nonfinite(norm, bad_losses):
            return Outcome.SKIPPED
        passthrough.step()
        return Outcome.APPLIED

    def _nonfinite(self, norm: float, bad_losses: int) -> bool:
        """Warns of a step whose gradient norm or loss is inf or NaN; True: skip it (skip_nonfinite_steps)."""
        skip = self.config.skip_nonfinite_steps
        log.warning(
            "%s", self._window.nonfinite_message(self.global_steps, norm, bad_losses, skipped=skip)
        )
        if skip:
            self.skipped_steps += 1
        return skip

    def _no_gradient(self) -> None:
        if self._window.backwards == 0:
            log.warning("%s", no_backward_message(self.global_steps))

    # -- checkpoints (infinity.engine.checkpoint) ---------------------------------

    def save_checkpoint(
        self,
        save_dir: Any,
        tag: str | None = None,
        client_state: Any = None,
        *,
        save_latest: bool = True,
        progress: bool | None = None,
        node_local: bool | None = None,
    ) -> Any:
        """Saves the full training state to ``save_dir/tag`` (default tag ``global_step<N>``), atomically,
        and points ``save_dir/latest`` at it (unless ``save_latest=False``, as in DeepSpeed).
        ``client_state``: JSON values and tensors (no pickle). ``node_local`` (default: the config's
        ``checkpoint.use_node_local_storage``): ``save_dir`` is each node's own directory, on storage
        the other nodes need not see (docs/node-local-checkpoints.md). Every rank must call it, at an
        accumulation boundary. Returns the checkpoint's directory."""
        self._check_open("engine.save_checkpoint()")
        return checkpoint.save_checkpoint(
            self,
            save_dir,
            tag,
            client_state,
            save_latest=save_latest,
            progress=progress,
            node_local=node_local,
        )

    def load_checkpoint(
        self,
        load_dir: Any,
        tag: str | None = None,
        *,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        verify: bool = True,
        progress: bool | None = None,
    ) -> Any:
        """Restores a checkpoint (default: the one ``load_dir/latest`` names), with any world size;
        returns this rank's client_state. DeepSpeed's switches: ``load_optimizer_states=False`` loads the
        weights with fresh Adam moments and keeps this engine's hyperparameters; ``load_lr_scheduler_states
        =False`` keeps this engine's lr schedule; ``load_module_only=True`` loads the weights (and buffers)
        only. A log line names every hyperparameter that differs and which value is used. On error the
        engine is left as it was (``verify=False`` halves the reads but gives up that promise for corrupt
        data found mid-load). Every rank must call it."""
        self._check_open("engine.load_checkpoint()")
        client_state = checkpoint.load_checkpoint(
            self,
            load_dir,
            tag,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
            verify_checksums=verify,
            progress=progress,
        )
        self._end_window()  # a gradient taken before the load belongs to other weights
        return client_state

    def save_16bit_model(
        self,
        save_dir: Any,
        save_filename: str = "model.safetensors",
        *,
        layout: str | None = None,
        max_shard_size: int | str | None = None,
        progress: bool | None = None,
    ) -> Any:
        """Writes the full parameters (in the training dtype) and buffers. For a transformers model (or
        ``layout="hf"``, or with ``max_shard_size``): ``save_dir`` as ``from_pretrained`` reads it —
        ``model.safetensors`` or shards of at most ``max_shard_size`` ("5GB", bytes; default "50GB") with
        their index, and ``config.json``; returns the directory. Otherwise (``layout="state_dict"``):
        ``save_dir/save_filename``, one file ``model.load_state_dict(safetensors.torch.load_file(path))``
        takes; returns its path. Every rank must call it."""
        self._check_open("engine.save_16bit_model()")
        return checkpoint.save_16bit_model(
            self,
            save_dir,
            save_filename,
            layout=layout,
            max_shard_size=max_shard_size,
            progress=progress,
        )

    def save_merged(
        self,
        save_dir: Any,
        *,
        max_shard_size: int | str | None = None,
        progress: bool | None = None,
    ) -> Any:
        """A PEFT LoRA model's base with its active adapters merged in (PEFT's ``merge_and_unload()``:
        W + scaling · B·A), written unit by unit to ``save_dir`` as ``from_pretrained`` reads it, in the
        training dtype (a base quantised at rest: its dequantised values plus the delta). Returns the
        directory. Every rank must call it ([Note: merged export] in engine/checkpoint/merged.py)."""
        self._check_open("engine.save_merged()")
        return checkpoint.save_merged(
            self, save_dir, max_shard_size=max_shard_size, progress=progress
        )

    def gathered_state_dict(self, keys: Any = None) -> dict[str, torch.Tensor]:
        """The model's ``state_dict()`` entries named by ``keys`` (default: all) as full tensors on CPU,
        gathered unit by unit: only the units holding the keys asked are read. The dict holds what it
        names in host memory (all of the model by default; to write the weights without that, use
        ``save_pretrained`` or ``save_16bit_model``). Every rank must call it with the same keys
        ([Note: saving a partitioned model] in infinity/engine/saving.py)."""
        self._check_open("engine.gathered_state_dict()")
        return gathered_state_dict(self, keys)

    def save_pretrained(self, save_directory: Any, **kwargs: Any) -> Any:
        """Saves the model as its framework does, streamed: a PEFT model's adapters (``adapter_config.json``,
        ``adapter_model.safetensors``, as ``PeftModel.save_pretrained`` writes them), a transformers model's
        folder ``from_pretrained`` reads (``PreTrainedModel.save_pretrained``'s arguments), any other
        module's ``save_directory/model.safetensors`` (every state_dict name). Creates the folder; returns
        it. Every rank must call it."""
        self._check_open("engine.save_pretrained()")
        return save_pretrained(self, save_directory, **kwargs)

    def checkpoint_parts(self) -> checkpoint.TrainingParts:
        """The runtime pieces a checkpoint moves: units, stores, optimizer, partitioner, prefetch trace
        (see [Note: the checkpoint's view of an engine] in infinity/engine/checkpoint/target.py)."""
        rt = self.runtime
        return checkpoint.TrainingParts(
            units=rt.unit_map.units,
            params=rt.params,
            param_store=rt.param_store,
            state_store=rt.state_store,
            optimizer=rt.optimizer,
            passthrough=rt.passthrough,
            partitioner=rt.partitioner,
            trace=self._trace,
            sources=rt.sources,
            formats={
                u.index: f
                for u in rt.unit_map.units
                if not u.trainable and rt.plan is not None and (f := rt.plan.format_of(u))
            },
        )

    # -- the rest of DeepSpeed's engine surface ----------------------------------

    def synchronize(self) -> None:
        """Waits until an optimizer step running in the background has finished (re-raising its error)."""
        self.runtime.overlap.synchronize()
        self._tracing.synchronized()

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        self.module.eval()
        return self

    def get_lr(self) -> list[float]:
        """The lr of each param group (none when nothing trains)."""
        return [g["lr"] for g in self.optimizer.param_groups] if self.optimizer is not None else []

    def prefetch_stats(self):
        """The prefetch scheduler's statistics (stage 3), or None."""
        return self._trace.stats() if self._trace is not None else None

    def io_stats(self) -> dict[str, float]:
        """Bytes read and written by the parameter and optimizer stores so far, the seconds
        callers spent waiting for them, and the seconds spent checksumming them (integrity: in
        all, and in callers' threads)."""
        out = {
            "read_nbytes": 0,
            "write_nbytes": 0,
            "wait_s": 0.0,
            "checksum_s": 0.0,
            "checksum_caller_s": 0.0,
        }
        for store in (self.runtime.param_store, self.runtime.state_store):
            if store is None or store.closed:
                continue
            st = store.stats()
            out["read_nbytes"] += st.read.nbytes
            out["write_nbytes"] += st.write.nbytes
            out["wait_s"] += st.wait_s
            out["checksum_s"] += st.checksum_s
            out["checksum_caller_s"] += st.checksum_caller_s
        return out

    @property
    def num_parameters(self) -> int:
        """Elements of the model's parameters (under stage 3 their tensors are empty placeholders)."""
        return sum(u.layout.numel for u in self.runtime.unit_map.units) or sum(
            p.numel() for p in self.runtime.params
        )

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    def close(self) -> None:
        """Releases buffers, removes hooks, deletes swap files. The model's parameters are left empty
        under stage 3 (save a checkpoint or export first)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._tracing.recording:  # the last recorded step's optimizer work, then the file
                self.runtime.overlap.synchronize()
            for close in self._on_close:
                close()
        finally:
            try:
                self._tracing.close()
            finally:
                self._saving.close()
                self.runtime.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self, call: str = "this call") -> None:
        if self._closed:
            raise RuntimeError("this engine is closed")
        # A write-back that failed in the background stops the next call, naming the write
        # ([Note: failed write-backs] in infinity/store/write_path.py).
        for store in (self.runtime.param_store, self.runtime.state_store):
            if store is not None:
                store.check_writebacks(call)


def _loss_of(output: Any, index: int, loss_fn: Any = None) -> torch.Tensor:
    """The scalar loss a model returned: a 0-d tensor, or an output with ``.loss`` / ``["loss"]``;
    what ``loss_fn`` returned: a 0-d tensor."""
    if loss_fn is not None:
        if not isinstance(output, torch.Tensor) or output.dim() != 0:
            got = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
            raise ValueError(
                f"engine.train_batch(loss_fn=...) needs loss_fn to return a scalar loss (a 0-d "
                f"tensor) for each micro-batch; for micro-batch {index} it returned {got}"
            )
        return output
    loss = output
    if not isinstance(loss, torch.Tensor):
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, dict):
            loss = output.get("loss")
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        got = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(output).__name__
        raise ValueError(
            f"engine.train_batch() needs the model to return a scalar loss for each micro-batch "
            f"(a 0-d tensor, or an output with .loss as transformers models give with labels); "
            f"micro-batch {index} gave {got}"
        )
    return loss
