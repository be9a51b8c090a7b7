"""The directory a monitor writes in: ``output_path/job_name``, made and checked at initialize.

DeepSpeed joins the two keys (``output_path`` "" is the current directory).
A directory that cannot be made or written is a ConfigError naming the
section's ``output_path`` key and the OS's reason, raised before training
starts rather than at the first step's write.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from infinity.config import ConfigError


def job_directory(section: str, output_path: str, job_name: str) -> Path:
    """Makes and returns ``output_path/job_name`` for section ``section`` (e.g. "tensorboard")."""
    where = Path(output_path or ".") / job_name
    try:
        where.mkdir(parents=True, exist_ok=True)
        # Writable, checked by writing: os.access says yes to root on a read-only mount.
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as e:
        raise ConfigError(
            f"{section}.output_path: cannot write the monitor's files in {os.fspath(where)!r} "
            f"({e.strerror or e}); set {section}.output_path (and {section}.job_name) to a "
            "writable directory"
        ) from None
    return where
