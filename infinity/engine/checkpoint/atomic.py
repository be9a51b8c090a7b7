"""The directory protocol that makes a checkpoint appear whole or not at all.

[Note: publishing a checkpoint]
0. Rank 0 takes the root's lock ([Note: one save per root] in lock.py),
   removes what interrupted saves of the same tag left, and creates the
   hidden directory; it holds the lock until step 4 is done.
1. Every rank writes its files into ``<root>/.<tag>.partial-<nonce>/`` (a
   hidden name no loader takes for a checkpoint) and fsyncs each file.
2. After all ranks report success, rank 0 writes ``manifest.json`` there
   (temporary name, fsync, rename), then fsyncs the directory.
3. Rank 0 renames the directory to ``<root>/<tag>`` and fsyncs ``<root>``.
   An existing ``<tag>`` is swapped out in one step (renameat2
   RENAME_EXCHANGE) and then deleted; where the kernel lacks it, the old one
   is first renamed to ``.<tag>.replaced-<nonce>`` (a loader finding
   ``<tag>`` missing names that copy).
4. Last, rank 0 points ``latest`` at the tag: temporary file, fsync,
   rename, fsync ``<root>``.
Every file is created 0600 and every directory 0700 (FILE_MODE, DIR_MODE),
as the swap files are: a checkpoint holds the weights, the optimizer state,
the RNG and the client state, which are no other local user's business.
A process killed at any point therefore leaves: the previous checkpoint and
``latest`` untouched (steps 1-3), or the new checkpoint complete but not yet
``latest`` (between 3 and 4). What it leaves behind is a ``.partial-``
directory, which loaders ignore with a warning. A directory is a checkpoint
only if it has a non-hidden name and a ``manifest.json``; ``latest`` must hold
such a name (never a path: one out of the root is refused, not followed).

Threading: called by one thread per rank; only rank 0 renames.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
from pathlib import Path

from infinity.engine.checkpoint import lock
from infinity.engine.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointIncompleteError,
    CheckpointNotFoundError,
    CheckpointSpaceError,
)
from infinity.engine.checkpoint.format import DIR_MODE, FILE_MODE, LATEST, MANIFEST

log = logging.getLogger("infinity.checkpoint")

PARTIAL = ".partial-"
REPLACED = ".replaced-"
FETCHED = ".fetched-"  # a load's copies of files other nodes hold ([Note: node-local checkpoints])

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def is_tag(tag: str) -> bool:
    """A tag names a directory directly in the checkpoint root: never a path out of it, a hidden name
    (the partial directories of saves in progress) or ``latest``."""
    return (
        bool(tag)
        and not tag.startswith(".")
        and "/" not in tag
        and "\0" not in tag
        and tag != LATEST
    )


def validate_tag(tag: str) -> str:
    tag = str(tag)
    if not is_tag(tag):
        raise ValueError(
            f"checkpoint tag {tag!r} is not usable as a directory name: it must be non-empty, must not "
            f"start with '.', contain '/' or be {LATEST!r}"
        )
    return tag


def partial_dir(root: Path, tag: str, nonce: str) -> Path:
    return root / f".{tag}{PARTIAL}{nonce}"


def make_dirs(path: Path) -> None:
    """Creates ``path`` and its missing parents with DIR_MODE (``mkdir -p`` gives parents the umask's
    mode); existing directories keep theirs. Raises NotADirectoryError naming a component that is a file."""
    missing = []
    p = path
    while not p.is_dir():
        if p.exists() or p.is_symlink():
            what = "a file" if p.is_file() else "a dangling link or a special file"
            where = "" if p == path else f", so the checkpoint directory '{path}' cannot be created"
            raise NotADirectoryError(
                f"'{p}' is {what}, not a directory{where}; save the checkpoint to a directory (it is created "
                "if missing), or move that file away"
            )
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, DIR_MODE)
        except FileExistsError:
            if not d.is_dir():
                raise


def fsync_path(path: Path | str, *, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def space_error(path: Path | str, need_nbytes: int, what: str) -> CheckpointSpaceError:
    where = os.path.dirname(os.fspath(path)) or "."
    try:
        st = os.statvfs(where)
        free = f"{st.f_bavail * st.f_frsize} bytes are free"
    except OSError:
        free = "its free space is unknown"
    return CheckpointSpaceError(
        f"no space left to write {what} ({need_nbytes} bytes) at '{path}': {free} on that file system; "
        "free space there or save the checkpoint to another directory",
        os.fspath(path),
    )


def write_durably(path: Path, data: bytes, what: str) -> None:
    """Creates ``path`` (never over an existing file), writes ``data`` and fsyncs it."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    except FileExistsError:
        raise FileExistsError(
            f"{path} already exists; another save is writing the same checkpoint"
        ) from None
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise space_error(path, len(data), what) from e
        raise
    finally:
        os.close(fd)


def replace_durably(path: Path, data: bytes, what: str, nonce: str) -> None:
    """Writes ``path`` whole or not at all: temporary file, fsync, rename, fsync of the directory."""
    tmp = path.with_name(f".{path.name}{PARTIAL}{nonce}")
    write_durably(tmp, data, what)
    os.replace(tmp, path)
    fsync_path(path.parent, directory=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swaps two paths atomically (renameat2 RENAME_EXCHANGE); False where the kernel or libc lacks it."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except AttributeError:
        return False
    ret = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if ret == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, f"renameat2(RENAME_EXCHANGE) of {a} and {b}: {os.strerror(err)}")


