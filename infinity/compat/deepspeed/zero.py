"""``deepspeed.zero``: ``Init``, ``GatheredParameters`` and ``ZeroParamStatus``, over infinity's
``zero.Init`` and ``GatheredParameters``, with DeepSpeed's signatures.

Parameters built under ``Init`` get DeepSpeed's ``ds_*`` attributes (params.py) as their module is
partitioned, as under DeepSpeed. What this face cannot honour is refused ([Note: refused, never
different] in errors.py).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules import module as module_hooks

import infinity.zero
from infinity.compat.deepspeed.distributed import init_distributed
from infinity.compat.deepspeed.errors import refuse
from infinity.compat.deepspeed.params import ZeroParamStatus, mark
from infinity.config import read_config_file

log = logging.getLogger("infinity.compat")

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus"]

_REMOTE_DEVICES = ("cpu", "nvme")


def _config_dict(config: Any, call: str) -> dict[str, Any] | None:
    if config is None:
        return None
    if isinstance(config, (str, os.PathLike)):
        return read_config_file(config)
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    raise TypeError(
        f"{call}: config_dict_or_path takes a DeepSpeed config (a dict or the path of a JSON file), "
        f"not {type(config).__name__}"
    )


def _with_remote_device(config: dict[str, Any] | None, remote_device: str) -> dict[str, Any]:
    """``config`` with the device zero.Init keeps the partitions on set to ``remote_device``, after
    DeepSpeed's checks (``nvme`` needs the config's ``offload_param.nvme_path``; ``cpu`` cannot be
    asked of a config that offloads parameters to NVMe)."""
    call = f"deepspeed.zero.Init(remote_device={remote_device!r})"
    if remote_device not in _REMOTE_DEVICES:
        raise refuse(
            call,
            "infinity keeps the partitions of a model being built in host memory or on NVMe, not on "
            "an accelerator",
            "pass remote_device='cpu' or 'nvme' (or leave it None: the config's offload_param decides)",
        )
    config = config if config is not None else {"zero_optimization": {"stage": 3}}
    zero = config.setdefault("zero_optimization", {})
    offload = zero.get("offload_param") or {}
    if remote_device == "nvme" and not offload.get("nvme_path"):
        raise ValueError(
            f"{call} needs zero_optimization.offload_param.nvme_path in config_dict_or_path (the folder "
            "the partitions are written to), as DeepSpeed does"
        )
    if remote_device == "cpu" and offload.get("device") == "nvme":
        raise ValueError(
            f"{call} contradicts the config's zero_optimization.offload_param.device 'nvme' (DeepSpeed "
            "refuses it too); drop one of them"
        )
    zero["offload_param"] = {**offload, "device": remote_device}
    return config


class Init(contextlib.ContextDecorator):
    """``deepspeed.zero.Init``: modules built inside have their parameters partitioned as they are
    created (infinity.zero.Init), and given the ``ds_*`` attributes. Also a decorator, as DeepSpeed's.

    ``config_dict_or_path`` (``config``: its deprecated name, which wins, as in DeepSpeed) decides
    where the partitions wait (``offload_param``); ``remote_device`` ("cpu" or "nvme") overrides it.
    ``mem_efficient_linear`` and ``pin_memory`` change nothing here (no effect on the values). A
    config passed as the first argument (where DeepSpeed takes ``module``, which is refused here) is
    taken as ``config_dict_or_path``: the Accelerate guide writes ``zero.Init(plugin.config)``.
    Initialises ``torch.distributed`` when it is not (DeepSpeed's ``init_distributed``)."""

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
        zero_param_parallel_group: Any = None,
        zero_quantized_weights: bool = False,
        zero_quantized_nontrainable_weights: bool = False,
        sequence_data_parallel_group: Any = None,
        param_swapper: Any = None,
    ):
        call = "deepspeed.zero.Init"
        if isinstance(module, (Mapping, str, os.PathLike)) and config_dict_or_path is None:
            config_dict_or_path, module = module, None  # the Accelerate guide's positional config
        if module is not None:
            raise refuse(
                f"{call}(module=...)",
                "infinity partitions a model as it is built inside the context, or when initialize() "
                "takes it, and not in between",
                "build the model inside `with deepspeed.zero.Init(...)`, or pass the built model to "
                "deepspeed.initialize(), which partitions it",
            )
        if data_parallel_group is not None and data_parallel_group is not dist.group.WORLD:
            raise refuse(
                f"{call}(data_parallel_group=...)",
                "infinity partitions over all processes (the default process group)",
                "leave data_parallel_group None",
            )
        if mpu is not None:
            raise refuse(f"{call}(mpu=...)", "no model parallelism in infinity", "pass mpu=None")
        extra = {
            "zero_param_parallel_group": zero_param_parallel_group is not None,
            "zero_quantized_weights": bool(zero_quantized_weights),
            "zero_quantized_nontrainable_weights": bool(zero_quantized_nontrainable_weights),
            "sequence_data_parallel_group": sequence_data_parallel_group is not None,
            "param_swapper": param_swapper is not None,
        }
        for name, given in extra.items():
            if given:
                raise refuse(
                    f"{call}({name}=...)",
                    "infinity has no equivalent (hierarchical partitioning, quantised weights in "
                    "zero.Init, sequence parallelism and custom swappers are DeepSpeed's)",
                    f"leave {name} at its default",
                )
        if config is not None:
            if config_dict_or_path is not None:
                log.warning(
                    "zero.Init: both config and config_dict_or_path given; config (deprecated) is used, "
                    "as DeepSpeed does"
                )
            config_dict_or_path = config
        sections = _config_dict(config_dict_or_path, call)
        if remote_device is not None:
            sections = _with_remote_device(sections, remote_device)
        self.config = sections
        self.enabled = enabled
        self.dtype = dtype
        if not dist.is_initialized():
            init_distributed()  # as DeepSpeed's Init does: its partitions span the process group
        self._inner: infinity.zero.Init | None = None
        self._hook: Any = None

    def __enter__(self) -> Init:
        inner = infinity.zero.Init(self.config, enabled=self.enabled, dtype=self.dtype)
        inner.__enter__()
        self._inner = inner
        if inner.store is not None:
            store = inner.store
            # After infinity's own hook, which partitions the child first (registered earlier).
            self._hook = module_hooks.register_module_module_registration_hook(
                lambda parent, name, child: _mark_partitioned(child, store)
            )
        return self

    def __exit__(self, *exc: object) -> None:
        inner, self._inner = self._inner, None
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if inner is None:
            return
        inner.__exit__(*exc)
        if inner.store is not None:
            for p in list(inner.store.records.keys()):
                mark(p)


def _mark_partitioned(child: nn.Module | None, store: Any) -> None:
    if child is None:
        return
    for p in child.parameters():
        if p in store.records:
            mark(p)


class GatheredParameters(infinity.zero.GatheredParameters):
    """``deepspeed.zero.GatheredParameters(params, modifier_rank=None, fwd_module=None, enabled=True)``:
    inside the context the parameters are whole on every rank; with ``modifier_rank`` that rank's
    changes become every rank's (infinity.zero.GatheredParameters)."""

    def __init__(
        self,
        params: Any,
        modifier_rank: int | None = None,
        fwd_module: nn.Module | None = None,
        enabled: bool = True,
    ):
        if fwd_module is not None:
            raise refuse(
                "deepspeed.zero.GatheredParameters(fwd_module=...)",
                "infinity has no external parameters to register (a module's forward fetches every "
                "parameter it uses)",
                "leave fwd_module None",
            )
        super().__init__(params, modifier_rank=modifier_rank, enabled=enabled)
