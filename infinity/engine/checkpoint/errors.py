"""Exceptions of checkpoint save, load and export; each names the file or tensor at fault and what to do.

A failed load raises before the engine's state is changed (see load.py), so
catching one of these leaves the run exactly as it was.
"""

from __future__ import annotations

import errno as _errno


class CheckpointError(Exception):
    """Base class of the checkpoint errors."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint where one was asked for: no ``latest``, an unknown tag, or a missing file."""

    def __init__(self, message: str):
        FileNotFoundError.__init__(self, _errno.ENOENT, message)

    def __str__(self) -> str:
        return str(self.strerror)


class CheckpointIncompleteError(CheckpointError):
    """The checkpoint asked for was never completed (a save was interrupted before it was published)."""


class CheckpointCorruptError(CheckpointError):
    """A file of the checkpoint is truncated, unparsable, or its CRC32C differs from the manifest's."""

    def __init__(self, message: str, *, path: str | None = None):
        super().__init__(message)
        self.path = path


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint does not fit this engine: another model, layout or optimizer."""


class CheckpointSpaceError(CheckpointError, OSError):
    """The checkpoint directory's file system has too little free space for the save."""

    def __init__(self, message: str, path: str):
        OSError.__init__(self, _errno.ENOSPC, message, path)

    def __str__(self) -> str:
        return str(self.strerror)


class CheckpointBusyError(CheckpointError):
    """Another process is saving into the same checkpoint directory (see [Note: one save per root])."""


class CheckpointPeerError(CheckpointError):
    """Another rank failed during a collective save or load; its own exception says why."""


class CheckpointUnsupportedError(CheckpointError, ValueError):
    """This engine's state is of a kind save_checkpoint / load_checkpoint do not move."""
