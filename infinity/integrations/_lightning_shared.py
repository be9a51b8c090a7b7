"""What the Lightning Trainer strategy (lightning.py) and the Fabric strategy (fabric.py) share.

What every adapter shares (the config read, the engine as an ``nn.Module``, client-state
checkpoints) is in ``_shared.py``; this module is Lightning's alone:

- ``strategy_config``: Lightning's ``DeepSpeedStrategy`` keyword arguments, with DeepSpeed's
  meanings, as a DeepSpeed-style config dict. Only what the user set is written: a knob left at
  None is the engine's default (DeepSpeed's; infinity's own for aio), so a config never carries keys
  the engine would report as "accepted without effect" unless the user asked for them.
- ``read_config``: the ``config=`` argument, or the ``PL_DEEPSPEED_CONFIG_PATH`` variable
  Lightning's DeepSpeed strategy honours.
- Lightning's precision names onto the config's ``fp16`` / ``bf16`` sections (``add_precision``).
- ``sharded_context``: ``zero.Init`` for ``configure_model`` / ``fabric.init_module()``.
- ``load_gathered``: a single-file (whole-model) checkpoint into the stage-3 shards.

Nothing here imports lightning; nothing here or in the strategies imports deepspeed.
Threading: none of this is thread-safe; Lightning drives it from the training thread.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

import infinity
from infinity.config import ConfigError
from infinity.integrations import _shared
from infinity.integrations._shared import (
    is_auto,
    make_default_nvme_path,
    zero_stage,
)

CONFIG_ENV_VAR = "PL_DEEPSPEED_CONFIG_PATH"  # the variable Lightning's DeepSpeed strategies read
log = logging.getLogger("infinity.integrations")


# Lightning precision -> (engine dtype, config section). "-true" and "-mixed" both train the
# module in the 16-bit dtype with fp32 master weights, as DeepSpeed's engine does for both.
PRECISIONS: dict[str, tuple[torch.dtype, str | None]] = {
    "32-true": (torch.float32, None),
    "bf16-true": (torch.bfloat16, "bf16"),
    "bf16-mixed": (torch.bfloat16, "bf16"),
    "16-true": (torch.float16, "fp16"),
    "16-mixed": (torch.float16, "fp16"),
}


def check_precision(precision: str, strategy: str) -> tuple[torch.dtype, str | None]:
    if precision not in PRECISIONS:
        raise ValueError(
            f"precision={precision!r} is not supported by {strategy}; use one of {', '.join(PRECISIONS)} "
            "(the engine trains in fp32, bf16 or fp16, with fp32 master weights for the 16-bit ones)"
        )
    return PRECISIONS[precision]


# -- the config ------------------------------------------------------------------


def read_config(config: Any) -> dict[str, Any] | None:
    """``config=`` (or the path in ``PL_DEEPSPEED_CONFIG_PATH``) as a dict of our own, or None for
    "build one from the strategy's arguments"."""
    if config is None and os.environ.get(CONFIG_ENV_VAR):
        config = os.environ[CONFIG_ENV_VAR]
    return None if config is None else _shared.read_config(config)


def _given(**values: Any) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}


def strategy_config(
    *,
    zero_optimization: bool,
    stage: int,
    offload_optimizer: bool,
    offload_parameters: bool,
    offload_params_device: str,
    offload_optimizer_device: str,
    nvme_path: str,
    params_buffer_count: int | None,
    params_buffer_size: int | None,
    max_in_cpu: int | None,
    optimizer_buffer_count: int | None,
    pin_memory: bool | None,
    aio: dict[str, Any],
    zero_knobs: dict[str, Any],
    activation_checkpointing: dict[str, bool],
    logging_batch_size_per_gpu: int | str,
    zero_allow_untested_optimizer: bool | None,
) -> dict[str, Any]:
    """The config DeepSpeedStrategy builds from its arguments (``_create_default_config``), with
    unset knobs left out (``nvme_path`` is read only under an ``nvme`` device)."""
    for name, device in (
        ("offload_params_device", offload_params_device),
        ("offload_optimizer_device", offload_optimizer_device),
    ):
        if device not in ("cpu", "nvme"):
            raise ValueError(f"{name}={device!r}: offload to 'cpu' or 'nvme'")
    cfg: dict[str, Any] = {}
    if logging_batch_size_per_gpu != "auto":
        cfg["train_micro_batch_size_per_gpu"] = logging_batch_size_per_gpu
    if zero_optimization:
        zero: dict[str, Any] = {"stage": stage, **_given(**zero_knobs)}
        if offload_optimizer:
            zero["offload_optimizer"] = {
                "device": offload_optimizer_device,
                "nvme_path": nvme_path,
                **_given(buffer_count=optimizer_buffer_count, pin_memory=pin_memory),
            }
        if offload_parameters:
            zero["offload_param"] = {
                "device": offload_params_device,
                "nvme_path": nvme_path,
                **_given(
                    buffer_count=params_buffer_count,
                    buffer_size=params_buffer_size,
                    max_in_cpu=max_in_cpu,
                    pin_memory=pin_memory,
                ),
            }
        cfg["zero_optimization"] = zero
        if zero_allow_untested_optimizer is not None:
            cfg["zero_allow_untested_optimizer"] = zero_allow_untested_optimizer
    if _given(**aio):
        cfg["aio"] = _given(**aio)
    if any(activation_checkpointing.values()):
        cfg["activation_checkpointing"] = activation_checkpointing
    return cfg


def configure_strategy(strategy: Any, args: Mapping[str, Any]) -> None:
    """What InfinityStrategy and InfinityFabricStrategy do with DeepSpeedStrategy's keyword arguments
    (``args``, as the caller was given them) past their base class: the config (``config=``, else
    the one DeepSpeedStrategy would build), the attributes both read later, the fp16 loss-scale
    settings and the "infinity" logger's level (as DeepSpeedStrategy sets deepspeed's)."""
    a = args
    strategy.config = read_config(a["config"])
    if strategy.config is None:
        strategy.config = strategy_config(
            zero_optimization=a["zero_optimization"],
            stage=a["stage"],
            offload_optimizer=a["offload_optimizer"],
            offload_parameters=a["offload_parameters"],
            offload_params_device=a["offload_params_device"],
            offload_optimizer_device=a["offload_optimizer_device"],
            nvme_path=a["nvme_path"],
            params_buffer_count=a["params_buffer_count"],
            params_buffer_size=a["params_buffer_size"],
            max_in_cpu=a["max_in_cpu"],
            optimizer_buffer_count=a["optimizer_buffer_count"],
            pin_memory=a["pin_memory"],
            aio={
                k: a[k]
                for k in (
                    "block_size",
                    "queue_depth",
                    "single_submit",
                    "overlap_events",
                    "thread_count",
                )
            },
            zero_knobs={
                k: a[k]
                for k in (
                    "sub_group_size",
                    "contiguous_gradients",
                    "overlap_comm",
                    "allgather_partitions",
                    "reduce_scatter",
                    "allgather_bucket_size",
                    "reduce_bucket_size",
                )
            },
            activation_checkpointing={
                k: a[k]
                for k in (
                    "partition_activations",
                    "cpu_checkpointing",
                    "contiguous_memory_optimization",
                    "synchronize_checkpoint_boundary",
                )
            },
            logging_batch_size_per_gpu=a["logging_batch_size_per_gpu"] or "auto",
            zero_allow_untested_optimizer=a["zero_allow_untested_optimizer"],
        )
    strategy.remote_device = a["remote_device"]
    strategy.nvme_path = a["nvme_path"]
    strategy.load_full_weights = a["load_full_weights"]
    if a["exclude_frozen_parameters"]:
        log.info(
            "exclude_frozen_parameters=True: infinity's checkpoints hold every parameter, frozen ones too"
        )
    strategy.exclude_frozen_parameters = a["exclude_frozen_parameters"]
    strategy._fp16 = {
        k: a[k]
        for k in (
            "loss_scale",
            "initial_scale_power",
            "loss_scale_window",
            "hysteresis",
            "min_loss_scale",
        )
    }
    logging.getLogger("infinity").setLevel(a["logging_level"])
    strategy._config_formatted = False


def fill(config: dict[str, Any], key: str, value: Any, *, source: str) -> None:
    """Sets a top-level key the framework decides (accumulation, clipping), where the config leaves
    it unset or ``"auto"``; a different value written in the config is refused, naming both."""
    have = config.get(key, "auto")
    if is_auto(have):
        config[key] = value
    elif have != value:
        raise ConfigError(
            f"the config sets {key}={have!r} and {source} asks for {value!r}; set it in one place (remove "
            f"{key} from the config, or make them agree)"
        )


def add_precision(
    config: dict[str, Any], precision: str, *, strategy: str, fp16: dict[str, Any]
) -> None:
    """Lightning's precision into the config's ``fp16`` / ``bf16`` sections (DeepSpeed's
    ``_format_precision_config``); a config that enables another dtype than the precision is refused."""
    _, section = check_precision(precision, strategy)
    for name in ("fp16", "bf16"):
        node = config.get(name)
        if isinstance(node, Mapping) and is_auto(node.get("enabled")):
            config[name] = {**node, "enabled": name == section}
    enabled = [
        n
        for n in ("fp16", "bf16")
        if isinstance(config.get(n), Mapping) and config[n].get("enabled") is True
    ]
    if enabled and enabled != [section]:
        raise ConfigError(
            f"the config enables {enabled[0]} but the precision is {precision!r}; pass the precision that "
            f"matches ({'bf16-mixed' if enabled[0] == 'bf16' else '16-mixed'}) or remove the {enabled[0]} section"
        )
    if section is not None and section not in enabled:
        config[section] = {"enabled": True, **(fp16 if section == "fp16" else {})}


def init_config(
    config: dict[str, Any], remote_device: str | None, nvme_path: str
) -> dict[str, Any]:
    """The config zero.Init builds the model with: DeepSpeed's ``remote_device`` (where parameters
    wait between construction and ``initialize``) overrides ``offload_param`` for the build only."""
    if remote_device is None:
        return config
    if remote_device not in ("cpu", "nvme"):
        raise ValueError(
            f"remote_device={remote_device!r}: build the model's parameters into 'cpu' or 'nvme' "
            "(or None: where offload_param puts them)"
        )
    out = copy.deepcopy(config)
    zero = out.setdefault("zero_optimization", {})
    param = dict(zero.get("offload_param") or {})
    param["device"] = remote_device
    if remote_device == "nvme":
        param.setdefault("nvme_path", nvme_path)
    zero["offload_param"] = param
    return out


@contextlib.contextmanager
def sharded_context(
    config: dict[str, Any], remote_device: str | None, nvme_path: str
) -> Iterator[None]:
    """``infinity.zero.Init`` under stage 3 (modules built inside go straight to their shards);
    nothing under the other stages, as with DeepSpeed."""
    if zero_stage(config) != 3:
        yield
        return
    config = init_config(config, remote_device, nvme_path)
    make_default_nvme_path(config)
    with infinity.zero.Init(config=config):
        yield


def evaluation_config(config: dict[str, Any]) -> dict[str, Any]:
    """An engine for validate/test/predict before any training: infinity.initialize builds a training
    engine, which needs an optimizer; the config's, or an AdamW that is never stepped (its state is
    allocated as for training, and no moment is ever read)."""
    if "optimizer" in config:
        return config
    return {**config, "optimizer": {"type": "AdamW", "params": {"lr": 0.0}}}


def cast_floating_buffers(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """16-bit training: the engine keeps each parameter's fp32 master and gives the module the
    16-bit copy; floating-point buffers (running statistics, ...) follow the module's dtype, as
    DeepSpeed's engine casts the whole module."""
    if dtype == torch.float32:
        return module
    for sub in module.modules():
        for name, buf in sub.named_buffers(recurse=False):
            if buf is not None and buf.is_floating_point():
                setattr(sub, name, buf.to(dtype))
    return module


