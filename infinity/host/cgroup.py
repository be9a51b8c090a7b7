"""This process's memory cgroup: the limit a container or a service manager puts on it, and what is used.

/proc/meminfo describes the machine. Inside a container (Docker's ``--memory``,
a Kubernetes pod's limit, systemd's ``MemoryMax``) the kernel reclaims and then
OOM-kills at the cgroup's limit long before MemAvailable runs out, so a budget
check that reads MemAvailable alone promises memory the run cannot have.
``memory_cgroup`` finds the binding limit: every ancestor's limit applies too,
so it walks from this process's cgroup up to the hierarchy's root and keeps the
level with the least room.

Room is what a new allocation can get before the limit bites: the limit less
the usage, plus the inactive file cache the kernel reclaims first (what
``docker stats`` and the kubelet subtract as the working set). Both cgroup v2
(``memory.max``, ``memory.current``) and v1 (``memory.limit_in_bytes``,
``memory.usage_in_bytes``) are read; v1 reports "no limit" as a page-rounded
2^63 - 1.

Threading: stateless; safe from any thread.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Literal

from infinity.host._read import parse_counters, read_text
from infinity.host.filesystems import Mount, mounts

PROC_SELF_CGROUP = "/proc/self/cgroup"
UNLIMITED_V1 = 1 << 62
"""v1 limits at or above this are "no limit" (the kernel shows PAGE_COUNTER_MAX x page size, ~2^63)."""

Version = Literal["v1", "v2"]


@dataclasses.dataclass(frozen=True)
class CgroupMemory:
    """One memory cgroup's limit and use, in bytes."""

    path: str
    """The cgroup's directory under the cgroup file system."""
    version: Version
    limit_nbytes: int
    usage_nbytes: int
    """Charged now: anonymous memory, page cache and kernel memory of every process in it."""
    inactive_file_nbytes: int
    """Page cache the kernel reclaims first (memory.stat inactive_file, hierarchical on v1)."""

    @property
    def available_nbytes(self) -> int:
        """What a new allocation can get before the kernel must reclaim active memory or OOM-kill."""
        return max(0, self.limit_nbytes - self.usage_nbytes + self.inactive_file_nbytes)


def parse_proc_cgroup(text: str) -> dict[Version, str]:
    """``/proc/<pid>/cgroup`` text -> the memory cgroup's path per hierarchy: ``"v2"`` from the unified
    line (``0::/path``), ``"v1"`` from the line whose controllers include ``memory``."""
    out: dict[Version, str] = {}
    for line in text.splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "":
            out["v2"] = path
        elif "memory" in controllers.split(","):
            out["v1"] = path
    return out


def parse_memory_stat(text: str) -> dict[str, int]:
    """A cgroup's ``memory.stat`` text -> {field: count} (v1 and v2 alike: ``name value`` lines)."""
    return parse_counters(text, " ")


def inactive_file_nbytes(stat: dict[str, int], version: Version) -> int:
    """Page cache the kernel reclaims first, from parsed ``memory.stat`` (v1: the hierarchical total)."""
    if version == "v1":
        return stat.get("total_inactive_file", stat.get("inactive_file", 0))
    return stat.get("inactive_file", 0)


def _limit(directory: Path, version: Version) -> int | None:
    """The level's limit in bytes, or None where it sets none (or the file is not there)."""
    text = read_text(directory / ("memory.max" if version == "v2" else "memory.limit_in_bytes"))
    if text is None:
        return None
    text = text.strip()
    if not text.isdigit():  # v2's "max"
        return None
    n = int(text)
    return None if version == "v1" and n >= UNLIMITED_V1 else n


def _level(directory: Path, version: Version) -> CgroupMemory | None:
    limit = _limit(directory, version)
    if limit is None:
        return None
    usage = read_text(
        directory / ("memory.current" if version == "v2" else "memory.usage_in_bytes")
    )
    stat = read_text(directory / "memory.stat")
    return CgroupMemory(
        path=str(directory),
        version=version,
        limit_nbytes=limit,
        usage_nbytes=int(usage) if usage is not None and usage.strip().isdigit() else 0,
        inactive_file_nbytes=inactive_file_nbytes(parse_memory_stat(stat), version)
        if stat is not None
        else 0,
    )


def _hierarchy_root(version: Version, table: list[Mount]) -> Path | None:
    for m in table:
        if version == "v2" and m.fs_type == "cgroup2":
            return Path(m.mountpoint)
        if version == "v1" and m.fs_type == "cgroup" and "memory" in m.options:
            return Path(m.mountpoint)
    return None


def _own_directory(root: Path, path: str) -> Path:
    """The process's cgroup directory under ``root``. Without a cgroup namespace a container sees its host's
    path (``/docker/<id>``) over a mount of its own cgroup: drop leading parts until the directory exists."""
    parts = [p for p in path.split("/") if p]
    for i in range(len(parts) + 1):
        candidate = root.joinpath(*parts[i:])
        if candidate.is_dir():
            return candidate
    return root


def memory_cgroups(pid: int | str = "self") -> list[CgroupMemory]:
    """Every level with a memory limit from this process's cgroup up to its hierarchy's root, innermost first
    (both hierarchies on a hybrid v1/v2 system); empty where none is limited or nothing can be read."""
    text = read_text(PROC_SELF_CGROUP if pid == "self" else f"/proc/{pid}/cgroup")
    if text is None:
        return []
    table = mounts()
    levels = []
    for version, path in parse_proc_cgroup(text).items():
        root = _hierarchy_root(version, table)
        if root is None:
            continue
        directory = _own_directory(root, path)
        while True:
            level = _level(directory, version)
            if level is not None:
                levels.append(level)
            if directory == root or os.path.commonpath([directory, root]) != str(root):
                break
            directory = directory.parent
    return levels


def memory_cgroup(pid: int | str = "self") -> CgroupMemory | None:
    """The binding memory cgroup of this process: the limited level with the least room; None where no
    level sets a limit (a process on a bare host) or the files cannot be read."""
    levels = memory_cgroups(pid)
    return min(levels, key=lambda c: c.available_nbytes) if levels else None
