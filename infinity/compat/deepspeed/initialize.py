"""``deepspeed.initialize``: DeepSpeed's signature and return tuple over ``infinity.initialize``.

``(engine, optimizer, training_dataloader, lr_scheduler)``: the engine as a ``DeepSpeedEngine``;
the optimizer it steps (None when nothing trains); a DataLoader over ``training_data`` with the
config's micro-batch size, each rank its share (DeepSpeed's: a DistributedSampler over the data
parallel ranks, shuffled with its default seed; ``dataloader_drop_last``), or None; the lr
scheduler it steps, or None.

The config comes from ``args.deepspeed_config`` (``args.deepscale_config``: its deprecated name),
``config`` or ``config_params`` (an alias), exactly one of them. The optimizer: the one passed, or
one a callable passed builds from ``model_parameters`` (default: the model's parameters), or the
config's ``optimizer`` section over ``model_parameters`` (param groups honoured); the lr scheduler:
the object passed, or one a callable builds from the optimizer, or the config's ``scheduler``. A
stage-3 model with no optimizer anywhere gets an engine that runs forward only (DeepSpeed's ZeRO
without an optimizer). Model and pipeline parallelism are refused ([Note: refused, never
different] in errors.py).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

import infinity
from infinity.compat.deepspeed.distributed import TORCH_DISTRIBUTED_DEFAULT_PORT, init_distributed
from infinity.compat.deepspeed.engine import DeepSpeedEngine
from infinity.compat.deepspeed.errors import refuse
from infinity.compat.deepspeed.params import mark_all
from infinity.config import load_config, read_config_file
from infinity.engine.optimizers import choose_optimizer
from infinity.zero.collectives import DataParallelGroup

__all__ = ["initialize"]


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: Dataset | None = None,
    lr_scheduler: Any = None,
    distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable[..., Any] | None = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
) -> tuple[DeepSpeedEngine, Any, DataLoader | None, Any]:
    """DeepSpeed's ``initialize``; see the module's docstring."""
    if model is None:
        raise ValueError("deepspeed.initialize requires a model (model=...)")
    if mpu is not None:
        raise refuse(
            "deepspeed.initialize(mpu=...)",
            "infinity has no model (tensor) parallelism: every rank holds the whole model's "
            "computation and ZeRO partitions its state over the data-parallel ranks",
            "pass mpu=None",
        )
    if mesh_param is not None:
        raise refuse(
            "deepspeed.initialize(mesh_param=...)",
            "infinity has no sequence parallelism or device mesh",
            "pass mesh_param=None",
        )
    if any(c.__name__ == "PipelineModule" for c in type(model).__mro__):
        raise refuse(
            "deepspeed.initialize(model=PipelineModule(...))",
            "infinity has no pipeline parallelism",
            "pass the model as an ordinary nn.Module (its layers in sequence)",
        )
    source = _config(args, config, config_params)
    if dist_init_required is not False:
        init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    elif not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RuntimeError(
            "deepspeed.initialize(dist_init_required=False) but torch.distributed is not initialised; "
            "initialise it first (deepspeed.init_distributed()) or pass dist_init_required=None"
        )
    raw = _as_dict(source)
    params = list(model_parameters) if model_parameters is not None else None
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        if not callable(optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer or a callable that builds one from the "
                f"model's parameters, got {type(optimizer).__name__}"
            )
        optimizer = optimizer(params if params is not None else list(model.parameters()))
    elif optimizer is None and params is not None and raw.get("optimizer") is not None:
        optimizer = _optimizer_from_section(raw, model, params)
        raw = {k: v for k, v in raw.items() if k != "optimizer"}
    stage = int((raw.get("zero_optimization") or {}).get("stage", 0))
    if stage == 3:
        mark_all(model.parameters())  # the ds_* attributes, whole shapes read before partitioning
    inner = infinity.initialize(model, raw, optimizer=optimizer, lr_scheduler=lr_scheduler)
    loader = _dataloader(training_data, inner, collate_fn) if training_data is not None else None
    engine = DeepSpeedEngine(inner, training_dataloader=loader)
    return engine, engine.optimizer, loader, engine.lr_scheduler


def _config(args: Any, config: Any, config_params: Any) -> Any:
    if config is None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None)
    deprecated = getattr(args, "deepscale_config", None)
    if deprecated is not None:
        if from_args is not None:
            raise ValueError(
                "args has both deepspeed_config and deepscale_config (its deprecated name); keep "
                "--deepspeed_config"
            )
        from_args = deprecated
    if from_args is not None:
        if config is not None:
            raise ValueError(
                "deepspeed.initialize was given a config twice: args.deepspeed_config "
                f"({from_args!r}) and config=; pass one of them"
            )
        config = from_args
    if config is None:
        raise ValueError(
            "deepspeed.initialize needs a config: --deepspeed_config PATH on the command line (with "
            "deepspeed.add_config_arguments(parser)) or config= (a dict or the path of a JSON file)"
        )
    return config


def _as_dict(config: Any) -> dict[str, Any]:
    if isinstance(config, (str, os.PathLike)):
        return read_config_file(config)
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    raise TypeError(
        f"the DeepSpeed config must be a dict or the path of a JSON file, not {type(config).__name__}"
    )


def _optimizer_from_section(
    raw: dict[str, Any], model: nn.Module, params: list[Any]
) -> torch.optim.Optimizer:
    """The config's ``optimizer`` section over ``params`` (tensors or param groups), as DeepSpeed
    builds its basic optimizer: torch's AdamW (or Adam, with L2 weight decay, when the section asks
    for Adam without ``adam_w_mode``), whose groups and hyper-parameters the engine's Adam runs."""
    cfg = load_config(raw, world_size=DataParallelGroup().world_size, model=model)
    choice = choose_optimizer(cfg, model, None)
    cls = torch.optim.AdamW if choice.adamw else torch.optim.Adam
    return cls(params, **choice.defaults)


def _dataloader(training_data: Any, engine: Any, collate_fn: Any) -> DataLoader:
    if isinstance(training_data, IterableDataset) or not (
        hasattr(training_data, "__getitem__") and hasattr(training_data, "__len__")
    ):
        raise TypeError(
            "deepspeed.initialize(training_data=...) takes a map-style torch Dataset (with __getitem__ "
            f"and __len__), as DeepSpeed's sampler needs; got {type(training_data).__name__}. Build "
            "your own DataLoader for an iterable dataset"
        )
    cfg = engine.config
    sampler = DistributedSampler(
        training_data, num_replicas=engine.group.world_size, rank=engine.group.rank
    )
    return DataLoader(
        training_data,
        batch_size=cfg.train_micro_batch_size_per_gpu,
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=cfg.dataloader_drop_last,
        pin_memory=torch.cuda.is_available(),
    )
