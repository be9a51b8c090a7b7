"""``deepspeed.ops``: the optimizer classes DeepSpeed code names (``ops.adam``)."""

from infinity.compat.deepspeed.ops import adam

__all__ = ["adam"]
