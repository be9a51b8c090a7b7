"""``host_memory_budget``: how much host memory the placement planner may fill, as bytes or a fraction.

The key is infinity's own (top level). It is read when a section's ``device``
is ``"auto"``: the planner keeps the training state that saves the most NVMe
traffic per byte in host memory within the budget and spills the rest
(infinity.estimate.placement). Forms accepted:

- bytes: an integer above 1 (``12884901888``) or a string with a unit
  (``"12GiB"``, ``"512 MiB"``, ``"8GB"``: KiB/MiB/GiB/TiB are powers of 1024,
  KB/MB/GB/TB of 1000);
- a fraction of the host memory available when the run starts: a number in
  [0, 1] (``0.5``) or a percentage (``"50%"``);
- absent (null): the available memory less a safety margin.

The budget counts what the run allocates beyond what the process holds when
``initialize`` runs (its baseline and the model as built): the quantity the
pre-flight check compares with the available memory.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from infinity.config.errors import ConfigError

KEY = "host_memory_budget"

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_PERCENT = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*%\s*$")


@dataclasses.dataclass(frozen=True)
class HostMemoryBudget:
    """A parsed ``host_memory_budget``: exactly one of ``nbytes`` and ``fraction`` is set."""

    nbytes: int | None = None
    fraction: float | None = None
    """Of the host memory available when the run starts, in [0, 1]."""

    def resolve(self, available_nbytes: int) -> int:
        """The budget in bytes, given the host memory available now."""
        if self.nbytes is not None:
            return self.nbytes
        assert self.fraction is not None
        return int(self.fraction * max(0, available_nbytes))

    def describe(self) -> str:
        if self.nbytes is not None:
            return f"{self.nbytes:,} bytes"
        return f"{self.fraction:.0%} of the available host memory"


def _refuse(value: Any) -> ConfigError:
    return ConfigError(
        f'{KEY} must be bytes (an integer above 1, or a string with a unit such as "12GiB" or '
        f'"512MB") or a fraction of the available host memory (a number in [0, 1], or a percentage '
        f'such as "50%"); got {value!r}'
    )


def parse_host_memory_budget(value: Any) -> HostMemoryBudget | None:
    """``value`` as written in the config (None: not set); ConfigError naming the key otherwise."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise _refuse(value)
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value < 0:
            raise _refuse(value)
        if value <= 1:
            return HostMemoryBudget(fraction=float(value))
        if isinstance(value, float) and not value.is_integer():
            raise _refuse(value)
        return HostMemoryBudget(nbytes=int(value))
    if isinstance(value, str):
        m = _PERCENT.match(value)
        if m:
            pct = float(m.group(1))
            if pct > 100:
                raise _refuse(value)
            return HostMemoryBudget(fraction=pct / 100)
        m = _SIZE.match(value)
        if m:
            unit = m.group(2).lower() or "b"
            if unit in _UNITS:
                return HostMemoryBudget(nbytes=int(float(m.group(1)) * _UNITS[unit]))
    raise _refuse(value)
