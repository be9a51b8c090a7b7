"""Engine: forward, backward and step for a model trained under a DeepSpeed-style config.

Called as in DeepSpeed, every micro-batch: ``loss = engine(batch)``,
``engine.backward(loss)``, ``engine.step()``. Backward scales the loss by
1/gradient_accumulation_steps (and by the fp16 loss scale); ``step`` updates
only at the accumulation boundary: it takes the global gradient norm (all
shards, all ranks), skips the step on fp16 overflow, clips, runs the
partitioned Adam over the shards (streamed from NVMe where they live there),
and advances the lr schedule.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

from infinity.config import ConfigError, InfinityConfig
from infinity.engine import checkpoint
from infinity.engine.build import Runtime, build_runtime
from infinity.engine.loss_scaler import LossScaler
from infinity.engine.optimizers import choose_optimizer
from infinity.estimate.runtime_plan import RuntimePlan, train_dtype
from infinity.optim.lr_schedules import build_scheduler
from infinity.store.errors import NvmePathError
from infinity.zero.collectives import DataParallelGroup

log = logging.getLogger("infinity.engine")


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
        self.gradient_accumulation_steps = config.gradient_accumulation_steps
        self.dtype = train_dtype(config)
        self.micro_steps = 0
        self.global_steps = 0
        self.skipped_steps = 0
        self._closed = False
        self.loss_scaler = (
            LossScaler.from_fp16_config(config.fp16) if config.fp16.enabled else LossScaler.static(1.0)
        )
        choice = choose_optimizer(config, list(dict.fromkeys(model.parameters())), optimizer)
        try:
            self.runtime: Runtime = build_runtime(model, config, choice, group=self.group, device=self.device,
                                                  plan=plan)
        except NvmePathError as e:  # nvme_path is a key of the config: refused like the others
            raise ConfigError(str(e)) from None
        self.optimizer = self.runtime.optimizer or self.runtime.passthrough
        # The prefetch scheduler (stage 3) learns one trace step per forward + backward.
        self._trace = self.runtime.shard_source if hasattr(self.runtime.shard_source, "step_open") else None
        self.lr_scheduler = self._make_scheduler(lr_scheduler)
        self.last_grad_norm: float | None = None
        # Stage 3: the optimizer step runs behind the next forward (engine/overlap.py).
        self.overlap_step = self.stage == 3

    def _make_scheduler(self, lr_scheduler: Any) -> Any:
        if lr_scheduler is not None:
            if self.config.scheduler is not None:
                raise ValueError(
                    "an lr_scheduler was passed to initialize() and the config has a 'scheduler' section; keep one"
                )
            return lr_scheduler(self.optimizer) if callable(lr_scheduler) and not hasattr(lr_scheduler, "step") else lr_scheduler
        if self.config.scheduler is not None:
            return build_scheduler(self.config.scheduler, self.optimizer)
        return None

    # -- the training loop ------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward. Under stage 3 a forward with its backward is one step of the
        prefetch trace; a forward without grad (evaluation) is a step of its own."""
        self._check_open()
        trace = self._trace
        if trace is not None and not trace.step_open:
            trace.begin_step()
        try:
            out = self.module(*args, **kwargs)
        except BaseException:
            if trace is not None:
                trace.abort_step()
            raise
        if trace is not None and not torch.is_grad_enabled():
            trace.end_step()
        return out

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagates ``loss`` scaled by 1/gradient_accumulation_steps (and the fp16 loss scale)."""
        self._check_open()
        if loss.dim() != 0:
            raise ValueError(f"backward() needs a scalar loss, got shape {tuple(loss.shape)}")
        self.synchronize()
        boundary = self.is_gradient_accumulation_boundary()
        first = self.micro_steps % self.gradient_accumulation_steps == 0
        rt = self.runtime
        if rt.reducer is not None:
            rt.reducer.begin_micro(first=first, last=boundary)
        scale = self.loss_scaler.scale / self.gradient_accumulation_steps
        trace = self._trace
        try:
            (loss * scale if scale != 1.0 else loss).backward()
            if rt.reducer is not None and boundary and rt.reducer.deferred:
                rt.reducer.reduce_window()
        except BaseException:
            if trace is not None:
                trace.abort_step()
            raise
        if trace is not None and trace.step_open:
            # Inside an accumulation window nothing changes the parameters before the next forward: what
            # it starts with stays held and is read ahead for ([Note: across the step boundary]).
            trace.end_step(keep_for_next=not boundary)

    def step(self) -> None:
        """Updates the parameters at the accumulation boundary; otherwise only counts the micro-step."""
        self._check_open()
        self.synchronize()
        if self.is_gradient_accumulation_boundary():
            if self.runtime.passthrough is not None:
                self._passthrough_step()
            else:
                self._partitioned_step()
            if self._trace is not None:
                self._trace.prefetch_next_step()  # gated per unit on the step's updates
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            self.global_steps += 1
            every = self.config.steps_per_print
            if every and self.global_steps % every == 0 and self.group.rank == 0:
                log.info("step=%d, skipped=%d, lr=%s, grad_norm=%s, loss_scale=%g", self.global_steps,
                         self.skipped_steps, self.get_lr(), self.last_grad_norm, self.loss_scale)
        self.micro_steps += 1

    def _partitioned_step(self) -> None:
        rt = self.runtime
        has_grad = rt.reducer.window_has_grad()
        sumsq = torch.tensor([rt.optimizer.local_grad_sumsq(has_grad)], dtype=torch.float64)
        if self.stage >= 1:  # shards: the norm is spread over the ranks (stage 0 holds it whole)
            self.group.all_reduce_sum(sumsq)
        scale = self.loss_scaler.scale
        norm = math.sqrt(float(sumsq)) / scale
        self.last_grad_norm = norm
        if self.config.fp16.enabled and not math.isfinite(norm):
            self.skipped_steps += 1
            self.loss_scaler.update(overflow=True)
            log.warning("fp16 gradients overflowed at step %d: step skipped, loss scale %g -> %g",
                        self.global_steps, scale, self.loss_scaler.scale)
            return
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
            hyper = rt.optimizer.hyperparameters()  # before the lr schedule moves on
            rt.overlap.start(lambda done: rt.optimizer.step(
                grad_scale=coef, has_grad=has_grad, only=rest, hyper=hyper, on_shard_done=done))
        else:
            if rt.partitioner is not None:
                rt.partitioner.release_persistent()
            rt.optimizer.step(grad_scale=coef, has_grad=has_grad)
            if rt.partitioner is not None:
                rt.partitioner.gather_persistent()
        self.loss_scaler.update(overflow=False)

    def _passthrough_step(self) -> None:
        params = self.runtime.params
        for p in params:
            if p.grad is not None:
                self.group.all_reduce_mean(p.grad)
        if self.config.gradient_clipping > 0:
            self.last_grad_norm = float(
                torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], self.config.gradient_clipping)
            )
        self.runtime.passthrough.step()
        self.runtime.passthrough.zero_grad(set_to_none=True)

    # -- checkpoints (infinity.engine.checkpoint) ---------------------------------

    def save_checkpoint(
        self, save_dir: Any, tag: str | None = None, client_state: Any = None, *, progress: bool | None = None
    ) -> Any:
        """Saves the full training state to ``save_dir/tag`` (default tag ``global_step<N>``), atomically,
        and points ``save_dir/latest`` at it. ``client_state``: JSON values and tensors (no pickle).
        Every rank must call it, at an accumulation boundary. Returns the checkpoint's directory."""
        self._check_open()
        return checkpoint.save_checkpoint(self, save_dir, tag, client_state, progress=progress)

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
        self._check_open()
        return checkpoint.load_checkpoint(
            self, load_dir, tag, load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
            verify_checksums=verify, progress=progress)

    def save_16bit_model(
        self, save_dir: Any, save_filename: str = "model.safetensors", *, progress: bool | None = None
    ) -> Any:
        """Writes the full parameters (in the training dtype) and buffers to one safetensors file that
        ``model.load_state_dict(safetensors.torch.load_file(path))`` takes. Every rank must call it."""
        self._check_open()
        return checkpoint.save_16bit_model(self, save_dir, save_filename, progress=progress)

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
        )

    # -- the rest of DeepSpeed's engine surface ----------------------------------

    def synchronize(self) -> None:
        """Waits until an optimizer step running in the background has finished (re-raising its error)."""
        self.runtime.overlap.synchronize()

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        self.module.eval()
        return self

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def prefetch_stats(self):
        """The prefetch scheduler's statistics (stage 3), or None."""
        return self._trace.stats() if self._trace is not None else None

    def io_stats(self) -> dict[str, float]:
        """Bytes read and written by the parameter and optimizer stores so far, and the
        seconds callers spent waiting for them."""
        out = {"read_nbytes": 0, "write_nbytes": 0, "wait_s": 0.0}
        for store in (self.runtime.param_store, self.runtime.state_store):
            if store is None or store.closed:
                continue
            st = store.stats()
            out["read_nbytes"] += st.read.nbytes
            out["write_nbytes"] += st.write.nbytes
            out["wait_s"] += st.wait_s
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
        self.runtime.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this engine is closed")
