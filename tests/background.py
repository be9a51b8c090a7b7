"""Long subprocess checks that a session starts as soon as it has collected the tests reading them.

[Note: checks in the background] A few checks are one long command each, mostly one busy
thread: mypy over the typed packages, and .ci/sanitize.sh's ASan + UBSan build of the extensions
followed by the aio and Adam tests against it (minutes of CPU). The rest of the suite leaves one
of the two cores idle much of the time (most tests are one Python thread), so tests/conftest.py
starts these when the session has collected a test that reads them, at a lower priority
(nice 10), and each such test waits for its command's result: the command and the test's checks
are those of a foreground run. A command is killed, its whole process group, when the session
ends before it does.
"""

from __future__ import annotations

import concurrent.futures
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from tests import process_group

NICE = 10


# A job: runs its commands with Background.run at the niceness given, returns what tests read.
Job = Callable[["Background", int], object]


class Background:
    """The commands of one session: ``start`` runs a job on a worker thread at nice 10;
    ``result`` waits for it, or runs the job now (not lowered) when it was not started; ``stop``
    kills what still runs."""

    def __init__(self) -> None:
        self.live: set[subprocess.Popen] = set()
        self.stopping = threading.Event()
        self.pool = concurrent.futures.ThreadPoolExecutor(2)
        self.jobs: dict[str, concurrent.futures.Future] = {}

    def run(
        self, args: list[str], *, cwd: Path, env: dict[str, str], timeout: float, nice: int
    ) -> subprocess.CompletedProcess:
        """``args`` in its own process group (killed whole on a timeout or by ``stop``)."""
        if self.stopping.is_set():
            raise RuntimeError(f"the session is ending: {args[0]} is not started")
        proc = process_group.start(["nice", "-n", str(nice), *args], cwd=cwd, env=env)
        self.live.add(proc)
        try:
            return process_group.finish(proc, timeout=timeout)
        finally:
            self.live.discard(proc)

    def start(self, name: str, job: Job) -> None:
        if name not in self.jobs:
            self.jobs[name] = self.pool.submit(job, self, NICE)

    def result(self, name: str, job: Job) -> object:
        return self.jobs[name].result() if name in self.jobs else job(self, 0)

    def stop(self) -> None:
        self.stopping.set()
        for proc in list(self.live):
            process_group.kill(proc)
        self.pool.shutdown(wait=True, cancel_futures=True)


KEY = pytest.StashKey[Background]()


def of(config: pytest.Config) -> Background:
    """This session's background commands (made on first use)."""
    if KEY not in config.stash:
        config.stash[KEY] = Background()
    return config.stash[KEY]
