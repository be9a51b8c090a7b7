"""The host-memory budget the placement planner plans within: ``host_memory_budget``, else the available memory less a margin.

Point 1 of [Note: the placement planner] (placement.py): bytes, or a fraction
of the available host memory (this machine's, capped by the memory cgroup),
per rank when several share a node. ``check_budget`` refuses a placement that
needs more than a budget the config sets.
"""

from __future__ import annotations

from infinity.config import ConfigError, InfinityConfig
from infinity.estimate.machine import MachineView
from infinity.estimate.runtime_plan import RuntimePlan
from infinity.memory import format_nbytes

SAFETY_MARGIN = 0.10
"""Share of the available host memory the default budget leaves free (the OS, the page cache, other jobs)."""
MIN_MARGIN_NBYTES = 512 << 20


def default_budget(machine: MachineView, ranks_per_node: int) -> tuple[int, str]:
    """The available host memory per rank less the safety margin, and how it was found."""
    avail = (machine.mem_available_nbytes + machine.hugetlb_free_nbytes) // max(1, ranks_per_node)
    margin = max(int(SAFETY_MARGIN * avail), MIN_MARGIN_NBYTES)
    per = f" per rank ({ranks_per_node} on this node)" if ranks_per_node > 1 else ""
    return max(0, avail - margin), (
        f"the available host memory{per}, {format_nbytes(avail)}, less a "
        f"safety margin of {format_nbytes(margin)}"
    )


def resolve_budget(
    cfg: InfinityConfig, machine: MachineView, ranks_per_node: int
) -> tuple[int, str]:
    """host_memory_budget in bytes per rank (and how it was found), or the default."""
    budget = cfg.host_budget
    if budget is None:
        return default_budget(machine, ranks_per_node)
    avail = (machine.mem_available_nbytes + machine.hugetlb_free_nbytes) // max(1, ranks_per_node)
    nbytes = budget.resolve(avail)
    written = _written(cfg)
    if budget.nbytes is not None:
        return nbytes, f"host_memory_budget={written!r}"
    return nbytes, (
        f"host_memory_budget={written!r} of the available {format_nbytes(avail)}"
        + (" per rank" if ranks_per_node > 1 else "")
    )


def _written(cfg: InfinityConfig) -> object:
    """host_memory_budget as the user wrote it (JSON numbers arrive as floats: 3e9 shows as 3000000000)."""
    value = cfg.host_memory_budget
    return int(value) if isinstance(value, float) and value.is_integer() else value


def check_budget(plan: RuntimePlan, cfg: InfinityConfig) -> None:
    """Refuses a plan that needs more than the host_memory_budget the config sets (ConfigError naming the
    key and what it would take): even with every "auto" section on NVMe, the rest does not fit it.
    (Under the default budget, the pre-flight check judges against the available memory itself.)"""
    c = plan.chosen
    if c is None or cfg.host_budget is None or c.need_nbytes <= c.budget_nbytes:
        return
    raise ConfigError(
        f"host_memory_budget={_written(cfg)!r} gives {format_nbytes(c.budget_nbytes)} per rank, but this "
        f'run needs {format_nbytes(c.need_nbytes)} of host memory with every "auto" section\'s state on NVMe '
        "(pools, activations, runtime overheads; `infinity estimate --config` itemises them): raise "
        f"host_memory_budget to at least {format_nbytes(c.need_nbytes)}, or lower what the rest needs"
    )
