"""The CPU as /proc/cpuinfo describes it: model name and feature flags.

The first processor's entry stands for all (the kernel lists the same model
and flags for every core of a machine). x86 says ``model name`` and ``flags``;
arm64 says ``Features`` and, on most kernels, no model name.

Threading: stateless; safe from any thread.
"""

from __future__ import annotations

import dataclasses

from infinity.host._read import read_text

CPUINFO = "/proc/cpuinfo"


@dataclasses.dataclass(frozen=True)
class CpuInfo:
    """What /proc/cpuinfo says of the first processor."""

    model: str
    """The model name ('' where the kernel gives none)."""
    flags: frozenset[str]
    """Feature flags as the kernel names them: 'avx2', 'avx512f', 'asimd', ..."""


def parse_cpuinfo(text: str) -> CpuInfo:
    """``/proc/cpuinfo`` text -> the first processor's model name and flags."""
    model, flags = "", None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and flags is None:
            flags = frozenset(value.split())
    return CpuInfo(model, flags or frozenset())


def cpu_info() -> CpuInfo:
    """This machine's CPU; empty fields where /proc/cpuinfo cannot be read."""
    text = read_text(CPUINFO)
    return parse_cpuinfo(text) if text is not None else CpuInfo("", frozenset())


def cpu_model() -> str:
    """The CPU's model name ('' where there is none)."""
    return cpu_info().model


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (empty where unknown)."""
    return cpu_info().flags
