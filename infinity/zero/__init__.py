"""ZeRO partitioning: units of parameters, their gathering and release, gradient reduction, zero.Init."""

from infinity.zero.init import Init

__all__ = ["Init"]
