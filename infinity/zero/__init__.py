"""ZeRO partitioning: units of parameters, their gathering and release, gradient reduction, zero.Init."""

from infinity.zero.gathered import GatheredParameters
from infinity.zero.init_context import Init
from infinity.zero.pretrained import load_pretrained

__all__ = ["GatheredParameters", "Init", "load_pretrained"]