def convert_floats(data: Any, dtype: torch.dtype) -> Any:
    """Floating-point tensors in a batch (nested lists, tuples, dicts) in the training dtype."""
    if isinstance(data, torch.Tensor):
        return data.to(dtype) if data.is_floating_point() and data.dtype != dtype else data
    if isinstance(data, (list, tuple)) and not hasattr(data, "_fields"):
        return type(data)(convert_floats(v, dtype) for v in data)
    if isinstance(data, tuple):  # a namedtuple
        return type(data)(*(convert_floats(v, dtype) for v in data))
    if isinstance(data, Mapping):
        return type(data)({k: convert_floats(v, dtype) for k, v in data.items()})  # type: ignore[call-arg]
    return data


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Tensors created inside default to ``dtype`` (the "-true" precisions' module construction)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def load_gathered(
    module: nn.Module,
    state_dict: Mapping[str, Any],
    *,
    strict: bool,
    rank: int,
    broadcast: Callable[[Any], Any],
) -> None:
    """A whole state dict into stage-3 shards, one module's parameters gathered at a time: rank 0
    reads the file's values, GatheredParameters writes them back to every rank's shard and fp32
    master. Every rank raises if rank 0 found a mismatch."""
    missing: list[str] = []
    unexpected: list[str] = []
    errors: list[str] = []
    state_dict = dict(state_dict)
    for prefix, sub in module.named_modules():
        with infinity.GatheredParameters(list(sub.parameters(recurse=False)), modifier_rank=0):
            if rank == 0:
                sub._load_from_state_dict(
                    state_dict,
                    f"{prefix}." if prefix else "",
                    {},
                    strict,
                    missing,
                    unexpected,
                    errors,
                )
    if strict:
        errors += [f"missing key {k!r}" for k in missing] + [
            f"unexpected key {k!r}" for k in unexpected
        ]
    errors = broadcast(errors)
    if errors:
        raise RuntimeError("loading the full weights into the stage-3 shards: " + "; ".join(errors))


