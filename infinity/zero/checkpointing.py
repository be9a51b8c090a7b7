"""infinity.checkpointing: DeepSpeed's activation-checkpointing API (``deepspeed.checkpointing``).

Code written against DeepSpeed runs unchanged with ``infinity.checkpointing``
in its place: ``checkpoint(function, *args, **kwargs)`` (reentrant, as
DeepSpeed's own CheckpointFunction: the function runs under ``no_grad`` in
forward and again, with grad, in backward, followed by a nested backward;
tensor arguments passed by keyword take part in autograd like positional
ones), ``non_reentrant_checkpoint(function, *args, **kwargs)`` (torch's
saved-tensor-hook checkpoint, which also gives grads to parameters when no
input requires grad), ``configure(mpu_, deepspeed_config=..., ...)`` and
``is_configured()``. Both run torch.utils.checkpoint underneath (the RNG
state of forward is replayed in the recomputation, so dropout matches), with
DeepSpeed's config acted on where it means something here; see
[Note: checkpoint inputs]. Under stage 3 the recomputation fetches the
parameters again: [Note: recomputation under stage 3] in partitioner.py.

[Note: checkpoint inputs]
What a checkpoint keeps from forward to backward is its inputs; everything
its function saves is made again by the recomputation. DeepSpeed's
``activation_checkpointing`` section says where those inputs are kept:
- ``cpu_checkpointing``: in host memory, pinned where CUDA is (so the copy
  back for the recomputation is asynchronous), ``save_on_cpu`` semantics; on
  a CPU-only machine the input is there already and is kept as it is.
- ``partition_activations``: split across the *model-parallel* group given
  to ``configure(mpu_=...)``, whose ranks hold the same activations (tensor
  parallelism): each rank keeps its 1/mp slice and the recomputation
  all-gathers the input. Data-parallel ranks hold different activations, so
  there is nothing to split between them: without an mpu (or with a
  model-parallel group of one rank) nothing is partitioned, as in DeepSpeed.
Both are saved-tensor hooks around the torch checkpoint call: torch saves
the checkpoint's inputs (``ctx.save_for_backward`` when reentrant, the
frame's saved inputs when not) while these hooks are the innermost, and
everything the function saves goes to torch's own hooks, pushed after them
(or is not saved at all: the reentrant forward runs under no_grad). Only
floating-point tensors with at least mp elements are moved or split
(DeepSpeed's ``is_activation_to_checkpoint``).
``contiguous_memory_optimization``, ``number_checkpoints``,
``synchronize_checkpoint_boundary`` and ``profile`` are accepted without
effect (infinity.config.support gives the reason of each).

[Note: whose checkpoint settings]
Two sources, as two owners: ``configure(...)`` sets the process-wide
settings, as DeepSpeed's does (code written for DeepSpeed calls it once);
an engine whose config has an ``activation_checkpointing`` section owns its
own (``engine.activation_checkpointing``, a ``ModelCheckpointing``) and puts
them in force for the duration of its ``forward`` and ``backward``, so
``checkpoint(...)`` called from inside its model acts on that engine's
section. A teacher and a student in one process each keep theirs; an engine
without the section follows the process-wide settings. Building an engine
changes nothing process-wide. The settings in force are a context variable:
per thread, restored when the engine's call returns or raises. The
checkpoint's saved-tensor hooks take the settings when they are made (in
forward), so backward needs none, except for checkpoints nested inside a
recomputation (in force too when it runs in ``engine.backward``'s thread).

Threading: configure from the thread that trains, before the forward that
uses the settings.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.utils.checkpoint as torch_checkpoint

from infinity.config import ActivationCheckpointingConfig, InfinityConfig, load_config
from infinity.config.support import report_not_acted_on
from infinity.zero.collectives import DataParallelGroup

log = logging.getLogger("infinity.zero")

__all__ = [
    "CheckpointSettings",
    "ModelCheckpointing",
    "checkpoint",
    "configure",
    "is_configured",
    "non_reentrant_checkpoint",
    "settings",
]


class ModelParallelUnit(Protocol):
    """DeepSpeed's ``mpu``: Megatron's model-parallel state (either spelling of the group getter)."""

    def get_model_parallel_group(self) -> Any: ...


@dataclasses.dataclass(frozen=True)
class CheckpointSettings:
    """What the checkpoint functions do with their inputs (see [Note: checkpoint inputs])."""

    cpu_checkpointing: bool = False
    """Keep checkpoint inputs in (pinned) host memory."""
    partition_activations: bool = False
    """Split checkpoint inputs across the model-parallel group (when it has more than one rank)."""
    model_parallel: DataParallelGroup | None = None
    """The model-parallel group of ``configure(mpu_=...)``; None: no model parallelism."""

    @property
    def partitions(self) -> int:
        """Ranks each checkpoint input is split across (1: kept whole)."""
        mp = self.model_parallel
        return mp.world_size if self.partition_activations and mp is not None else 1


# configure()'s: process-wide, as DeepSpeed's ([Note: whose checkpoint settings]).
_settings = CheckpointSettings()
_configured = False
# The settings of the engine whose forward or backward is running in this thread, if it has its own.
_in_force: contextvars.ContextVar[CheckpointSettings | None] = contextvars.ContextVar(
    "infinity_checkpoint_settings", default=None
)

_NO_EFFECT = {
    "contiguous_checkpointing": "activation_checkpointing.contiguous_memory_optimization",
    "num_checkpoints": "activation_checkpointing.number_checkpoints",
    "synchronize": "activation_checkpointing.synchronize_checkpoint_boundary",
    "profile": "activation_checkpointing.profile",
}


def settings() -> CheckpointSettings:
    """The settings the checkpoint functions use now: those of the engine whose forward or backward
    is running (when its config has the section), else the process-wide ones of ``configure``."""
    return _in_force.get() or _settings


def is_configured() -> bool:
    """Whether ``configure`` has been called, as DeepSpeed's (building an engine does not call it)."""
    return _configured


