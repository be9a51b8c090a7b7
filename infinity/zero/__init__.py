"""ZeRO partitioning: units of parameters, their gathering and release, gradient reduction, zero.Init."""

from infinity.zero.gathered import GatheredParameters
from infinity.zero.init import Init

__all__ = ["GatheredParameters", "Init"]
