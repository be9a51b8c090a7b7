"""This process's memory mappings: /proc/self/maps (what is mapped) and /proc/self/smaps (how).

A mapping is an address range [start, end) with the file behind it (``path``,
'' for anonymous memory) and, from smaps, its per-mapping figures in bytes
(``KernelPageSize``, ``AnonHugePages``, ``Rss``, ...).

Threading: stateless; safe from any thread. The kernel builds these files on
each read: a mapping made or removed meanwhile may or may not be listed.
"""

from __future__ import annotations

import dataclasses

from infinity.host._read import read_text


@dataclasses.dataclass(frozen=True)
class MemoryMap:
    """One mapping of this process's address space."""

    start: int
    """First address of the mapping."""
    end: int
    """One past its last address."""
    path: str
    """The mapped file, a pseudo-name such as '[heap]', or '' for anonymous memory."""
    fields: dict[str, int] = dataclasses.field(default_factory=dict, compare=False)
    """smaps figures in bytes (empty when read from /proc/self/maps)."""


def _header(line: str) -> MemoryMap | None:
    # "7f..-7f.. rw-p 00000000 00:00 0    /path with spaces" -> at most 6 fields.
    parts = line.split(maxsplit=5)
    if len(parts) < 5 or "-" not in parts[0] or ":" in parts[0]:
        return None
    lo, _, hi = parts[0].partition("-")
    try:
        start, end = int(lo, 16), int(hi, 16)
    except ValueError:
        return None
    return MemoryMap(start, end, parts[5].strip() if len(parts) > 5 else "")


def parse_maps(text: str) -> list[MemoryMap]:
    """``/proc/<pid>/maps`` or ``smaps`` text -> its mappings, in address order; smaps figures in bytes."""
    out: list[MemoryMap] = []
    for line in text.splitlines():
        head = _header(line)
        if head is not None:
            out.append(head)
            continue
        key, _, rest = line.partition(":")
        parts = rest.split()
        if out and parts and parts[0].isdigit():
            n = int(parts[0])
            out[-1].fields[key] = n * 1024 if parts[1:] == ["kB"] else n
    return out


def memory_maps(*, detail: bool = False) -> list[MemoryMap]:
    """This process's mappings; ``detail=True`` reads smaps (slower) for the per-mapping figures.

    Empty where the file cannot be read.
    """
    text = read_text("/proc/self/smaps" if detail else "/proc/self/maps")
    return parse_maps(text) if text is not None else []


def mapped_paths() -> set[str]:
    """The files mapped into this process now (shared libraries, mapped files)."""
    return {m.path for m in memory_maps() if m.path.startswith("/")}
