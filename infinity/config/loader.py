"""load_config: a DeepSpeed-style config (file or dict) in, a validated InfinityConfig out.

Steps: read (jsonfile.py: hjson, as DeepSpeed reads its files; syntax errors
shown where they are) ->
canonical tree (schema.py; keys outside DeepSpeed's schema refused, all in one
ConfigError) -> "auto" filled (auto.py) -> batch sizes completed (batch.py) ->
typed sections built and cross-checked -> keys without effect here reported
once per process (support.py). The caller's dict is never modified.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any

import torch

from infinity.aio.config import AioConfig
from infinity.config.auto import resolve
from infinity.config.batch import complete_batch
from infinity.config.errors import ConfigError
from infinity.config.jsonfile import read_config_file
from infinity.config.optim import SCHEDULE_PARAMS, SchedulerConfig
from infinity.config.root import InfinityConfig
from infinity.config.schema import normalize, subsection
from infinity.config.support import NOT_ACTED_ON, OPAQUE, report_not_acted_on

logger = logging.getLogger("infinity.config")


def _plain(value: Any) -> Any:
    """A deep copy as plain dicts and lists (hjson gives OrderedDicts; callers give any Mapping)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return copy.deepcopy(value)


def load_config(
    config: str | os.PathLike | Mapping[str, Any] | InfinityConfig | None = None,
    *,
    world_size: int | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    model: torch.nn.Module | None = None,
    **auto_values: Any,
) -> InfinityConfig:
    """Reads, resolves and validates a DeepSpeed-style config.

    ``config``: a path (read with hjson), a dict (not modified), an
    InfinityConfig (returned as is when no arguments would change it; for
    another world size its per-rank micro batch and accumulation are kept and
    train_batch_size recomputed), or None (all defaults). ``world_size``:
    data-parallel ranks, for the batch arithmetic (default 1; for an
    InfinityConfig, its own). ``optimizer``: a torch optimizer to read "auto" optimizer
    values from. ``model``: the module to be trained, whose config's hidden size
    fills the ZeRO sizes written "auto" as HF fills them. ``auto_values``: values
    for "auto" keys, named like the keys or as HF's TrainingArguments names them
    (see [Note: where an "auto" value comes from] in auto.py, [Note: the argument
    table] in arguments.py).
    Raises ConfigError (a ValueError) naming key, value and fix; TypeError for
    an argument name that is none.
    """
    if isinstance(config, InfinityConfig):
        if world_size is None:
            world_size = config.world_size
        if not auto_values and optimizer is None and world_size == config.world_size:
            return config
        raw_again = config.to_dict()
        if world_size != config.world_size:
            del raw_again["train_batch_size"]
        again = load_config(
            raw_again, world_size=world_size, optimizer=optimizer, model=model, **auto_values
        )
        if config.optimizer is not None and again.optimizer == config.optimizer:
            # to_dict() writes no bookkeeping: keep how the optimizer section came to be
            again = dataclasses.replace(again, optimizer=config.optimizer)
        return again
    if world_size is None:
        world_size = 1
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be an integer >= 1; got {world_size!r}")
    if config is None:
        raw: dict[str, Any] = {}
    elif isinstance(config, (str, os.PathLike)):
        raw = read_config_file(config)
    elif isinstance(config, Mapping):
        raw = _plain(config)
    else:
        raise ConfigError(
            f"config must be a path, a dict or an InfinityConfig; got {type(config).__name__}"
        )

    parsed = normalize(raw)
    if parsed.unknown:
        raise ConfigError(_unknown_message(parsed.unknown))
    resolved = resolve(parsed.tree, auto_values, optimizer, model)
    sources = dict(resolved.sources)
    sources.update(complete_batch(parsed.tree, world_size))
    cfg = _build(
        InfinityConfig,
        parsed.tree,
        world_size=world_size,
        opaque=parsed.opaque,
        auto_filled=tuple(sorted(sources.items())),
        user_keys=frozenset(parsed.user_keys),
    )
    if resolved.trainer_optimizer:
        cfg = dataclasses.replace(
            cfg, optimizer=dataclasses.replace(cfg.optimizer, hf_trainer_default=True)
        )
    report_not_acted_on(k for k in parsed.user_keys if k in NOT_ACTED_ON or k in OPAQUE)
    defaulted = sorted(p for p, s in sources.items() if s.startswith("default"))
    if defaulted:
        logger.info(
            '"auto" keys with nothing passed for them took their defaults: %s', ", ".join(defaulted)
        )
    return cfg


def _unknown_message(unknown: list[str]) -> str:
    # Refused, not ignored: a misspelt key (zero_optimisation, offload_optimiser) would otherwise
    # run the defaults -- stage 0, nothing offloaded -- without a word. DeepSpeed's pydantic
    # sections refuse unknown keys too (extra="forbid").
    head = "unknown key " if len(unknown) == 1 else f"{len(unknown)} unknown keys in the config: "
    return (
        head
        + "; ".join(unknown)
        + ". infinity reads DeepSpeed's schema and refuses keys outside it, as DeepSpeed does "
        "inside its sections: correct the key or remove it"
    )


def _build(cls: type, node: dict[str, Any], **internal: Any) -> Any:
    """Constructs the section ``cls`` from a canonical, resolved sub-tree (validation in the class).

    ``internal``: the non-key fields of InfinityConfig (world_size, bookkeeping).
    """
    if cls is AioConfig:
        try:
            return AioConfig.from_dict(node)
        except ValueError as e:  # AioConfig's own messages already name aio.<key>
            raise ConfigError(str(e)) from e
    if cls is SchedulerConfig:
        pcls = SCHEDULE_PARAMS[node["type"]]
        return SchedulerConfig(type=node["type"], params=_build(pcls, node.get("params") or {}))
    kwargs: dict[str, Any] = dict(internal)
    for name, value in node.items():
        sub = subsection(cls, name, node)
        kwargs[name] = _build(sub, value) if sub is not None and isinstance(value, dict) else value
    try:
        return cls(**kwargs)
    except TypeError as e:
        # A required key (total_num_steps) is missing.
        path = getattr(cls, "PATH", "")
        missing = [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
            and f.name not in kwargs
        ]
        if not missing:
            raise
        owner = f" for {node_type}" if (node_type := _scheduler_type(cls)) else ""
        raise ConfigError(
            f"{path}.{missing[0]} is required{owner} and has no default; set it, or write "
            f'"auto" and pass {missing[0]}='
        ) from e


def _scheduler_type(cls: type) -> str | None:
    return next((t for t, c in SCHEDULE_PARAMS.items() if c is cls), None)
