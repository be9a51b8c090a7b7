"""Kernel settings under /proc/sys read by name, and the one the tools write (vm.drop_caches).

Threading: stateless; safe from any thread.
"""

from __future__ import annotations

import os

from infinity.host._read import read_text


def sysctl_path(name: str) -> str:
    """'kernel.io_uring_disabled' -> '/proc/sys/kernel/io_uring_disabled'."""
    return "/proc/sys/" + name.replace(".", "/")


def sysctl(name: str) -> str | None:
    """A kernel setting's value as text, stripped ('vm.nr_hugepages' -> '0'); None where unreadable."""
    text = read_text(sysctl_path(name))
    return None if text is None else text.strip()


def sysctl_int(name: str) -> int | None:
    """A numeric kernel setting; None where unreadable or not a number."""
    text = sysctl(name)
    try:
        return None if text is None else int(text)
    except ValueError:
        return None


def io_uring_disabled() -> int | None:
    """kernel.io_uring_disabled: 0 allowed, 1 privileged only, 2 refused; None on kernels without it."""
    return sysctl_int("kernel.io_uring_disabled")


def can_drop_caches() -> bool:
    """Whether this process may drop the page cache (vm.drop_caches is writable: root)."""
    return os.access(sysctl_path("vm.drop_caches"), os.W_OK)


def drop_caches() -> None:
    """Writes dirty pages back, then drops the page cache, dentries and inodes (raises OSError if refused)."""
    os.sync()
    with open(sysctl_path("vm.drop_caches"), "w") as f:
        f.write("3\n")
