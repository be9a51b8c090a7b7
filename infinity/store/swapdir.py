"""SwapDir: a store's own directory under nvme_path, owned through a locked lock file.

Layout: ``<nvme_path>/<store id>/`` holds the swap files and ``infinity.lock``
(``nvme_path`` checked, and ``~`` expanded, by nvme_path.py).
The store id is unique per process and per store (name, pid, a per-process
sequence number and a random suffix), so two stores in one process — a
teacher and a student — never share files.

[Note: stale swap directories]
The lock file holds JSON naming the owner (pid, host, process start time) and
the owner keeps an exclusive ``flock`` on it for its whole life. When a store
opens, every other store directory under the same nvme_path is examined:
- its flock is held: the owner is alive; never touched;
- the flock is free (flocks die with their process) and the owner is on this
  host and dead, or its pid now belongs to a process that started at another
  time (pid reuse): the directory is stale and removed, with one log line;
- anything else (another host, unreadable or fresh lock, a live pid with the
  same start time) is left alone: only what is provably ours and dead goes.
The flock is what makes a live owner safe even under pid reuse; the pid and
start time only add a second, conservative check.

Threading: a SwapDir is created and closed by its store, under the store's lock.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import json
import logging
import os
import re
import secrets
import shutil
import socket
import time
from pathlib import Path

from infinity.host import process_start_time
from infinity.memory import format_nbytes
from infinity.store.errors import SwapSpaceError
from infinity.store.nvme_path import check_directory

log = logging.getLogger("infinity.store")

LOCK_NAME = "infinity.lock"
OWNER_TAG = "infinity.store"
DIR_PREFIX = "infinity-"
# A lock file younger than this with no owner recorded may belong to a store
# that is still being created: leave it.
FRESH_S = 60.0

_seq = itertools.count()


def new_store_id(name: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:48] or "store"
    return f"{DIR_PREFIX}{safe}-{os.getpid()}-{next(_seq)}-{secrets.token_hex(3)}"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SwapDir:
    """The directory of one store on one drive, created under ``root`` and owned until close()."""

    def __init__(self, root: Path, store_id: str, store_name: str):
        root = check_directory(root)
        reclaim_stale(root)
        self.root = root
        self.path = root / store_id
        try:
            os.mkdir(self.path, 0o700)
        except PermissionError as e:
            raise SwapSpaceError(
                errno.EACCES,
                f"nvme_path '{root}' is not writable by this process ({e.strerror}); change its "
                "owner or mode, or choose another directory",
                str(root),
            ) from None
        except OSError as e:
            raise SwapSpaceError(
                e.errno or errno.EIO,
                f"cannot create a swap directory in nvme_path '{root}': {e.strerror}",
                str(root),
            ) from None
        lock_path = self.path / LOCK_NAME
        self._lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        owner = {
            "owner": OWNER_TAG,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "start_time": process_start_time(os.getpid()),
            "store": store_name,
            "created": time.time(),
        }
        os.write(self._lock_fd, json.dumps(owner).encode())
        self._closed = False

    def close(self) -> None:
        """Removes the directory and everything in it, then drops the lock. Idempotent."""
        if self._closed:
            return
        self._closed = True
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._lock_fd)


def _stale_reason(d: Path, fd: int) -> str | None:
    """Why ``d`` is a dead store's directory that may be removed, or None to leave it.

    ``fd`` is its lock file, which the caller holds flocked.
    """
    try:
        info = json.loads(os.read(fd, 4096).decode() or "null")
    except (ValueError, UnicodeDecodeError):
        info = None
    if not isinstance(info, dict) or info.get("owner") != OWNER_TAG:
        age = time.time() - os.fstat(fd).st_mtime
        return f"an unowned lock file {age:.0f} s old" if age > FRESH_S else None
    if info.get("host") != socket.gethostname():
        return None
    pid = int(info.get("pid", -1))
    start = process_start_time(pid) if pid > 0 else None
    if start is None or not pid_alive(pid):
        return f"its owner, pid {pid}, is dead"
    if start == -1 or start == info.get("start_time"):
        return None  # that very process still runs: never touch it
    return f"its owner, pid {pid}, is dead (the pid now belongs to another process)"


def reclaim_stale(root: Path) -> list[Path]:
    """Removes the directories of dead stores under ``root`` (see [Note: stale swap directories])."""
    removed: list[Path] = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return removed
    for d in entries:
        if not d.name.startswith(DIR_PREFIX) or not d.is_dir() or d.is_symlink():
            continue
        try:
            fd = os.open(d / LOCK_NAME, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue  # not a store directory (or not ours to judge)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live owner holds it
            why = _stale_reason(d, fd)
            if why is None:
                continue
            nbytes = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
            shutil.rmtree(d, ignore_errors=True)  # still holding the flock
        finally:
            os.close(fd)
        removed.append(d)
        log.warning(
            "reclaimed stale swap directory %s (%s): %s freed", d, why, format_nbytes(nbytes)
        )
    return removed