def publish(tmp: Path, final: Path, nonce: str) -> None:
    """Step 3 of [Note: publishing a checkpoint]: ``tmp`` becomes ``final``, replacing one there."""
    root = final.parent
    if not final.exists():
        os.rename(tmp, final)
        fsync_path(root, directory=True)
        return
    if _exchange(tmp, final):
        fsync_path(root, directory=True)
        shutil.rmtree(tmp)  # the old checkpoint, now under the partial name
        return
    old = root / f".{final.name}{REPLACED}{nonce}"
    os.rename(final, old)
    os.rename(tmp, final)
    fsync_path(root, directory=True)
    shutil.rmtree(old)


def write_latest(root: Path, tag: str, nonce: str) -> None:
    """Step 4: ``latest`` names ``tag`` (DeepSpeed's file: the tag alone, on one line)."""
    replace_durably(root / LATEST, (tag + "\n").encode(), f"{root / LATEST}", nonce)


def read_latest(root: Path) -> str | None:
    """The tag ``root/latest`` names, or None without that file. Raises CheckpointCorruptError naming the
    file and its content where that is not a tag (a path out of ``root`` is never followed)."""
    path = root / LATEST
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise CheckpointCorruptError(
            f"'{path}' is a directory; it must be a file holding the tag of a checkpoint in '{root}' (remove "
            "or rename that directory, or pass tag=...)",
            path=str(path),
        ) from None
    text = raw.decode("utf-8", "replace").strip()
    if not is_tag(text):
        raise CheckpointCorruptError(
            f"'{path}' holds {text!r}, which is not the tag of a checkpoint in '{root}': a tag is the name of a "
            "directory directly in that root (not empty, no '/', not starting with '.'), and a path elsewhere "
            f"is never followed; write a tag there (complete checkpoints: {', '.join(complete_tags(root)) or 'none'}) "
            "or pass tag=...",
            path=str(path),
        )
    return text


def leftovers(root: Path) -> list[Path]:
    """Directories a killed save left behind (``.partial-`` or ``.replaced-``), oldest first."""
    try:
        found = [
            p
            for p in root.iterdir()
            if p.name.startswith(".")
            and (PARTIAL in p.name or REPLACED in p.name or FETCHED in p.name)
        ]
    except FileNotFoundError:
        return []
    return sorted(found, key=lambda p: p.stat().st_mtime if p.exists() else 0)


def complete_tags(root: Path) -> list[str]:
    try:
        return sorted(
            p.name
            for p in root.iterdir()
            if not p.name.startswith(".") and (p / MANIFEST).is_file()
        )
    except FileNotFoundError:
        return []


def warn_leftovers(root: Path) -> None:
    """Logs each hidden directory in ``root``: being written by a save in progress (see [Note: one save
    per root] in lock.py), or left by an interrupted one (a warning: it can be deleted)."""
    owner = lock.current_owner(root)
    for p in leftovers(root):
        if owner is not None and p.name == owner.get("dir"):
            running = lock.is_running(owner)
            if running:
                log.info(
                    "ignoring '%s': a save in progress is writing it (%s)", p, lock.describe(owner)
                )
                continue
            if running is None:
                log.warning(
                    "ignoring '%s': not a checkpoint yet; it is being written by a save on another host (%s) "
                    "unless that save was interrupted: leave it while that save may run",
                    p,
                    lock.describe(owner),
                )
                continue
        kind = (
            "an interrupted save"
            if PARTIAL in p.name
            else "an interrupted load (its copies of files other nodes hold)"
            if FETCHED in p.name
            else "an interrupted replacement of a checkpoint"
        )
        log.warning(
            "ignoring '%s': left incomplete by %s (the process was killed or failed mid-save); it is not a "
            "checkpoint and can be deleted to free space",
            p,
            kind,
        )


def resolve(path: str | os.PathLike[str], tag: str | None, *, warn: bool = True) -> Path:
    """The checkpoint directory that ``path`` (a root with ``latest``, or a checkpoint itself) and
    ``tag`` name; ``warn``: log the leftovers of interrupted saves found there. Raises
    CheckpointNotFoundError / CheckpointIncompleteError saying what is there."""
    root = Path(path)
    if not root.is_dir():
        if root.exists():
            raise CheckpointNotFoundError(
                f"'{root}' is a file, not a directory: pass the checkpoint directory (or the directory holding "
                f"'{LATEST}') that save_checkpoint wrote"
            )
        raise CheckpointNotFoundError(f"checkpoint directory '{root}' does not exist")
    if tag is None and (root / MANIFEST).is_file():
        return root
    if warn:
        warn_leftovers(root)
    if tag is None:
        tag = read_latest(root)
        if tag is None:
            tags = complete_tags(root)
            hint = (
                f"complete checkpoints there: {', '.join(tags)}; pass tag=..."
                if tags
                else "it holds no complete checkpoint"
            )
            raise CheckpointNotFoundError(
                f"no '{LATEST}' file in '{root}' to say which checkpoint to load; {hint}"
            )
        source = f"named by '{root / LATEST}'"
    else:
        tag = validate_tag(tag)
        source = "asked for"
    ckpt = root / tag
    if not ckpt.is_dir():
        replaced = [p for p in leftovers(root) if p.name.startswith(f".{tag}{REPLACED}")]
        hint = (
            f"; a save replacing it was interrupted and the previous copy is at '{replaced[-1]}' (rename it to "
            f"'{ckpt}' to use it)"
            if replaced
            else f"; complete checkpoints there: {', '.join(complete_tags(root)) or 'none'}"
        )
        raise CheckpointNotFoundError(
            f"checkpoint '{tag}' {source} does not exist in '{root}'{hint}"
        )
    if not (ckpt / MANIFEST).is_file():
        raise CheckpointIncompleteError(
            f"'{ckpt}' has no {MANIFEST}: it is not a complete checkpoint (a save into it did not finish, or "
            "it was copied partly); load another tag"
        )
    return ckpt