def register_names(registry: Any, cls: type) -> None:
    """The names of Lightning's DeepSpeed strategies (Trainer's and Fabric's), "deepspeed" spelt "infinity"."""
    nvme = {
        "remote_device": "nvme",
        "offload_params_device": "nvme",
        "offload_optimizer_device": "nvme",
    }
    for name, description, kwargs in (
        ("infinity", "infinity: ZeRO stage 2", {}),
        ("infinity_stage_1", "infinity: ZeRO stage 1", {"stage": 1}),
        (
            "infinity_stage_1_offload",
            "infinity: ZeRO stage 1, optimizer on CPU",
            {"stage": 1, "offload_optimizer": True},
        ),
        ("infinity_stage_2", "infinity: ZeRO stage 2", {"stage": 2}),
        (
            "infinity_stage_2_offload",
            "infinity: ZeRO stage 2, optimizer on CPU",
            {"stage": 2, "offload_optimizer": True},
        ),
        ("infinity_stage_3", "infinity: ZeRO stage 3", {"stage": 3}),
        (
            "infinity_stage_3_offload",
            "infinity: ZeRO stage 3, parameters and optimizer on CPU",
            {"stage": 3, "offload_optimizer": True, "offload_parameters": True},
        ),
        (
            "infinity_stage_3_offload_nvme",
            "infinity: ZeRO stage 3, parameters and optimizer on NVMe",
            {"stage": 3, "offload_optimizer": True, "offload_parameters": True, **nvme},
        ),
    ):
        if name not in registry:
            registry.register(name, cls, description=description, **kwargs)
