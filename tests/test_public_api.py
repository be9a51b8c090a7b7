"""The top-level namespace: ``dir(infinity)`` shows the public API and the subpackages, nothing else.

It showed ``Any``, ``annotations`` and ``importlib`` (the lazy loader's own imports).
"""

import pkgutil
import subprocess
import sys

import infinity


def _subpackages() -> set[str]:
    return {m.name for m in pkgutil.iter_modules(infinity.__path__)}


def _visible(names: list[str]) -> set[str]:
    return {n for n in names if not (n.startswith("__") and n.endswith("__"))}


def test_dir_shows_only_the_public_api_and_subpackages():
    # a fresh interpreter: before and after every lazy name is loaded
    code = (
        "import infinity\n"
        "print(','.join(dir(infinity)))\n"
        "for n in infinity.__all__: getattr(infinity, n)\n"
        "import infinity.aio, infinity.store\n"
        "print(','.join(dir(infinity)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, after = (line.split(",") for line in out.stdout.splitlines())
    allowed = set(infinity.__all__) | _subpackages()
    assert _visible(before) <= allowed, sorted(_visible(before) - allowed)
    assert _visible(after) <= allowed, sorted(_visible(after) - allowed)
    assert set(infinity.__all__) <= set(before)  # the lazy names are listed before they are loaded
