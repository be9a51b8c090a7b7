"""CPU Adam (csrc/adam): the CPUAdam optimizer, the flat functional step, the overflow and norm checks."""

from infinity.optim.cpu_adam import CPUAdam
from infinity.optim.functional import (
    AdamHyper,
    adam_step,
    foreach_adam_step,
    has_overflow,
    stream_bound_step,
    sum_squares,
)
from infinity.optim.kernel import best_isa, get_isa, set_isa, supported_isas, use_isa

__all__ = [
    "AdamHyper",
    "CPUAdam",
    "adam_step",
    "best_isa",
    "foreach_adam_step",
    "get_isa",
    "has_overflow",
    "set_isa",
    "stream_bound_step",
    "sum_squares",
    "supported_isas",
    "use_isa",
]
