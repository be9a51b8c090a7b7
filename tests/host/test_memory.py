"""infinity.host.memory: /proc/meminfo parsed from a fixed sample and from this machine."""

import os

from infinity import host

SAMPLE = """\
MemTotal:       24684092 kB
MemFree:         1032716 kB
MemAvailable:   19834452 kB
Buffers:          512104 kB
HugePages_Total:      16
HugePages_Free:        9
HugePages_Rsvd:        0
HugePages_Surp:        0
Hugepagesize:       2048 kB
Hugetlb:           32768 kB
DirectMap1G:     8388608 kB
"""


def test_kb_figures_are_bytes_and_counts_stay_counts():
    info = host.parse_meminfo(SAMPLE)
    assert info["MemTotal"] == 24684092 * 1024
    assert info["MemAvailable"] == 19834452 * 1024
    assert info["HugePages_Total"] == 16
    assert info["HugePages_Free"] == 9
    assert info["Hugepagesize"] == 2 << 20
    assert info["DirectMap1G"] == 8 << 30
    assert len(info) == 11


def test_lines_without_a_number_are_skipped():
    assert host.parse_meminfo("Weird:\nMemTotal: 4 kB\nBroken: x kB\n\n") == {"MemTotal": 4096}


def test_transparent_hugepage_choice():
    assert host.parse_transparent_hugepage("always [madvise] never\n") == "madvise"
    assert host.parse_transparent_hugepage("[always] madvise never") == "always"
    assert host.parse_transparent_hugepage("always madvise never") == ""


def test_this_machine():
    info = host.meminfo()
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert (
        host.memory_total_nbytes() == info["MemTotal"] == physical
    )  # both are the kernel's totalram
    assert 0 < info["MemAvailable"] <= info["MemTotal"]
    assert host.hugetlb_free_nbytes() == info["HugePages_Free"] * info["Hugepagesize"]
    assert host.transparent_hugepage_mode() in ("always", "madvise", "never", "")