def configure(
    mpu_: ModelParallelUnit | None = None,
    deepspeed_config: Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """DeepSpeed's ``checkpointing.configure``: defaults, then the config's ``activation_checkpointing``
    section (``deepspeed_config``: a path, a dict or an InfinityConfig), then the arguments given.

    ``mpu_``: the model-parallel state whose group ``partition_activations`` splits inputs across;
    None keeps the one configured before (DeepSpeed's rule)."""
    global _settings, _configured
    section = ActivationCheckpointingConfig()
    if deepspeed_config is not None:
        cfg = (
            deepspeed_config
            if isinstance(deepspeed_config, InfinityConfig)
            else _load(deepspeed_config)
        )
        section = cfg.activation_checkpointing
    given = {
        "contiguous_checkpointing": contiguous_checkpointing,
        "num_checkpoints": num_checkpoints,
        "synchronize": synchronize,
        "profile": profile,
    }
    report_not_acted_on(_NO_EFFECT[k] for k, v in given.items() if v)
    model_parallel = _model_parallel_group(mpu_) if mpu_ is not None else _settings.model_parallel
    _settings = CheckpointSettings(
        cpu_checkpointing=section.cpu_checkpointing
        if checkpoint_in_cpu is None
        else bool(checkpoint_in_cpu),
        partition_activations=(
            section.partition_activations
            if partition_activations is None
            else bool(partition_activations)
        ),
        model_parallel=model_parallel,
    )
    _configured = True
    if _settings.partition_activations and _settings.partitions == 1:
        log.info(
            "activation_checkpointing.partition_activations: no model-parallel group of more than one rank "
            "(infinity.checkpointing.configure(mpu_=...)); data-parallel ranks hold different activations, "
            "so checkpoint inputs are kept whole"
        )


class ModelCheckpointing:
    """One engine's activation-checkpointing settings, from its config's ``activation_checkpointing``
    section ([Note: whose checkpoint settings]); None for a config without the section, whose
    engine follows the process-wide settings of ``configure``."""

    def __init__(self, section: ActivationCheckpointingConfig | None) -> None:
        self.section = section
        s = self.settings()
        if section is not None and s.partition_activations and s.partitions == 1:
            log.info(
                "activation_checkpointing.partition_activations: no model-parallel group of more than one "
                "rank (infinity.checkpointing.configure(mpu_=...)); data-parallel ranks hold different "
                "activations, so checkpoint inputs are kept whole"
            )

    @classmethod
    def for_config(cls, cfg: InfinityConfig) -> ModelCheckpointing:
        written = any(
            k == "activation_checkpointing" or k.startswith("activation_checkpointing.")
            for k in cfg.user_keys
        )
        return cls(cfg.activation_checkpointing if written else None)

    def settings(self) -> CheckpointSettings:
        """The settings this engine's checkpoints use. The model-parallel group is the one given to
        ``configure(mpu_=...)`` (the process's model parallelism, which no config section names)."""
        if self.section is None:
            return _settings
        return CheckpointSettings(
            cpu_checkpointing=self.section.cpu_checkpointing,
            partition_activations=self.section.partition_activations,
            model_parallel=_settings.model_parallel,
        )

    @contextlib.contextmanager
    def in_force(self) -> Iterator[None]:
        """Within the block, in this thread, the checkpoint functions act on this engine's settings."""
        if self.section is None:
            yield
            return
        token = _in_force.set(self.settings())
        try:
            yield
        finally:
            _in_force.reset(token)

    def checkpoint(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``checkpoint`` with this engine's settings, wherever it is called from."""
        with self.in_force():
            return checkpoint(function, *args, **kwargs)

    def non_reentrant_checkpoint(
        self, function: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        """``non_reentrant_checkpoint`` with this engine's settings, wherever it is called from."""
        with self.in_force():
            return non_reentrant_checkpoint(function, *args, **kwargs)


def _load(config: Any) -> InfinityConfig:
    world = DataParallelGroup().world_size
    return load_config(config, world_size=world)


def _model_parallel_group(mpu: ModelParallelUnit) -> DataParallelGroup:
    for name in ("get_tensor_model_parallel_group", "get_model_parallel_group"):
        getter = getattr(mpu, name, None)
        if callable(getter):
            return DataParallelGroup(getter())
    raise TypeError(
        f"mpu_ must have get_model_parallel_group() or get_tensor_model_parallel_group() (Megatron's "
        f"model-parallel state), got {type(mpu).__name__}; pass mpu_=None without model parallelism"
    )


# -- the checkpoint functions ---------------------------------------------------------


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Runs ``function(*args, **kwargs)`` keeping only its inputs for backward (reentrant, as
    DeepSpeed's ``checkpointing.checkpoint``); the inputs are kept as configured."""
    function, args = _keywords_as_positions(function, args, kwargs)
    with _input_hooks(settings()):
        return torch_checkpoint.checkpoint(function, *args, use_reentrant=True)


def non_reentrant_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The same with torch's non-reentrant checkpoint (DeepSpeed's ``non_reentrant_checkpoint``): grads
    reach the function's parameters even when no input requires grad."""
    function, args = _keywords_as_positions(function, args, kwargs)
    with _input_hooks(settings()):
        return torch_checkpoint.checkpoint(function, *args, use_reentrant=False)


def _keywords_as_positions(
    function: Callable[..., Any], args: tuple, kwargs: dict
) -> tuple[Callable, tuple]:
    """DeepSpeed's rule: keyword arguments are passed on as trailing positions, so their tensors take part
    in autograd (torch's reentrant checkpoint takes no keywords)."""
    if not kwargs:
        return function, args
    keys = tuple(kwargs)
    n = len(args)

    def with_keywords(*all_args: Any) -> Any:
        return function(*all_args[:n], **dict(zip(keys, all_args[n:], strict=True)))

    return with_keywords, args + tuple(kwargs.values())


@dataclasses.dataclass(frozen=True)
class _KeptInput:
    """A checkpoint input as kept between forward and backward: in host memory and/or this rank's slice."""

    part: torch.Tensor
    shape: torch.Size
    device: torch.device
    numel: int


def _input_hooks(s: CheckpointSettings) -> Any:
    if not s.cpu_checkpointing and s.partitions == 1:
        return contextlib.nullcontext()
    parts = s.partitions
    group = s.model_parallel
    pin = torch.cuda.is_available()

    def pack(t: torch.Tensor) -> Any:
        if not (t.is_floating_point() and t.numel() >= parts and t.layout is torch.strided):
            return t
        flat = t.detach().reshape(-1)
        if parts > 1:
            assert group is not None
            n = -(-flat.numel() // parts)
            lo = min(group.rank * n, flat.numel())
            piece = flat[lo : lo + n]
            part = torch.zeros(n, dtype=t.dtype, device=t.device)
            part[: piece.numel()] = piece
        else:
            part = flat
        if s.cpu_checkpointing and part.device.type != "cpu":
            host = torch.empty(part.shape, dtype=part.dtype, pin_memory=pin)
            host.copy_(part, non_blocking=pin)
            part = host
        elif parts == 1:
            return t  # nothing to move, nothing to split
        return _KeptInput(part, t.shape, t.device, t.numel())

    def unpack(kept: Any) -> torch.Tensor:
        if not isinstance(kept, _KeptInput):
            return kept
        part = kept.part.to(kept.device, non_blocking=True)
        if parts > 1:
            assert group is not None
            full = torch.empty(part.numel() * parts, dtype=part.dtype, device=kept.device)
            group.all_gather(full, part)
            part = full[: kept.numel]
        return part.view(kept.shape)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
