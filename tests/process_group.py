"""A command run in a process group of its own, killed whole if it outlives its timeout: what the
background checks (tests/background.py) and the scripts run as a user runs them
(tests/integrations/subprocesses.py) share. A rank a launcher started, or a compiler a build
script ran, goes with it."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path


def start(args: list[str], *, cwd: Path, env: dict[str, str]) -> subprocess.Popen:
    """``args`` started in a new session (its own process group), output captured as text."""
    return subprocess.Popen(
        args,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL to ``proc``'s whole process group (nothing, where it has ended)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def finish(proc: subprocess.Popen, *, timeout: float) -> subprocess.CompletedProcess:
    """Waits for ``proc``; past ``timeout`` its group is killed and an AssertionError shows the
    ends of its output (a safety net for a hang on a loaded machine, not a timing check)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill(proc)
        out, err = proc.communicate()
        raise AssertionError(
            f"{' '.join(map(str, proc.args))} ran past {timeout} s and was killed:\n"
            f"{out[-4000:]}\n{err[-8000:]}"
        ) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
