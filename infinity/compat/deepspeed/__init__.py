"""DeepSpeed's public training API over infinity: ``import infinity.compat.deepspeed as deepspeed``.

DeepSpeed training code runs with that import as its only change: ``initialize``,
``init_distributed``, ``add_config_arguments``, ``zero`` (``Init``, ``GatheredParameters``,
``ZeroParamStatus``; the ``ds_*`` parameter attributes), ``checkpointing``, ``ops.adam``
(``DeepSpeedCPUAdam``, ``FusedAdam``), and the engine's DeepSpeed methods (``DeepSpeedEngine``).
What infinity cannot honour raises ``UnsupportedByInfinity`` naming the call ([Note: refused,
never different] in errors.py). docs/migrating-from-deepspeed.md lists it all.
"""

from infinity.compat.deepspeed import checkpointing, ops, zero
from infinity.compat.deepspeed.arguments import add_config_arguments
from infinity.compat.deepspeed.distributed import init_distributed
from infinity.compat.deepspeed.engine import DeepSpeedEngine
from infinity.compat.deepspeed.errors import UnsupportedByInfinity
from infinity.compat.deepspeed.initialize import initialize

__all__ = [
    "DeepSpeedEngine",
    "UnsupportedByInfinity",
    "add_config_arguments",
    "checkpointing",
    "init_distributed",
    "initialize",
    "ops",
    "zero",
]
