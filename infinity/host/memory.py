"""The machine's memory as the kernel reports it: /proc/meminfo and the huge-page settings.

Figures the kernel gives in kB are returned in bytes; counts (``HugePages_*``)
stay counts. Read at call time, never cached: free memory changes.

Threading: stateless; safe from any thread.
"""

from __future__ import annotations

from infinity.host._read import read_text

MEMINFO = "/proc/meminfo"
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def parse_meminfo(text: str) -> dict[str, int]:
    """``/proc/meminfo`` text -> {field: value}: kB figures in bytes, unitless ones (page counts) as they are."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if not parts or not parts[0].isdigit():
            continue
        n = int(parts[0])
        out[key.strip()] = n * 1024 if parts[1:] == ["kB"] else n
    return out


def meminfo() -> dict[str, int]:
    """This machine's /proc/meminfo (see ``parse_meminfo``); empty where it cannot be read."""
    text = read_text(MEMINFO)
    return parse_meminfo(text) if text is not None else {}


def memory_total_nbytes() -> int:
    """Physical memory the kernel manages (MemTotal) in bytes; 0 where unknown."""
    return meminfo().get("MemTotal", 0)


def hugetlb_free_nbytes() -> int:
    """Bytes free in the hugetlb pool (HugePages_Free x Hugepagesize); 0 where unknown."""
    info = meminfo()
    return info.get("HugePages_Free", 0) * info.get("Hugepagesize", 0)


def parse_transparent_hugepage(text: str) -> str:
    """The selected mode of a sysfs choice file ('always [madvise] never' -> 'madvise'); '' if none is marked."""
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else ""


def transparent_hugepage_mode() -> str:
    """Transparent huge pages: 'always', 'madvise' or 'never'; '' where the kernel does not say."""
    text = read_text(THP_ENABLED)
    return parse_transparent_hugepage(text) if text is not None else ""
