"""What a result records of where it was measured, so that it can be read later: versions, CPU,
memory, kernel, fio and the file system under each measured path."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from infinity import host
from infinity.measure.fio import fio_version


def machine_info(path: Path | Sequence[Path]) -> dict[str, Any]:
    """What a result needs to be read later: versions, CPU, memory, kernel and the device under
    ``path`` (under each path, as lists, where several were measured)."""
    paths = [path] if isinstance(path, Path) else list(path)
    import infinity  # the version lives in the package's root, which imports all of it

    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "kernel": platform.release(),
        "cpu": host.cpu_model(),
        "cpus": os.cpu_count(),
        "memory_gib": round(host.memory_total_nbytes() / (1 << 30), 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "infinity": infinity.__version__,
        "fio": fio_version(),
        "path": str(paths[0].resolve()) if len(paths) == 1 else [str(p.resolve()) for p in paths],
        "filesystem": mount_of(paths[0]) if len(paths) == 1 else [mount_of(p) for p in paths],
    }


def mount_of(path: Path) -> dict[str, str]:
    """The file system holding ``path`` as results record it: device, mount point, type ('' where
    unknown)."""
    m = host.mount_of(path)
    return {
        "device": m.device if m else "",
        "mountpoint": m.mountpoint if m else "",
        "type": m.fs_type if m else "",
    }
