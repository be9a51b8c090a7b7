"""Exceptions raised by the tiered store; each names the store, the key and what to do."""

from __future__ import annotations

import errno as _errno


class StoreError(Exception):
    """Base class of the store's errors."""


class StoreStateError(StoreError, RuntimeError):
    """An operation the key's residency state does not allow (e.g. evicting a held key)."""


class StoreIOError(StoreError, OSError):
    """A read or write of a key failed; the message names the key, the file and the offset."""

    def __init__(self, err: int, message: str, *, key: object = None):
        OSError.__init__(self, err, message)
        self.key = key

    def __str__(self) -> str:
        return str(self.strerror)


class IntegrityError(StoreIOError):
    """A key read back differs from what was written (its CRC32C does not match)."""

    def __init__(self, message: str, *, key: object = None):
        super().__init__(_errno.EIO, message, key=key)


class SwapSpaceError(StoreError, OSError):
    """nvme_path is missing, not a writable directory, or has too little free space."""

    def __init__(self, err: int, message: str, path: str):
        OSError.__init__(self, err, message, path)

    def __str__(self) -> str:
        return str(self.strerror)


class NvmePathError(SwapSpaceError, ValueError):
    """nvme_path cannot take the swap files: missing, a file, not writable, or too small (see nvme_path.py).

    A ValueError too: it is a setting to fix, refused before anything is written.
    """
