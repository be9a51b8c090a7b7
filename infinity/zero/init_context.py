"""The ``zero.Init`` context: modules built inside have their parameters partitioned into an
``InitStore`` (init.py) as they are created, and transformers' ``from_pretrained`` under it streams a
checkpoint into the shards (hf_init.py). It sits above both, which know nothing of it."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch.nn.modules import module as module_hooks

from infinity.store import Home
from infinity.zero import hf_init
from infinity.zero.collectives import DataParallelGroup
from infinity.zero.init import InitMode, InitStore

log = logging.getLogger("infinity.zero")


INIT_SECTIONS = ("zero_optimization", "aio", "bf16", "bfloat16", "fp16")
"""The parts of a config zero.Init reads."""

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes zero.Init partitions floating-point parameters in (DeepSpeed's)."""


def _init_sections(config: Any) -> dict[str, Any]:
    """The sections of ``config`` (a path, a mapping, None) that zero.Init reads. An "auto" elsewhere
    (lr, batch sizes: HF writes its configs full of them) is for initialize() to fill, so a config
    written for HF's Trainer builds a model under Init with no arguments, as under DeepSpeed's."""
    from infinity.config import read_config_file

    if config is None:
        return {"zero_optimization": {"stage": 3}}
    raw = read_config_file(config) if isinstance(config, (str, os.PathLike)) else dict(config)
    return {k: raw[k] for k in INIT_SECTIONS if k in raw}


class Init:
    """Context manager: modules built inside have their parameters partitioned as they are created.

    ``config`` is the training config (path or dict) or an already loaded
    InfinityConfig; it decides where parameters wait (``offload_param``).
    Floating-point parameters wait in ``dtype`` (fp32, bf16 or fp16) where
    given, else in the dtype of the config's enabled ``bf16`` / ``fp16``
    section, else each in the dtype it was built in, as DeepSpeed chooses but
    for the last ([Note: zero.Init's dtype] in init.py). With a stage below 3
    the context does nothing (DeepSpeed's behaviour), and says so.
    """

    def __init__(
        self,
        config: Any = None,
        *,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        **auto_values: Any,
    ):
        if dtype is not None and dtype not in DTYPES:
            raise ValueError(
                f"zero.Init(dtype={dtype}): parameters are partitioned in torch.float32, "
                "torch.bfloat16 or torch.float16 (DeepSpeed's choices); pass one of them, or None "
                "for the config's bf16 / fp16 section"
            )
        self.enabled = enabled
        self.config = config
        self.dtype = dtype
        self.auto_values = auto_values
        self._mode: InitMode | None = None
        self._handles: list[Any] = []
        self._load_patch = hf_init.TransformersLoadPatch()
        self.store: InitStore | None = None

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        from infinity.config import InfinityConfig, load_config

        group = DataParallelGroup()
        cfg = self.config
        if not isinstance(cfg, InfinityConfig):
            cfg = load_config(_init_sections(cfg), world_size=group.world_size, **self.auto_values)
        zero = cfg.zero_optimization
        if zero.stage != 3:
            log.warning(
                "zero.Init does nothing with zero_optimization.stage=%d (it partitions for stage 3)",
                zero.stage,
            )
            self.enabled = False
            return self
        offload = zero.offload_param
        # "auto": the placement planner has not run yet (it needs the model); the model as built waits
        # on NVMe, which holds any model, and goes home from there.
        home: Home = "nvme" if offload.device in ("nvme", "auto") else "cpu"
        self.store = InitStore(
            home=home,
            nvme_path=offload.nvme_path if home == "nvme" else None,
            aio=cfg.aio,
            group=group,
            dtype=self.dtype or _config_dtype(cfg),
        )
        self._mode = InitMode(self.store)
        self.store.settle = self._mode.finish
        self._handles = [
            module_hooks.register_module_module_registration_hook(self._mode.on_module_registered),
            module_hooks.register_module_parameter_registration_hook(
                self._mode.on_param_registered
            ),
        ]
        self._mode.__enter__()
        self._load_patch.__enter__()  # [Note: from_pretrained under zero.Init]
        return self

    def __exit__(self, *exc: object) -> None:
        if self._mode is None:
            return
        mode = self._mode
        self._mode = None
        self._load_patch.__exit__(*exc)
        mode.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        mode.finish()
        mode.store.building = False


def _config_dtype(cfg: Any) -> torch.dtype | None:
    """The 16-bit dtype the config trains in, None for fp32 (the parameters then rest as built)."""
    if cfg.bf16.enabled:
        return torch.bfloat16
    if cfg.fp16.enabled:
        return torch.float16
    return None
