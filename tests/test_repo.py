"""Repository-wide contracts: layering (docs/ARCHITECTURE.md), lint, and the README's set-up commands."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import background

ROOT = Path(__file__).resolve().parent.parent


def _tool(name: str) -> str:
    # The tool of the environment running the tests first: it imports this checkout.
    path = str(Path(sys.executable).parent / name)
    if not Path(path).exists():
        path = shutil.which(name) or path
    if not Path(path).exists():
        pytest.fail(f"{name} is not installed; it comes with `pip install -e '.[test]'`")
    return path


def test_layers_import_only_downward():
    r = subprocess.run([_tool("lint-imports")], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_ruff_clean():
    # bench/ and examples/ are checked once they exist (ruff fails with E902 on a missing path)
    paths = [p for p in ("infinity", "tests", "bench", "examples") if (ROOT / p).exists()]
    r = subprocess.run([_tool("ruff"), "check", *paths], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_ruff_format_clean():
    # One layout for every file, so that a diff shows what changed and not how it was typed.
    paths = [p for p in ("infinity", "tests", "bench", "examples") if (ROOT / p).exists()]
    r = subprocess.run(
        [_tool("ruff"), "format", "--check", *paths], cwd=ROOT, capture_output=True, text=True
    )
    assert r.returncode == 0, (
        "run `ruff format infinity tests bench examples`:\n" + r.stdout + r.stderr
    )


MYPY = "mypy"


def mypy(bg: background.Background, nice: int) -> subprocess.CompletedProcess:
    # The packages and settings are pyproject.toml's [tool.mypy]; its cache (.mypy_cache, ignored)
    # makes reruns quick.
    return bg.run(
        [sys.executable, "-m", "mypy"],
        cwd=ROOT,
        env=dict(os.environ),
        timeout=3600 if nice else 900,
        nice=nice,
    )


def test_mypy_clean(request):
    # Started in the background with the session ([Note: checks in the background]).
    r = background.of(request.config).result(MYPY, mypy)
    assert r.returncode == 0, "mypy found type errors:\n" + r.stdout + r.stderr


def test_readme_has_exactly_two_setup_commands():
    sys.path.insert(0, str(ROOT / ".ci"))
    try:
        import readme_command
    finally:
        sys.path.pop(0)
    cmds = readme_command.commands()
    assert "pytest" in cmds["tests"]
    assert cmds["main"].startswith("./setup.sh")
    # CI prints the slowest tests, so a test that grows slow is seen before the suite is.
    assert "--durations=25" in cmds["tests"].split()


def test_a_hung_test_fails_with_every_threads_stack(tmp_path):
    """The suite's per-test timeout (pyproject's [tool.pytest.ini_options]) is live: a test that
    hangs fails, and the stack of the hung thread is printed (here with the limit lowered)."""
    (tmp_path / "test_hang.py").write_text(
        "import threading, time\n"
        "def sleeper_in_a_thread():\n"
        "    time.sleep(60)\n"
        "def test_hangs():\n"
        "    threading.Thread(target=sleeper_in_a_thread, daemon=True).start()\n"
        "    time.sleep(60)\n"
    )
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-c",
            str(ROOT / "pyproject.toml"),
            "--rootdir",
            str(tmp_path),
            "-o",
            "timeout=3",
            "-o",
            "faulthandler_timeout=2",
            str(tmp_path),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "Failed: Timeout (>3.0s) from pytest-timeout" in out, out
    assert "Timeout (0:00:02)!" in out, out  # faulthandler's dump, from a C thread
    # both threads' stacks: the test's own and the one it started
    assert "in test_hangs" in out and "in sleeper_in_a_thread" in out, out
