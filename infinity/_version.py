"""The version of infinity, from its one source: ``[project] version`` in pyproject.toml.

An installed package reads it from its metadata (importlib.metadata, which the build wrote from
pyproject.toml); a source checkout run from its root (``PYTHONPATH=$PWD``) reads the pyproject.toml
beside the package, so an older install elsewhere never answers for the code that runs.
"""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

DISTRIBUTION = "infinity-offload"
"""The name pip knows the package by (``[project] name``)."""

_PROJECT_VERSION = re.compile(r'^\[project\][^\[]*?^version\s*=\s*"([^"]+)"', re.M | re.S)
_PROJECT_NAME = re.compile(r'^\[project\][^\[]*?^name\s*=\s*"([^"]+)"', re.M | re.S)


def checkout_version(pyproject: Path) -> str | None:
    """``[project] version`` of ``pyproject`` when it is infinity's own, else None. Read with a
    pattern, not tomllib, which Python 3.10 lacks."""
    try:
        text = pyproject.read_text(encoding="utf-8")
    except OSError:
        return None
    name = _PROJECT_NAME.search(text)
    version = _PROJECT_VERSION.search(text)
    if name is None or version is None or name.group(1) != DISTRIBUTION:
        return None
    return version.group(1)


def version() -> str:
    """The running code's version: its checkout's pyproject.toml, else the installed metadata."""
    found = checkout_version(Path(__file__).resolve().parent.parent / "pyproject.toml")
    if found is not None:
        return found
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        raise RuntimeError(
            f"infinity runs from {Path(__file__).parent} with neither a pyproject.toml beside it nor "
            f"{DISTRIBUTION!r} installed: install the package (pip install .) or run from a checkout"
        ) from None
