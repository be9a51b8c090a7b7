"""How much host memory this process holds, as the OS counts it.

Peak RSS (VmHWM) leaves out hugetlb pages: where vm.nr_hugepages is reserved,
the buffer pools live there (aligned_empty prefers MAP_HUGETLB) and would be
missing from a VmHWM figure. ``peak_host_nbytes`` adds them (the pools are
allocated once and held, so their current size is their peak).
"""

from __future__ import annotations

from infinity.host import process_status


def peak_host_nbytes() -> int:
    """Peak resident memory (VmHWM) plus hugetlb pages held now."""
    st = process_status()
    return st.get("VmHWM", 0) + st.get("HugetlbPages", 0)


def resident_host_nbytes() -> int:
    """Resident memory now (VmRSS) plus hugetlb pages held now."""
    st = process_status()
    return st.get("VmRSS", 0) + st.get("HugetlbPages", 0)
