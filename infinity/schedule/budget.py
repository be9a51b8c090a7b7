"""ScheduleBudget: the three byte budgets of the prefetch scheduler, validated, and their DeepSpeed names.

DeepSpeed counts these in parameter elements; the scheduler counts bytes
(elements × the parameter dtype's itemsize), so a budget means the same
memory whatever the dtype. ``from_deepspeed`` converts, and ``check_serves``
is the engine's check at construction: it refuses a configuration under
which the scheduler could not keep the live budget (a unit, or the units the
partitioner holds together, larger than ``max_live_nbytes``) or under which a
fetch could wait for pool memory that never comes (the pool smaller than
those units), naming the key to raise and the value that works.

Threading: immutable.
"""

from __future__ import annotations

import dataclasses
import math

from infinity.aio import DIRECT_ALIGNMENT
from infinity.memory import format_nbytes, round_up
from infinity.schedule.errors import ScheduleConfigError

# DeepSpeed's config keys, for messages.
BUCKET_KEY = "zero_optimization.stage3_prefetch_bucket_size"
LIVE_KEY = "zero_optimization.stage3_max_live_parameters"
REUSE_KEY = "zero_optimization.stage3_max_reuse_distance"
POOL_KEY = "zero_optimization.offload_param.buffer_count / buffer_size"


def _count(name: str, value: object) -> int:
    """A non-negative whole number (DeepSpeed configs write 5e7: floats with integer values pass)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ScheduleConfigError(f"{name} must be a non-negative whole number, got {value!r}")
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise ScheduleConfigError(f"{name} must be a non-negative whole number, got {value!r}")
    if value < 0:
        raise ScheduleConfigError(f"{name} must be >= 0, got {value!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class ScheduleBudget:
    """Byte budgets (see [Note: budgets] in scheduler.py for exactly what each bounds)."""

    prefetch_bucket_nbytes: int
    """Bytes moved ahead of use (read from NVMe or copied to the device) and not yet used
    (DeepSpeed: stage3_prefetch_bucket_size). 0 turns prefetch off."""
    max_live_nbytes: int
    """Bytes the scheduler holds at once: in use, prefetched, in flight, kept for reuse
    (DeepSpeed: stage3_max_live_parameters)."""
    max_reuse_distance_nbytes: int
    """A unit used again within this many bytes of trace is kept instead of released
    (DeepSpeed: stage3_max_reuse_distance)."""
    itemsize: int = 1
    """Bytes per element of the budgets' DeepSpeed form (messages only)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _count(f.name, getattr(self, f.name))
        if self.itemsize < 1:
            raise ScheduleConfigError(f"itemsize must be >= 1, got {self.itemsize}")

    @classmethod
    def from_deepspeed(
        cls,
        *,
        prefetch_bucket_size: float,
        max_live_parameters: float,
        max_reuse_distance: float,
        itemsize: int,
    ) -> ScheduleBudget:
        """From DeepSpeed's element counts and the parameters' itemsize (2 for bf16/fp16, 4 for fp32)."""
        itemsize = _count("itemsize", itemsize)
        return cls(
            _count(BUCKET_KEY, prefetch_bucket_size) * itemsize,
            _count(LIVE_KEY, max_live_parameters) * itemsize,
            _count(REUSE_KEY, max_reuse_distance) * itemsize,
            itemsize=max(itemsize, 1),
        )

    def _elements(self, nbytes: int) -> str:
        n = -(-nbytes // self.itemsize)
        return f"{n} elements" if self.itemsize > 1 else f"{n} bytes"

    def check_serves(
        self,
        *,
        largest_unit_nbytes: int,
        working_set_nbytes: int | None = None,
        pool_capacity: int | None = None,
        pool_working_set_nbytes: int | None = None,
        largest_unit: str = "the largest unit",
    ) -> None:
        """Refuses budgets under which the scheduler could not keep its promises (engine-facing).

        ``working_set_nbytes``: the most bytes the consumer holds at once (the
        partitioner: the units of the modules nested along the deepest path of
        the model, at least the largest unit). ``pool_capacity``: the store's
        pool, which must hold what of that working set lives on NVMe
        (``pool_working_set_nbytes``, default all of it; 0 when no unit does),
        or a fetch waits for memory that only the waiting caller could release.
        """
        working = max(largest_unit_nbytes, working_set_nbytes or 0)
        if self.max_live_nbytes < working:
            what = (
                f"{largest_unit} ({format_nbytes(largest_unit_nbytes)})"
                if working == largest_unit_nbytes
                else f"the units the model holds at once ({format_nbytes(working)}; "
                f"{largest_unit} alone is {format_nbytes(largest_unit_nbytes)})"
            )
            raise ScheduleConfigError(
                f"{LIVE_KEY} = {self._elements(self.max_live_nbytes)} ({format_nbytes(self.max_live_nbytes)}) "
                f"is smaller than {what}: the scheduler would have to exceed it to make progress. "
                f"Raise {LIVE_KEY} to at least {self._elements(working)}"
            )
        pool_working = working if pool_working_set_nbytes is None else pool_working_set_nbytes
        if pool_capacity is not None and pool_working > 0:
            need = round_up(pool_working, DIRECT_ALIGNMENT)  # the pool rounds each region up to it
            if pool_capacity < need:
                raise ScheduleConfigError(
                    f"the parameter buffer pool ({format_nbytes(pool_capacity)}) cannot hold "
                    f"{'the units the model holds at once' if pool_working > largest_unit_nbytes else largest_unit} "
                    f"({format_nbytes(need)}): a fetch would wait for pool memory that only the waiting "
                    f"caller could release. Raise {POOL_KEY} so that buffer_count x buffer_size >= "
                    f"{self._elements(need)}"
                )
