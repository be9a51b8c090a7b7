"""``DeepSpeedEngine``: infinity's engine under DeepSpeed's engine API.

An ``nn.Module`` whose child ``module`` is the user's model, as DeepSpeed's: calling it runs the
engine's forward; ``backward``, ``step``, ``zero_grad``, the batch-size and ZeRO queries,
``get_lr``, ``global_steps``, ``save_checkpoint`` / ``load_checkpoint`` with DeepSpeed's arguments
and return values; an attribute the engine lacks is looked up on the model, as DeepSpeed does.
The work is infinity's engine's (``engine``: an ``infinity.engine.Engine``, or the inference
engine for a stage-3 model without an optimizer); what it cannot honour is refused
([Note: refused, never different] in errors.py).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from infinity.compat.deepspeed.errors import refuse
from infinity.engine.checkpoint.format import LATEST

log = logging.getLogger("infinity.compat")

__all__ = ["DeepSpeedEngine"]


class DeepSpeedEngine(nn.Module):
    def __init__(self, engine: Any, training_dataloader: Any = None):
        super().__init__()
        self.module = engine.module
        self.__dict__["engine"] = engine  # not a submodule: the model is reached through ``module``
        self.training_dataloader = training_dataloader
        self._step_applied = False

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        module = self.__dict__.get("_modules", {}).get("module")
        if module is not None and hasattr(module, name):
            return getattr(module, name)
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    # -- the training loop ---------------------------------------------------------

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.engine(*inputs, **kwargs)

    def backward(
        self,
        loss: torch.Tensor,
        allreduce_gradients: bool = True,
        release_loss: bool = False,
        retain_graph: bool = False,
        scale_wrt_gas: bool = True,
    ) -> torch.Tensor:
        """Backpropagates ``loss`` / gradient_accumulation_steps; returns that scaled loss, as
        DeepSpeed does. ``allreduce_gradients`` and ``release_loss`` are ignored, as by DeepSpeed."""
        if retain_graph:
            raise refuse(
                "engine.backward(loss, retain_graph=True)",
                "under ZeRO-3 the parameters a graph saved are released as backward passes them",
                "run forward again for a second backward",
            )
        if not scale_wrt_gas:
            raise refuse(
                "engine.backward(loss, scale_wrt_gas=False)",
                "infinity's engine always divides the loss by gradient_accumulation_steps",
                "pass the loss multiplied by engine.gradient_accumulation_steps() to keep it unscaled",
            )
        self.engine.backward(loss)
        gas = self.gradient_accumulation_steps()
        with torch.no_grad():
            return loss.float() / gas if gas > 1 else loss

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """Updates the weights at the accumulation boundary (and steps the lr schedule)."""
        if lr_kwargs:
            raise refuse(
                "engine.step(lr_kwargs=...)",
                "infinity steps the lr scheduler with no arguments",
                "step the scheduler yourself, or pass a scheduler that needs none",
            )
        engine = self._training("step()")
        boundary, skipped = engine.is_gradient_accumulation_boundary(), engine.skipped_steps
        engine.step()
        self._step_applied = boundary and engine.skipped_steps == skipped

    def was_step_applied(self) -> bool:
        """Whether the last ``step()`` updated the weights: False between accumulation boundaries
        and for a step skipped for non-finite gradients, as DeepSpeed's."""
        return self._step_applied

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def train(self, mode: bool = True) -> DeepSpeedEngine:
        self.training = mode
        self.engine.train(mode)
        return self

    def eval(self) -> DeepSpeedEngine:
        return self.train(False)

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next ``step()`` updates the weights."""
        return self.engine.is_gradient_accumulation_boundary()

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        raise refuse(
            "engine.set_gradient_accumulation_boundary()",
            "infinity's engine counts the boundary from gradient_accumulation_steps and step() calls",
            "call engine.step() after every backward, as the config's accumulation expects",
        )

    # -- what the config says ---------------------------------------------------------

    @property
    def config(self) -> Any:
        """The resolved configuration (an ``infinity.config.InfinityConfig``)."""
        return self.engine.config

    def train_batch_size(self) -> int:
        return self.engine.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.engine.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.engine.config.gradient_accumulation_steps

    def zero_optimization(self) -> bool:
        return self.zero_optimization_stage() > 0

    def zero_optimization_stage(self) -> int:
        return self.engine.config.zero_optimization.stage

    def fp16_enabled(self) -> bool:
        return self.engine.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.engine.config.bf16.enabled

    def gradient_clipping(self) -> float:
        return self.engine.config.gradient_clipping

    def steps_per_print(self) -> int:
        return self.engine.config.steps_per_print

    # -- state of the run ---------------------------------------------------------------

    @property
    def optimizer(self) -> Any:
        return getattr(self.engine, "optimizer", None)

    @property
    def lr_scheduler(self) -> Any:
        return getattr(self.engine, "lr_scheduler", None)

    @property
    def global_steps(self) -> int:
        """Optimizer steps taken (skipped fp16 steps included, as DeepSpeed counts them)."""
        return self._training("global_steps").global_steps

    @property
    def global_samples(self) -> int:
        return self.global_steps * self.train_batch_size()

    @property
    def micro_steps(self) -> int:
        return self._training("micro_steps").micro_steps

    @property
    def skipped_steps(self) -> int:
        return self._training("skipped_steps").skipped_steps

    def get_lr(self) -> list[float]:
        """Each param group's lr (0.0 for a group without one), as DeepSpeed's."""
        opt = self.optimizer
        return [g.get("lr", 0.0) for g in opt.param_groups] if opt is not None else []

    def get_global_grad_norm(self) -> float | None:
        """The gradient norm of the last update (None before the first)."""
        return self._training("get_global_grad_norm()").last_grad_norm

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def global_rank(self) -> int:
        return self.engine.group.rank

    @property
    def world_size(self) -> int:
        return self.engine.group.world_size

    @property
    def dp_world_size(self) -> int:
        return self.engine.group.world_size

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    def destroy(self) -> None:
        """Releases the engine's buffers and swap files (infinity's ``engine.close()``)."""
        self.engine.close()

    # -- checkpoints --------------------------------------------------------------------

    def save_16bit_model(
        self,
        save_dir: str | os.PathLike,
        save_filename: str = "pytorch_model.bin",
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """The full weights in the training dtype in ``save_dir/save_filename``, as DeepSpeed writes
        them: a ``torch.save`` of the gathered state dict for a ``.bin`` name (the whole model in
        host memory on every rank, as DeepSpeed consolidates it; rank 0 writes), streamed into one
        safetensors file for a ``.safetensors`` name (infinity's ``save_16bit_model``). Every rank
        must call it. Returns True, as DeepSpeed does."""
        if exclude_frozen_parameters:
            raise refuse(
                "engine.save_16bit_model(exclude_frozen_parameters=True)",
                "infinity writes every weight of the model",
                "leave it False and drop the frozen names from the file after loading it",
            )
        name = os.fspath(save_filename)
        if name.endswith(".safetensors"):
            self.engine.save_16bit_model(save_dir, name, layout="state_dict")
            return True
        state = self.engine.gathered_state_dict()
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if rank == 0:
            Path(save_dir).mkdir(parents=True, exist_ok=True)
            torch.save(state, Path(save_dir) / name)
        return True

    def save_checkpoint(
        self,
        save_dir: str | os.PathLike,
        tag: Any = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Saves the training state to ``save_dir/tag`` (default ``global_step<N>``) with
        ``client_state`` (JSON values and tensors), and points ``save_dir/latest`` at it unless
        ``save_latest=False``. Every rank must call it. Returns True, as DeepSpeed does."""
        if exclude_frozen_parameters:
            raise refuse(
                "engine.save_checkpoint(exclude_frozen_parameters=True)",
                "infinity's checkpoint keeps frozen parameters as a reference to the files they were "
                "loaded from while unchanged (else once), and restores them on load",
                "leave exclude_frozen_parameters False",
            )
        engine = self._training("save_checkpoint()")
        engine.save_checkpoint(
            save_dir,
            None if tag is None else str(tag),
            client_state if client_state is not None else {},
            save_latest=save_latest,
        )
        return True

    def load_checkpoint(
        self,
        load_dir: str | os.PathLike,
        tag: Any = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """Restores a checkpoint; returns DeepSpeed's ``(load_path, client_state)``: the checkpoint's
        directory and the ``client_state`` it was saved with. With no ``tag`` and no
        ``load_dir/latest`` file, logs a warning and returns ``(None, None)``, as DeepSpeed does.
        ``load_module_strict=False`` is accepted: infinity loads only into the model that was saved
        (a checkpoint of another model is refused whatever the switch)."""
        if custom_load_fn is not None:
            raise refuse(
                "engine.load_checkpoint(custom_load_fn=...)",
                "infinity restores the module's weights into its partitions itself",
                "load without custom_load_fn, then change weights under zero.GatheredParameters",
            )
        engine = self._training("load_checkpoint()")
        root = Path(load_dir)
        if tag is None:
            latest = root / LATEST
            if not latest.is_file():
                log.warning(
                    "Unable to find latest file at %s, if trying to load latest checkpoint please ensure "
                    "this file exists or pass an explicit checkpoint tag when loading a checkpoint.",
                    latest,
                )
                return None, None
            tag = latest.read_text(encoding="utf-8").strip()
        tag = str(tag)
        client_state = engine.load_checkpoint(
            root,
            tag,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
        )
        return str(root / tag), client_state

    def _training(self, what: str) -> Any:
        """The training engine; a stage-3 engine built without an optimizer only runs forward."""
        if not hasattr(self.engine, "global_steps"):
            raise RuntimeError(
                f"engine.{what} needs a training engine, and this one was built without an optimizer at "
                "stage 3 (forward only, as DeepSpeed's ZeRO-Offload engine): pass optimizer= or "
                "model_parameters= with an 'optimizer' section to deepspeed.initialize()"
            )
        return self.engine
