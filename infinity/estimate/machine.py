"""MachineView: the memory and disk a run can use here — free RAM, free huge pages, GPUs, free space.

Read from the OS at call time (infinity.host: /proc/meminfo, /proc/self/status, this
process's memory cgroup, whose limit caps what is available inside a container; statvfs,
torch.cuda.mem_get_info); nothing is allocated. ``machine_view()`` is what
the estimator checks settings against and what ``infinity doctor`` prints
(``describe_machine``). Also here: the process baseline — the resident memory
of a process that has imported torch and infinity, measured, not assumed; and how many ranks
share this machine (``ranks_on_this_node``), which divides its memory among them.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch

from infinity.host import (
    CgroupMemory,
    hugetlb_free_nbytes,
    meminfo,
    memory_cgroup,
    mount_of,
    resident_host_nbytes,
)
from infinity.memory import format_nbytes
from infinity.store import nvme_path


@dataclasses.dataclass(frozen=True)
class GPUInfo:
    index: int
    name: str
    total_nbytes: int
    free_nbytes: int


@dataclasses.dataclass(frozen=True)
class DiskInfo:
    path: str
    """The path asked about (nvme_path)."""
    existing: str
    """The nearest existing directory at or above it, where free space was read."""
    free_nbytes: int
    total_nbytes: int
    fs_type: str
    device: int
    """st_dev: two paths on one file system share their free space."""


@dataclasses.dataclass(frozen=True)
class MachineView:
    mem_total_nbytes: int
    mem_available_nbytes: int
    """What can be allocated without swapping or an OOM kill: /proc/meminfo MemAvailable, capped by the
    room left under this process's memory cgroup limit where one is set."""
    hugetlb_free_nbytes: int
    """Free pages of the hugetlb pool (not in MemAvailable); pinned pools take them first."""
    cpu_count: int
    gpus: tuple[GPUInfo, ...]
    disks: tuple[DiskInfo, ...]
    self_rss_nbytes: int
    """This process's resident memory now (VmRSS + hugetlb pages)."""
    cgroup: CgroupMemory | None = None
    """The memory cgroup whose limit binds this process (a container's, a service's); None if unlimited."""

    @property
    def has_cuda(self) -> bool:
        return bool(self.gpus)

    def disk(self, path: str | os.PathLike) -> DiskInfo | None:
        p = os.fspath(path)
        return next((d for d in self.disks if d.path == p), None)


def ranks_on_this_node() -> int:
    """How many ranks share this machine's memory and drives: torchrun's ``LOCAL_WORLD_SIZE``
    (1 when unset: one process, or a launcher that does not say). The one place it is read: the
    planner's budget, the pre-flight checks and ``infinity doctor`` all divide the machine by it."""
    raw = os.environ.get("LOCAL_WORLD_SIZE", "1")
    try:
        ranks = int(raw)
    except ValueError:
        ranks = 0
    if ranks < 1:
        raise ValueError(
            f"LOCAL_WORLD_SIZE={raw!r} is not a number of ranks on this machine (an integer >= 1); "
            "launch with torchrun, which sets it, or set it to the number of ranks per machine"
        )
    return ranks


def runtime_baseline_nbytes() -> int:
    """The resident memory of this process with what every training run loads before its first allocation.

    That is torch and infinity imported (the package imports its engine), plus what the engine
    imports on first use:
    the first torch.optim.Optimizer pulls in torch._dynamo (~70 MiB here), and with
    CUDA the context (several hundred MiB of host memory), which is created here.
    Call it before building the model to get the baseline of a run.
    """
    try:
        torch.optim.Optimizer([torch.empty(0)], {})
    except ImportError:
        # A process that can no longer read torch's files (privileges dropped after import):
        # it cannot load more of torch now, and nothing of it counts yet.
        pass
    if torch.cuda.is_available():
        torch.cuda.init()
    return resident_host_nbytes()


def _nearest_existing(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def disk_info(path: str | os.PathLike) -> DiskInfo:
    """Free space and file system at nvme_path (``~`` expanded as the runtime does), or at its
    nearest existing parent when it does not exist yet."""
    existing = _nearest_existing(nvme_path.expand(path))
    usage = shutil.disk_usage(existing)
    mount = mount_of(existing)
    return DiskInfo(
        path=os.fspath(path),
        existing=str(existing),
        free_nbytes=usage.free,
        total_nbytes=usage.total,
        fs_type=mount.fs_type if mount else "?",
        device=os.stat(existing).st_dev,
    )


def machine_view(nvme_paths: Iterable[str | os.PathLike] = ()) -> MachineView:
    """The machine now: memory, huge pages, GPUs (when CUDA works) and free space at each path."""
    info = meminfo()
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            gpus.append(GPUInfo(i, torch.cuda.get_device_name(i), total, free))
    disks = tuple(disk_info(p) for p in dict.fromkeys(os.fspath(p) for p in nvme_paths))
    available = info.get("MemAvailable", info.get("MemFree", 0))
    cgroup = memory_cgroup()
    if cgroup is not None:
        available = min(available, cgroup.available_nbytes)
    return MachineView(
        mem_total_nbytes=info.get("MemTotal", 0),
        mem_available_nbytes=available,
        hugetlb_free_nbytes=hugetlb_free_nbytes(),
        cpu_count=os.cpu_count() or 1,
        gpus=tuple(gpus),
        disks=disks,
        self_rss_nbytes=resident_host_nbytes(),
        cgroup=cgroup,
    )


def describe_machine(
    view: MachineView | None = None, nvme_paths: Iterable[str | os.PathLike] = ()
) -> list[str]:
    """A few lines for ``infinity doctor``: what a run may use here."""
    v = view or machine_view(nvme_paths)
    lines = [
        f"host memory  {format_nbytes(v.mem_available_nbytes)} available of {format_nbytes(v.mem_total_nbytes)}"
        + (
            f"; {format_nbytes(v.hugetlb_free_nbytes)} free in huge pages (used by pinned pools)"
            if v.hugetlb_free_nbytes
            else ""
        ),
        f"cpus         {v.cpu_count}",
    ]
    if v.cgroup is not None:
        lines.insert(
            1,
            f"memory limit {format_nbytes(v.cgroup.limit_nbytes)} on this process's cgroup "
            f"({v.cgroup.version}, {v.cgroup.path}), {format_nbytes(v.cgroup.available_nbytes)} of it "
            "free: the available memory above is capped to that",
        )
    if v.gpus:
        for g in v.gpus:
            lines.append(
                f"gpu {g.index}        {g.name}: {format_nbytes(g.free_nbytes)} free of {format_nbytes(g.total_nbytes)}"
            )
    else:
        lines.append(
            "gpu          none (CUDA not available): the compute device is the CPU, sharing host memory"
        )
    first_on: dict[int, str] = {}
    for d in v.disks:
        where = (
            d.path
            if d.existing == os.path.abspath(d.path)
            else f"{d.path} (not created yet; {d.existing})"
        )
        tmpfs = " — tmpfs is RAM, not NVMe" if d.fs_type == "tmpfs" else ""
        shared = (
            f" — the file system of {first_on[d.device]}: free space and bandwidth shared"
            if d.device in first_on
            else ""
        )
        first_on.setdefault(d.device, d.path)
        lines.append(
            f"nvme_path    {where}: {format_nbytes(d.free_nbytes)} free of {format_nbytes(d.total_nbytes)}, "
            f"{d.fs_type}{tmpfs}{shared}"
        )
    return lines
