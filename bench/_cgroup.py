"""Memory cgroups, the page cache and the hugetlb pool for the benches: helpers, not a bench (tests/test_benchmarks.py skips
files whose names start with "_").

A bench runs each contender in a fresh subprocess; where it must not serve repeated reads from the page
cache, the parent makes a memory cgroup for it (``make``), the child joins it (``join``, or ``serve_child``
for the whole child: join, run, print the JSON result) and the cgroup's
limit (``limit`` or ``enforce``) keeps the weights' pages from staying cached. cgroup v2 (``memory.max``)
and v1 (``memory.limit_in_bytes``) alike. Every step degrades to a no-op where the process may not do it
(not root, no memory controller): callers record a note and go on, so ``--quick`` runs anywhere.
``huge_pages`` reserves 2 MiB pages for a reference run (fio's buffers) and gives them back after it, so
that the contenders never get them.

Threading: none; each function but serve_child is one file write.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from infinity import host
from infinity.host import parse_memory_stat


def root() -> tuple[Path, str] | None:
    """Where this process may make a memory cgroup, and its version ("v2" or "v1"); None if nowhere."""
    v2 = Path("/sys/fs/cgroup")
    controllers = v2 / "cgroup.controllers"
    if controllers.exists() and "memory" in controllers.read_text().split():
        return v2, "v2"
    v1 = v2 / "memory"
    if (v1 / "memory.limit_in_bytes").exists():
        return v1, "v1"
    return None


def make(name: str) -> str | None:
    """A new memory cgroup named ``name`` (its path), or None where none can be made."""
    where = root()
    if where is None:
        return None
    path = where[0] / name
    try:
        path.mkdir()
    except OSError:
        return None
    return str(path)


def remove(cgroup: str | None) -> None:
    if cgroup:
        try:
            os.rmdir(cgroup)
        except OSError:
            pass


def join(cgroup: str | None) -> None:
    """Moves this process into ``cgroup`` (None: stays where it is)."""
    if cgroup:
        (Path(cgroup) / "cgroup.procs").write_text(str(os.getpid()))


def usage(cgroup: str | Path) -> int:
    path = Path(cgroup)
    f = path / ("memory.current" if (path / "memory.current").exists() else "memory.usage_in_bytes")
    return int(f.read_text())


def limit(cgroup: str | None, limit_nbytes: int) -> int | None:
    """Sets the cgroup's memory limit (page cache included); returns it, or None where there is no cgroup."""
    if not cgroup:
        return None
    path = Path(cgroup)
    f = path / ("memory.max" if (path / "memory.max").exists() else "memory.limit_in_bytes")
    f.write_text(str(limit_nbytes))
    return limit_nbytes


def enforce(cgroup: str | None, budget_nbytes: int) -> int | None:
    """Limits the cgroup to what it holds now plus ``budget_nbytes``; returns the limit."""
    if not cgroup:
        return None
    return limit(cgroup, usage(cgroup) + budget_nbytes)


def peak(cgroup: str | None) -> int | None:
    """The cgroup's peak charge (memory.peak on v2, memory.max_usage_in_bytes on v1), page cache included."""
    if not cgroup:
        return None
    path = Path(cgroup)
    for name in ("memory.peak", "memory.max_usage_in_bytes"):
        if (path / name).exists():
            return int((path / name).read_text())
    return None


def major_faults(cgroup: str | None) -> int | None:
    """Major page faults of the cgroup's processes so far (memory.stat pgmajfault, v1 and v2)."""
    if not cgroup:
        return None
    try:
        stat = parse_memory_stat((Path(cgroup) / "memory.stat").read_text())
    except OSError:
        return None
    return stat.get("pgmajfault")


def drop_caches() -> bool:
    """infinity.host.drop_caches; False where not permitted (not root, a container)."""
    try:
        host.drop_caches()
    except OSError:
        return False
    return True


NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")
HUGE_PAGE = 2 << 20


@contextlib.contextmanager
def huge_pages(nbytes: int) -> Iterator[bool]:
    """Grows the hugetlb pool by ``nbytes`` in 2 MiB pages for the block and restores its size after; yields
    whether the pages are there (False where not root, or the kernel found too little contiguous memory)."""
    try:
        before = int(NR_HUGEPAGES.read_text())
        want = before + -(-nbytes // HUGE_PAGE)
        NR_HUGEPAGES.write_text(f"{want}\n")
    except (OSError, ValueError):
        yield False
        return
    try:
        yield int(NR_HUGEPAGES.read_text()) >= want
    finally:
        NR_HUGEPAGES.write_text(f"{before}\n")


def serve_child(spec: str, run: Callable[[dict], dict]) -> int:
    """A bench's child process: joins the cgroup its JSON ``spec`` names (if any), runs ``run`` on the
    spec and prints the result as the last line of stdout, which the parent reads."""
    a = json.loads(spec)
    join(a.get("cgroup"))
    print(json.dumps(run(a)))
    return 0
