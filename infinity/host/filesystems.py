"""Mounted file systems (/proc/mounts), and which one holds a path.

/proc/mounts escapes a space, tab, newline and backslash in the device and
mount point as octal (``\\040``, ``\\011``, ``\\012``, ``\\134``);
``parse_mounts`` undoes it. The mount holding a path is the one with the
longest mount point that is the path or one of its parents, after symbolic
links are resolved; the last such entry wins (a later mount on the same point
hides an earlier one).

Threading: stateless; safe from any thread.
"""

from __future__ import annotations

import dataclasses
import os
import re

from infinity.host._read import read_text

MOUNTS = "/proc/mounts"

_OCTAL = re.compile(r"\\([0-7]{3})")


@dataclasses.dataclass(frozen=True)
class Mount:
    """One /proc/mounts entry."""

    device: str
    """What is mounted: '/dev/nvme0n1p1', 'tmpfs', 'overlay', ..."""
    mountpoint: str
    """Where, unescaped."""
    fs_type: str
    """The file system type: 'ext4', 'xfs', 'tmpfs', ..."""
    options: tuple[str, ...] = ()
    """Mount options: ('rw', 'relatime', ...)."""


def unescape(field: str) -> str:
    """Undoes /proc/mounts' octal escapes ('/mnt/my\\040disk' -> '/mnt/my disk')."""
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mounts(text: str) -> list[Mount]:
    """``/proc/mounts`` text -> its entries, in order."""
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        options = tuple(parts[3].split(",")) if len(parts) > 3 else ()
        out.append(Mount(unescape(parts[0]), unescape(parts[1]), parts[2], options))
    return out


def mounts() -> list[Mount]:
    """This process's mounts; empty where /proc/mounts cannot be read."""
    text = read_text(MOUNTS)
    return parse_mounts(text) if text is not None else []


def find_mount(path: str, table: list[Mount]) -> Mount | None:
    """The entry of ``table`` holding the absolute, resolved ``path``; None if none does."""
    best: Mount | None = None
    for m in table:
        root = m.mountpoint.rstrip("/") + "/"
        if (path == m.mountpoint or path.startswith(root)) and (
            best is None or len(m.mountpoint) >= len(best.mountpoint)
        ):
            best = m
    return best


def mount_of(path: str | os.PathLike[str]) -> Mount | None:
    """The file system holding ``path`` (which need not exist yet); None where unknown."""
    return find_mount(os.path.realpath(path), mounts())
