"""What the host offers, read from the kernel: memory, its cgroup limit, this process's footprint, CPU, mounts, sysctls.

The one place that reads /proc and /sys. Every probe returns a typed value
and says "unknown" (0, '', None, empty) where the file cannot be read instead
of raising: callers print reports and check budgets, and a container that
hides a file must not stop a run. Each ``parse_*`` takes the file's text, so
the parsing is tested against fixed samples as well as the live system.

The lowest layer (beside infinity.timeline). Imports only the standard library.
"""

from infinity.host.cgroup import (
    CgroupMemory,
    memory_cgroup,
    memory_cgroups,
    parse_memory_stat,
    parse_proc_cgroup,
)
from infinity.host.cpu import CpuInfo, cpu_flags, cpu_info, cpu_model, parse_cpuinfo
from infinity.host.filesystems import Mount, find_mount, mount_of, mounts, parse_mounts, unescape
from infinity.host.kernel import can_drop_caches, drop_caches, io_uring_disabled, sysctl, sysctl_int
from infinity.host.maps import MemoryMap, mapped_paths, memory_maps, parse_maps
from infinity.host.memory import (
    hugetlb_free_nbytes,
    meminfo,
    memory_total_nbytes,
    parse_meminfo,
    parse_transparent_hugepage,
    transparent_hugepage_mode,
)
from infinity.host.process import (
    block_io_nbytes,
    hugetlb_nbytes,
    open_fds,
    parse_io,
    parse_start_time,
    parse_status,
    peak_resident_host_nbytes,
    peak_rss_nbytes,
    process_start_time,
    process_status,
    reset_peak_rss,
    resident_host_nbytes,
    rss_nbytes,
)

__all__ = [
    "CgroupMemory",
    "CpuInfo",
    "MemoryMap",
    "Mount",
    "can_drop_caches",
    "cpu_flags",
    "cpu_info",
    "cpu_model",
    "drop_caches",
    "find_mount",
    "hugetlb_free_nbytes",
    "block_io_nbytes",
    "hugetlb_nbytes",
    "io_uring_disabled",
    "mapped_paths",
    "memory_cgroup",
    "memory_cgroups",
    "meminfo",
    "memory_maps",
    "memory_total_nbytes",
    "mount_of",
    "mounts",
    "open_fds",
    "parse_cpuinfo",
    "parse_io",
    "parse_maps",
    "parse_memory_stat",
    "parse_meminfo",
    "parse_mounts",
    "parse_proc_cgroup",
    "parse_start_time",
    "parse_status",
    "parse_transparent_hugepage",
    "peak_resident_host_nbytes",
    "peak_rss_nbytes",
    "process_start_time",
    "process_status",
    "reset_peak_rss",
    "resident_host_nbytes",
    "rss_nbytes",
    "sysctl",
    "sysctl_int",
    "transparent_hugepage_mode",
    "unescape",
]
