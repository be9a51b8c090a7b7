"""How much host memory this process holds, as the OS counts it.

Peak RSS (VmHWM) leaves out hugetlb pages: where vm.nr_hugepages is reserved,
the buffer pools live there (aligned_empty prefers MAP_HUGETLB) and would be
missing from a VmHWM figure. ``peak_host_nbytes`` adds them (the pools are
allocated once and held, so their current size is their peak).
"""

from __future__ import annotations


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB":
                out[key] = int(parts[0]) * 1024
    return out


def peak_host_nbytes() -> int:
    """Peak resident memory (VmHWM) plus hugetlb pages held now."""
    st = _status()
    return st.get("VmHWM", 0) + st.get("HugetlbPages", 0)


def resident_host_nbytes() -> int:
    """Resident memory now (VmRSS) plus hugetlb pages held now."""
    st = _status()
    return st.get("VmRSS", 0) + st.get("HugetlbPages", 0)
