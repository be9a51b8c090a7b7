"""The runs of .ci/sanitize.sh that tests/test_sanitizers.py checks: the build, then the aio and
Adam tests against it, one job started in the background ([Note: checks in the background] in
tests/background.py). The sanitized pytest then gets a larger per-test limit, as the rest of the
suite may hold the CPUs while one of its tests runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.background import Background

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / ".ci" / "sanitize.sh"
NAME = "sanitizer"
BACKGROUND_TEST_TIMEOUT_S = 1800


def sanitized(
    bg: Background, *command: str, timeout: float, nice: int = 0
) -> subprocess.CompletedProcess:
    """``.ci/sanitize.sh *command`` (no command: the aio and Adam tests), a fresh environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LD_PRELOAD")}
    env["PYTHON"] = sys.executable
    if nice:
        env["PYTEST_ADDOPTS"] = f"--timeout={BACKGROUND_TEST_TIMEOUT_S}"
    return bg.run([str(SCRIPT), *command], cwd=ROOT, env=env, timeout=timeout, nice=nice)


def build_then_tests(
    bg: Background, nice: int
) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    """The build's result and the sanitized tests' (the build's again when it failed). Each run
    of sanitize.sh re-copies the package the sanitized tests import, so other runs (the planted
    bugs') wait for both."""
    timeout = 3600 if nice else 1200
    built = sanitized(bg, "true", timeout=timeout, nice=nice)
    return built, (sanitized(bg, timeout=timeout, nice=nice) if built.returncode == 0 else built)
