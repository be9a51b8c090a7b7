"""Helpers shared by the aio tests: deterministic random bytes, and small mounted file systems."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest


def random_bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@contextlib.contextmanager
def mounted(kind: str, where: Path, size: str = "16M", options: str = "") -> Iterator[Path]:
    """Mounts a small file system at ``where``/mnt: ``ext4`` (a loop-mounted image), ``tmpfs`` or ``ramfs``.

    Skips (with the reason) where this process may not mount: not root, no
    loop devices, or a container without CAP_SYS_ADMIN.
    """
    if os.geteuid() != 0:
        pytest.skip(f"mounting a {kind} file system needs root; running as uid {os.geteuid()}")
    if shutil.which("mount") is None:
        pytest.skip("mount(8) is not installed")
    mnt = where / f"mnt-{kind}"
    mnt.mkdir()
    opts = [o for o in options.split(",") if o]
    if kind == "ext4":
        image = where / "fs.img"
        with open(image, "wb") as f:
            f.truncate(_parse_size(size))
        mkfs = subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], capture_output=True, text=True)
        if mkfs.returncode != 0:
            pytest.skip(f"mkfs.ext4 failed: {mkfs.stderr.strip()}")
        cmd = ["mount", "-o", ",".join(["loop", *opts]), str(image), str(mnt)]
    elif kind == "tmpfs":
        cmd = ["mount", "-t", "tmpfs", "-o", ",".join([f"size={size}", *opts]), "tmpfs", str(mnt)]
    else:
        cmd = ["mount", "-t", kind, *(["-o", ",".join(opts)] if opts else []), kind, str(mnt)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a {kind} file system here ({' '.join(cmd)}: {r.stderr.strip()})")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _parse_size(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * units[s[-1]] if s[-1] in units else int(s)
