"""A note added to an exception on its way up (what the engine was doing when it was raised)."""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("infinity.engine")


def add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)`` (Python 3.11+); Python 3.10 has no notes, so there it is logged."""
    if sys.version_info >= (3, 11):
        error.add_note(note)
    else:
        log.error("%s: %s", type(error).__name__, note)
