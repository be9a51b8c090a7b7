"""ZeroSetting: where a run's state lives — the ZeRO stage and the two offload devices — and the config for one.

``all_settings()`` lists every valid one (``infinity estimate`` compares them
all); ``config_for`` turns a user's config into another setting, keeping its
sizes, precision and thresholds.
"""

from __future__ import annotations

import dataclasses

from infinity.config import InfinityConfig
from infinity.config.zero import NvmePath, OffloadDevice, ZeroStage

Where = OffloadDevice

DEFAULT_NVME_PATH = "./infinity_nvme"
"""Where settings that put state on NVMe swap when the config names no nvme_path (the demo's default)."""


@dataclasses.dataclass(frozen=True)
class ZeroSetting:
    """Where state lives: the ZeRO stage and the two offload devices."""

    stage: ZeroStage
    offload_param: Where
    offload_optimizer: Where
    tuned: bool = False
    """The config's sizing keys changed to fit (see tune.py); the plan lists the changes."""

    def label(self) -> str:
        tuned = " (tuned)" if self.tuned else ""
        return f"stage {self.stage}, params {self.offload_param}, optimizer {self.offload_optimizer}{tuned}"

    def keys(self) -> str:
        """The config keys that select this setting."""
        parts = [f"zero_optimization.stage={self.stage}"]
        if self.stage == 3:
            parts.append(f"offload_param.device={self.offload_param}")
        if self.stage >= 1:
            parts.append(f"offload_optimizer.device={self.offload_optimizer}")
        return ", ".join(parts)

    def words(self) -> str:
        """A reader's description: 'params on NVMe and optimizer on NVMe'."""
        where = {
            "none": "in device memory",
            "cpu": "in host memory",
            "nvme": "on NVMe",
            "auto": "in host memory or on NVMe as the placement planner chose",
        }
        p = "partitioned params" if self.stage == 3 else "params"
        opt_where = where[self.offload_optimizer]
        if self.offload_optimizer == "none":
            opt_where = "not offloaded"
        return f"stage {self.stage} with {p} {where[self.offload_param]} and optimizer {opt_where}"


def all_settings() -> list[ZeroSetting]:
    """Every valid setting: offload_param needs stage 3; offload_optimizer needs stage >= 1."""
    devices: tuple[Where, ...] = ("none", "cpu", "nvme")
    stages: tuple[ZeroStage, ...] = (1, 2)
    out = [ZeroSetting(0, "none", "none")]
    for stage in stages:
        for o in devices:
            out.append(ZeroSetting(stage, "none", o))
    for p in devices:
        for o in devices:
            out.append(ZeroSetting(3, p, o))
    return out


def config_for(cfg: InfinityConfig, setting: ZeroSetting, nvme_path: NvmePath) -> InfinityConfig:
    """``cfg`` with its stage and offload devices set to ``setting`` (nvme_path filled where missing)."""
    zero = cfg.zero_optimization
    p, o = zero.offload_param, zero.offload_optimizer
    p_path = p.nvme_path or o.nvme_path or nvme_path
    o_path = o.nvme_path or p.nvme_path or nvme_path
    new_zero = dataclasses.replace(
        zero,
        stage=setting.stage,
        offload_param=dataclasses.replace(
            p,
            device=setting.offload_param,
            nvme_path=p_path if setting.offload_param == "nvme" else p.nvme_path,
        ),
        offload_optimizer=dataclasses.replace(
            o,
            device=setting.offload_optimizer,
            nvme_path=o_path if setting.offload_optimizer == "nvme" else o.nvme_path,
        ),
    )
    return dataclasses.replace(cfg, zero_optimization=new_zero)
