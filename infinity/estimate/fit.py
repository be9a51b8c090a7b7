"""check_fit: does a Breakdown (per rank) fit a machine, per resource — and if not, what is short and by how much."""

from __future__ import annotations

import dataclasses

from infinity.estimate.breakdown import Breakdown
from infinity.estimate.machine import MachineView
from infinity.memory import format_nbytes


@dataclasses.dataclass(frozen=True)
class Fit:
    """Whether a setting fits this machine, per resource, and why not."""

    ok: bool
    host_ok: bool
    device_ok: bool
    nvme_ok: bool
    reasons: tuple[str, ...]
    """One line per shortfall (or config problem), naming what is short and by how much."""


def check_fit(
    breakdown: Breakdown,
    machine: MachineView,
    *,
    ranks_per_node: int,
    held_nbytes: int = 0,
    engine_checks: bool = False,
) -> Fit:
    """Does ``breakdown`` (per rank) × ``ranks_per_node`` fit ``machine``?

    ``held_nbytes``: host memory the run already holds (pre-flight runs inside the
    training process: its baseline and model are allocated, not to be found again).
    Pinned pools of 2 MiB or more may come from free hugetlb pages, which
    MemAvailable does not count. ``engine_checks``: leave out what initialize refuses
    by itself before allocating (Problem.engine_refuses; with one rank per node and no
    zero.Init files, the swap space — the engine's nvme_path.check_space sees exactly that).
    """
    reasons = []
    cpu = breakdown.device_type == "cpu"
    need, avail = _host_need(breakdown, machine, ranks_per_node, held_nbytes)
    host_ok = need <= avail
    if not host_ok:
        what = "host memory (device is the CPU: device + host)" if cpu else "host memory"
        reasons.append(
            f"{what}: needs {format_nbytes(need)}{' more' if held_nbytes else ''}"
            f"{f' for {ranks_per_node} ranks' if ranks_per_node > 1 else ''}, "
            f"{format_nbytes(avail)} available"
        )
    device_ok = True
    if not cpu:
        if not machine.gpus:
            device_ok = False
            reasons.append("device memory: the estimate is for CUDA, but no GPU is visible")
        else:
            free = min(g.free_nbytes for g in machine.gpus[:ranks_per_node])
            if len(machine.gpus) < ranks_per_node:
                device_ok = False
                reasons.append(
                    f"device: {ranks_per_node} ranks per node, {len(machine.gpus)} GPU(s) visible"
                )
            if breakdown.device_nbytes > free:
                device_ok = False
                reasons.append(
                    f"device memory: needs {format_nbytes(breakdown.device_nbytes)} per GPU, {format_nbytes(free)} free"
                )
    nvme_ok = True
    by_fs: dict[int, tuple[int, int, list[str]]] = {}
    engine_sees_it = ranks_per_node == 1 and not any(
        i.name.startswith("zero.Init") for i in breakdown.items
    )
    for path, n in [] if engine_checks and engine_sees_it else breakdown.nvme_by_path:
        d = machine.disk(path)
        if d is None:
            continue
        need_fs, free, paths = by_fs.get(d.device, (0, d.free_nbytes, []))
        by_fs[d.device] = (need_fs + n * ranks_per_node, free, paths + [path])
    for need_fs, free, paths in by_fs.values():
        if need_fs > free:
            nvme_ok = False
            reasons.append(
                f"NVMe space at {', '.join(paths)}: needs {format_nbytes(need_fs)}, {format_nbytes(free)} free"
            )
    problems = [pr for pr in breakdown.problems if not (engine_checks and pr.engine_refuses)]
    for pr in problems:
        reasons.append(f"config: {pr.message}; {pr.fix}")
    ok = host_ok and device_ok and nvme_ok and not problems
    return Fit(ok, host_ok, device_ok, nvme_ok, tuple(reasons))


def _host_need(
    breakdown: Breakdown, machine: MachineView, ranks_per_node: int, held_nbytes: int
) -> tuple[int, int]:
    """(host memory the node's ranks still need, host memory available to them)."""
    per_rank_host = (
        breakdown.ram_nbytes if breakdown.device_type == "cpu" else breakdown.host_nbytes
    )
    huge = min(machine.hugetlb_free_nbytes, breakdown.pinned_pool_nbytes * ranks_per_node)
    return per_rank_host * ranks_per_node - held_nbytes, machine.mem_available_nbytes + huge


def host_shortfall_nbytes(
    breakdown: Breakdown, machine: MachineView, *, ranks_per_node: int, held_nbytes: int = 0
) -> int:
    """How much more host memory ``breakdown`` needs than ``machine`` has (0 when it fits; see check_fit)."""
    need, avail = _host_need(breakdown, machine, ranks_per_node, held_nbytes)
    return max(0, need - avail)
