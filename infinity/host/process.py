"""A process as the kernel counts it: /proc/<pid>/status memory figures, block I/O, start time, peak reset.

The one reader of this process's resident memory, under two names per figure:
``rss_nbytes`` and ``peak_rss_nbytes`` are the kernel's VmRSS and VmHWM, which
leave out hugetlb pages (``HugetlbPages``); ``resident_host_nbytes`` and
``peak_resident_host_nbytes`` add them: where vm.nr_hugepages is reserved the
buffer pools live there (aligned_empty prefers MAP_HUGETLB), and a budget
that left them out would miss the largest allocations. The pools are
allocated once and held, so the hugetlb pages held now are also their peak.

Threading: stateless; safe from any thread. ``reset_peak_rss`` resets the
figure for the whole process, so concurrent measurements see each other's reset.
"""

from __future__ import annotations

import os

from infinity.host._read import parse_counters, read_text


def parse_status(text: str) -> dict[str, int]:
    """``/proc/<pid>/status`` text -> {field: bytes} for the fields given in kB (VmHWM, VmRSS, HugetlbPages, ...)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            out[key] = int(parts[0]) * 1024
    return out


def process_status(pid: int | None = None) -> dict[str, int]:
    """The memory fields of ``/proc/<pid>/status`` (this process by default) in bytes; empty where unreadable."""
    text = read_text(f"/proc/{'self' if pid is None else pid}/status")
    return parse_status(text) if text is not None else {}


def peak_rss_nbytes() -> int:
    """This process's peak resident set (VmHWM) in bytes, hugetlb pages not included; 0 where unknown."""
    return process_status().get("VmHWM", 0)


def rss_nbytes() -> int:
    """This process's resident set now (VmRSS) in bytes, hugetlb pages not included; 0 where unknown."""
    return process_status().get("VmRSS", 0)


def resident_host_nbytes() -> int:
    """Host memory this process holds now: VmRSS plus its hugetlb pages; 0 where unknown."""
    st = process_status()
    return st.get("VmRSS", 0) + st.get("HugetlbPages", 0)


def peak_resident_host_nbytes() -> int:
    """The most host memory this process has held: VmHWM plus the hugetlb pages held now."""
    st = process_status()
    return st.get("VmHWM", 0) + st.get("HugetlbPages", 0)


def hugetlb_nbytes() -> int:
    """Bytes of hugetlb pages this process holds now (HugetlbPages); 0 where unknown."""
    return process_status().get("HugetlbPages", 0)


def parse_io(text: str) -> dict[str, int]:
    """``/proc/<pid>/io`` text -> {field: count} (rchar, read_bytes, write_bytes, ...)."""
    return parse_counters(text, ":")


def block_io_nbytes() -> tuple[int, int]:
    """(read, written) bytes this process, every thread of it, had the block layer transfer so far:
    O_DIRECT transfers and page-cache misses count, page-cache hits never do; (0, 0) where unknown."""
    text = read_text("/proc/self/io")
    io = parse_io(text) if text is not None else {}
    return io.get("read_bytes", 0), io.get("write_bytes", 0)


def reset_peak_rss() -> bool:
    """Resets VmHWM to the current RSS (writes 5 to /proc/self/clear_refs); False where refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def parse_start_time(stat: str) -> int:
    """The start time (clock ticks since boot) from ``/proc/<pid>/stat`` text."""
    # The command name (field 2) may contain spaces and parentheses; fields
    # after its last closing parenthesis are plain. starttime is field 22.
    fields = stat[stat.rfind(")") + 2 :].split()
    return int(fields[19])


def process_start_time(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks since boot, None if it is not running, -1 if unreadable.

    With the pid, it names a process uniquely: a pid reused later has another start time.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return -1  # exists but unreadable: treat as alive with unknown start
    return parse_start_time(stat)


def open_fds() -> list[int]:
    """The file descriptors this process has open now (from /proc/self/fd), sorted.

    The listing itself holds one descriptor while it runs; it is in the list.
    """
    return sorted(int(name) for name in os.listdir("/proc/self/fd"))
