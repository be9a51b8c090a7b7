"""nvme_path: the one place a swap folder the user named is resolved and checked, and ``rank<N>`` joined.

Every caller goes through here -- the engine (each rank's folder and the
space its swap files need), zero.Init, a store's SwapDir, the estimator's
view of the disk -- so one path gets one answer and one message everywhere:

- ``~`` is expanded (the config keeps what the user wrote);
- the path must exist, be a directory (a regular file there is "a file, not a
  directory") and be writable by this process (one on a read-only mount is
  named as such, with the remount fix);
- ``rank_dir`` makes ``<nvme_path>/rank<N>`` (DESIGN: each rank swaps its own
  shards there) and probes it for O_DIRECT; ``planned_rank_dir(s)`` checks
  the same without making anything, so a run refused (no space) leaves the
  user's folder as it was. The file system is named once per process: its
  type and device (info); tmpfs or ramfs as host memory, not NVMe (warning);
  one that refuses O_DIRECT (ramfs; tmpfs before Linux 6.6) keeps working
  buffered, as the aio engine falls back (DESIGN, csrc/aio), and is named as
  such (warning) -- unless ``aio.o_direct`` is false, which asks for buffered I/O;
- ``check_space`` compares what will be written with the space free, summed
  per file system, and names a file system that reports no size (ramfs,
  where swap files would fill host memory) as such;
- several paths (one per drive: the store stripes its swap space over them,
  [Note: striping] in swapspace.py) are each checked as one path is; the same
  directory twice is refused, and two on one file system are allowed but
  reported once per process and file system, since they add no bandwidth.

Refusals are NvmePathError (a SwapSpaceError and a ValueError) naming the
path, what is wrong and the fix, raised before any swap file is written.
Threading: the once-per-process record of O_DIRECT reports is guarded by a lock.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

from infinity import host
from infinity.host import Mount
from infinity.memory import format_nbytes
from infinity.store.errors import NvmePathError, SwapSpaceError

log = logging.getLogger("infinity.store")

PathArg = str | os.PathLike
PathsArg = PathArg | Sequence[PathArg]
"""One nvme_path, or a list of them (one directory per drive)."""

_UNKNOWN_MOUNT = Mount(device="", mountpoint="", fs_type="?")


def expand(path: PathArg) -> Path:
    """``path`` with ``~`` expanded (nothing else: relative paths stay relative to the working directory)."""
    return Path(os.path.expanduser(os.fspath(path)))


def mount_of(path: PathArg) -> Mount:
    """The mount holding ``path`` (``~`` expanded; it need not exist yet); fs_type "?" where unknown."""
    return host.mount_of(expand(path).absolute()) or _UNKNOWN_MOUNT


def _named(raw: PathArg, p: Path) -> str:
    """'<as written>' and, where ~ was expanded, what it became."""
    written = os.fspath(raw)
    return f"'{written}'" if written == str(p) else f"'{written}' ({p})"


def check_directory(path: PathArg) -> Path:
    """The expanded ``path``; NvmePathError unless it is an existing directory this process can write."""
    p = expand(path)
    name = _named(path, p)
    if not p.exists():
        raise NvmePathError(
            errno.ENOENT,
            f"nvme_path {name} does not exist; create it (mkdir -p {p}) or point nvme_path at a "
            "directory on a local NVMe drive",
            str(p),
        )
    if not p.is_dir():
        what = "a file, not a directory" if p.is_file() else "not a directory"
        raise NvmePathError(
            errno.ENOTDIR,
            f"nvme_path {name} is {what}; point nvme_path at a directory (each rank's swap files go "
            "in rank<N>/ below it)",
            str(p),
        )
    if not os.access(p, os.W_OK | os.X_OK):
        if _read_only(p):
            m = mount_of(p)
            raise NvmePathError(
                errno.EROFS,
                f"nvme_path {name} is on a read-only mount ({m.fs_type} at {m.mountpoint or '?'}); remount "
                f"it read-write (mount -o remount,rw {m.mountpoint or p}) or point nvme_path at a "
                "directory on a writable drive",
                str(p),
            )
        raise NvmePathError(
            errno.EACCES,
            f"nvme_path {name} is not writable by this process (uid {os.geteuid()}); change its "
            "owner or mode, or choose another directory",
            str(p),
        )
    return p


def _read_only(p: Path) -> bool:
    """Whether ``p`` is on a file system mounted read-only (statvfs's ST_RDONLY, or /proc/mounts' "ro")."""
    try:
        if os.statvfs(p).f_flag & os.ST_RDONLY:
            return True
    except OSError:
        pass
    return "ro" in mount_of(p).options


def planned_rank_dir(path: PathArg, rank: int) -> Path:
    """``<nvme_path>/rank<rank>`` inside a checked nvme_path, not created: what rank_dir will make."""
    d = check_directory(path) / f"rank{rank}"
    if d.exists() and not d.is_dir():
        raise NvmePathError(
            errno.ENOTDIR,
            f"'{d}', rank {rank}'s folder under nvme_path, is a file, not a directory; remove it or "
            "point nvme_path elsewhere",
            str(d),
        )
    return d


def rank_dir(path: PathArg, rank: int, *, o_direct: bool = True) -> Path:
    """``<nvme_path>/rank<rank>``, created inside a checked nvme_path and probed for O_DIRECT; the
    file system is named once per process (a memory-backed one as memory, not NVMe).

    ``o_direct``: the run's ``aio.o_direct``; a file system refusing it is reported (once). A folder
    this call created is removed again when the probe refuses the path.
    """
    d = planned_rank_dir(path, rank)
    made = not d.exists()
    try:
        d.mkdir(exist_ok=True)
    except OSError as e:
        raise NvmePathError(
            e.errno or errno.EIO, f"cannot create '{d}' under nvme_path: {e.strerror}", str(d)
        ) from None
    try:
        direct = probe_o_direct(d) if o_direct else None
    except BaseException:
        if made:
            remove_if_empty([d])
        raise
    _report_file_system(path, d, direct)
    return d


def remove_if_empty(dirs: Iterable[Path]) -> None:
    """Removes each of ``dirs`` that is an empty folder (what a refused run made under nvme_path)."""
    for d in dirs:
        try:
            d.rmdir()
        except OSError:
            pass  # not empty, or already gone: not ours to remove


def paths_of(nvme_path: PathsArg | None) -> list[PathArg]:
    """The paths an nvme_path setting names: [] for None, [p] for one path, the list for several."""
    if nvme_path is None:
        return []
    if isinstance(nvme_path, (str, os.PathLike)):
        return [nvme_path]
    return list(nvme_path)


def rank_dirs(nvme_path: PathsArg, rank: int, *, o_direct: bool = True) -> list[Path]:
    """``<path>/rank<rank>`` on every path of ``nvme_path`` (see rank_dir), after check_distinct."""
    paths = paths_of(nvme_path)
    made = [d for d in planned_rank_dirs(nvme_path, rank) if not d.exists()]
    try:
        return [rank_dir(p, rank, o_direct=o_direct) for p in paths]
    except BaseException:
        remove_if_empty(made)
        raise


def planned_rank_dirs(nvme_path: PathsArg, rank: int) -> list[Path]:
    """``<path>/rank<rank>`` on every path of ``nvme_path``, checked (see rank_dirs), none created."""
    paths = paths_of(nvme_path)
    if not paths:
        raise NvmePathError(
            errno.EINVAL, "nvme_path is an empty list; name at least one directory", ""
        )
    planned = [planned_rank_dir(p, rank) for p in paths]
    check_distinct(paths)
    return planned


def check_distinct(paths: Sequence[PathArg]) -> None:
    """Refuses a directory listed twice (after ``~``, relative paths and symbolic links are resolved);
    reports once per file system two paths on it: striping over them adds no bandwidth."""
    seen: dict[str, PathArg] = {}
    for p in paths:
        real = os.path.realpath(expand(p))
        if real in seen:
            raise NvmePathError(
                errno.EINVAL,
                f"nvme_path lists the same directory twice: {_named(seen[real], expand(seen[real]))} and "
                f"{_named(p, expand(p))} are both {real}; list each drive's directory once",
                real,
            )
        seen[real] = p
    by_dev: dict[int, list[PathArg]] = {}
    for p in paths:
        try:
            by_dev.setdefault(os.stat(expand(p)).st_dev, []).append(p)
        except OSError:
            continue  # a missing path is refused where it is checked, with its own message
    for dev, shared in by_dev.items():
        if len(shared) > 1:
            _report_shared(dev, shared)


def _report_shared(dev: int, shared: list[PathArg]) -> None:
    with _lock:
        if dev in _shared_reported:
            return
        _shared_reported.add(dev)
    m = mount_of(shared[0])
    log.warning(
        "nvme_path lists %s on one file system (%s at %s): swap space is striped over them, but they "
        "share one drive's bandwidth, so this is no faster than one of them; list one directory per drive",
        " and ".join(_named(p, expand(p)) for p in shared),
        m.fs_type,
        m.mountpoint or "?",
    )


def probe_o_direct(directory: Path) -> bool:
    """Whether files in ``directory`` open with O_DIRECT (an empty probe file, removed at once)."""
    probe = directory / f".infinity-probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        # Created first, then opened direct: ramfs creates the file even as it refuses O_DIRECT.
        os.close(os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
    except OSError as e:
        raise NvmePathError(
            e.errno or errno.EIO,
            f"cannot create a file in '{directory}' under nvme_path: {e.strerror}",
            str(directory),
        ) from None
    try:
        os.close(os.open(probe, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC))
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise NvmePathError(
                e.errno or errno.EIO,
                f"cannot open a file in '{directory}' under nvme_path: {e.strerror}",
                str(directory),
            ) from None
        return False
    finally:
        os.unlink(probe)
    return True


_reported: set[str] = set()
_shared_reported: set[int] = set()
_lock = threading.Lock()


MEMORY_FILE_SYSTEMS = ("tmpfs", "ramfs")
"""File systems whose files live in host memory: swap files there save no RAM."""


def _report_file_system(path: PathArg, d: Path, direct: bool | None) -> None:
    """Names, once per process and file system, what nvme_path is on: a memory-backed one as memory
    (warning), one refusing O_DIRECT as buffered (warning), else its type and device (info).
    ``direct``: the probe's answer, None where aio.o_direct is false (buffered I/O asked for)."""
    m = mount_of(d)
    with _lock:
        if m.mountpoint in _reported:
            return
        _reported.add(m.mountpoint)
    name, at = _named(path, expand(path)), m.mountpoint or "?"
    if m.fs_type in MEMORY_FILE_SYSTEMS:
        log.warning(
            "nvme_path %s is on a %s file system (mounted at %s), which is host memory, not NVMe: swap "
            "files there take RAM, so offloading to it saves none%s. Point nvme_path at a directory on "
            "a local NVMe drive (ext4, xfs)",
            name,
            m.fs_type,
            at,
            f" (and {m.fs_type} refuses O_DIRECT)" if direct is False else "",
        )
    elif direct is False:
        log.warning(
            "nvme_path %s is on a %s file system (mounted at %s), which refuses O_DIRECT: swap files "
            "there are read and written through the page cache (slower, and the cache takes host "
            "memory). Point nvme_path at a local disk (ext4, xfs) for direct I/O, or set aio.o_direct "
            "to false if buffered I/O is meant",
            name,
            m.fs_type,
            at,
        )
    else:
        log.info(
            "nvme_path %s: a %s file system on %s (mounted at %s), %s",
            name,
            m.fs_type,
            m.device or "?",
            at,
            "with O_DIRECT" if direct else "buffered (aio.o_direct is false)",
        )


