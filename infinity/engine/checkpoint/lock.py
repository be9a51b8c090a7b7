"""SaveLock: one save at a time into a checkpoint root, so that no save takes another's files for debris.

[Note: one save per root]
Rank 0 of a save holds an exclusive ``flock`` on ``<root>/.infinity-save.lock``
from before it creates its hidden directory ([Note: publishing a checkpoint]
in atomic.py) until ``latest`` names the new checkpoint or the failed save's
directory is removed. While holding it, it writes into the file who it is
(pid, host, tag, its hidden directory, since when) and empties it on release.
- A second save into the same root (another job, or another engine of this
  process) is refused at once, naming the holder from that JSON: waiting
  would leave its other ranks blocked in a collective for as long.
- Only the holder removes what interrupted saves of its tag left: with the
  lock held, no hidden directory there belongs to a live save.
- Loaders take no lock (a probe could make a save starting at that moment
  fail); they read the file to tell a directory being written by a save in
  progress (its pid still runs on this host) from one a killed save left.
The file stays in the root: removing it would race with a process that has
just opened it. flock reaches across hosts on NFS (Linux maps it to POSIX
locks); where a file system has no locks at all, the save goes on unlocked
with a warning.

Threading: a SaveLock is taken and released by one thread.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from infinity.engine.checkpoint.errors import CheckpointBusyError
from infinity.engine.checkpoint.format import FILE_MODE

log = logging.getLogger("infinity.checkpoint")

LOCK_NAME = ".infinity-save.lock"
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)


class SaveLock:
    """The exclusive right to save into ``root`` (see [Note: one save per root])."""

    def __init__(self, root: Path, tag: str, partial: Path):
        self.path = root / LOCK_NAME
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = describe(_read_owner(fd))
            os.close(fd)
            raise CheckpointBusyError(
                f"another save into '{root}' is in progress ({holder}): two saves into one checkpoint directory "
                "would take each other's files for debris; wait for it to finish, or save to another directory"
            ) from None
        except OSError as e:
            os.close(fd)
            if e.errno not in _NO_LOCKS:
                raise OSError(
                    e.errno, f"cannot lock '{self.path}' for the save: {e.strerror}"
                ) from None
            log.warning(
                "the file system of '%s' has no file locks (%s): a second process saving into it at the "
                "same time would not be noticed",
                root,
                e.strerror,
            )
            self._fd: int | None = None
            return
        owner = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "tag": tag,
            "dir": partial.name,
            "since": time.time(),
        }
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(owner).encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        """Empties the file and drops the lock (closing the descriptor drops it). Idempotent."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)


def _read_owner(fd: int) -> dict[str, Any] | None:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "null")
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return info if isinstance(info, dict) else None


def current_owner(root: Path) -> dict[str, Any] | None:
    """What the holder of ``root``'s lock wrote about itself, or None (no save, or none recorded yet)."""
    try:
        fd = os.open(root / LOCK_NAME, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return _read_owner(fd)
    finally:
        os.close(fd)


def describe(owner: dict[str, Any] | None) -> str:
    if owner is None:
        return "by a process that has not recorded itself yet"
    try:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(owner["since"])))
    except (KeyError, TypeError, ValueError):
        since = "an unknown time"
    return f"pid {owner.get('pid')} on host {owner.get('host')!r}, saving tag {owner.get('tag')!r} since {since}"


def is_running(owner: dict[str, Any]) -> bool | None:
    """Whether the process ``owner`` names still runs: None where it is on another host (unknowable here).
    A reused pid reads as running, which only makes a loader's advice more careful."""
    if owner.get("host") != socket.gethostname():
        return None
    try:
        pid = int(owner["pid"])
        if pid <= 0:
            return False
        os.kill(pid, 0)
    except (KeyError, TypeError, ValueError, ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True
    return True
