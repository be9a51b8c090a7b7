"""Reading one kernel-provided text file (procfs, sysfs), where absence is an answer.

Every probe in infinity.host goes through ``read_text``: on a system without
the file (not Linux, a container that hides it, a process that dropped its
privileges) the probe reports "unknown" instead of failing the caller, which
only ever wanted a figure for a report or a budget check.

Threading: stateless; safe from any thread.
"""

from __future__ import annotations

import os


def read_text(path: str | os.PathLike[str]) -> str | None:
    """The file's text, or None where it cannot be read."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def parse_counters(text: str, sep: str) -> dict[str, int]:
    """``name<sep>count`` lines -> {name: count}; lines whose value is not a plain integer are skipped."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(sep)
        if value.strip().isdigit():
            out[key] = int(value)
    return out