def _forget_reports() -> None:
    """Test hook: makes the next refusal of O_DIRECT, and the next shared file system, reported again."""
    with _lock:
        _reported.clear()
        _shared_reported.clear()


def free_nbytes(path: PathArg) -> int:
    st = os.statvfs(expand(path))
    return st.f_bavail * st.f_frsize


def _reports_no_size(path: PathArg) -> bool:
    return os.statvfs(expand(path)).f_blocks == 0


def check_space(needs: Iterable[tuple[PathArg, int, str]]) -> None:
    """Refuses a run whose swap files cannot fit: ``needs`` = (folder, bytes, what) per store,
    summed per file system and compared with the space free there -- before anything is written."""
    by_dev: dict[int, list[tuple[Path, int, str]]] = {}
    for path, nbytes, what in needs:
        if nbytes:
            p = expand(path)
            by_dev.setdefault(os.stat(p).st_dev, []).append((p, nbytes, what))
    for entries in by_dev.values():
        path = entries[0][0]
        total = sum(n for _, n, _ in entries)
        parts = " + ".join(f"{what} {n}" for _, n, what in entries)
        m = mount_of(path)
        if _reports_no_size(path):
            raise NvmePathError(
                errno.ENOSPC,
                f"nvme_path '{path}' is on a {m.fs_type} file system (mounted at {m.mountpoint}) that "
                f"reports no size, so whether this rank's {total} bytes of swap files ({parts}) fit "
                "cannot be checked (on ramfs they would fill host memory); point nvme_path at a "
                "directory on a local disk",
                str(path),
            )
        free = free_nbytes(path)
        if total > free:
            raise NvmePathError(
                errno.ENOSPC,
                f"not enough free space at nvme_path '{path}' ({m.fs_type} at {m.mountpoint}): this "
                f"rank needs {total} bytes of swap files ({parts}) and {free} bytes are free; free "
                "space there, point nvme_path at a larger drive, or keep less on NVMe "
                "(offload_param.max_in_cpu, offload_*.device)",
                str(path),
            )


def space_error(path: Path, needed: int, free: int, what: str) -> SwapSpaceError:
    """The error of a swap space that cannot grow by ``needed`` bytes where ``free`` are free."""
    m = mount_of(path)
    why = (
        f"the {m.fs_type} file system there reports no size"
        if _reports_no_size(path)
        else f"the {m.fs_type} file system has {format_nbytes(free)} ({free} bytes) free"
    )
    return SwapSpaceError(
        errno.ENOSPC,
        f"not enough free space in nvme_path '{path}': {what} needs {format_nbytes(needed)} "
        f"({needed} bytes) more there and {why}; free some space, point nvme_path at a larger "
        "drive, or list several drives in nvme_path",
        str(path),
    )
