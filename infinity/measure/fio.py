"""fio, the disk's reference: runs one sequential read or write job and returns its GB/s.

Same file, block size and queue depth as the engine's run; ioengine=io_uring, direct=1. ``iomem``
picks fio's buffers: ``shmhuge`` (2 MiB pages from the hugetlb pool, the best fio does on a disk
that caps segments per request) or ``malloc`` (fio's default). ``shmhuge`` needs free pages in
``vm.nr_hugepages``; :func:`shmhuge_fits` says whether they are there.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from infinity import host

IoMem = Literal["shmhuge", "malloc"]


class FioError(RuntimeError):
    """fio is missing or a job failed; the message has fio's own words."""


def fio_path() -> str | None:
    return shutil.which("fio")


def fio_version() -> str:
    exe = fio_path()
    if exe is None:
        return ""
    r = subprocess.run([exe, "--version"], capture_output=True, text=True)
    return r.stdout.strip()


def shmhuge_fits(block_size: int, queue_depth: int, jobs: int) -> bool:
    """Whether fio's shmhuge buffers (block x depth per job, in 2 MiB pages) fit in the free
    pool."""
    per_job = -(-block_size * queue_depth // (2 << 20)) * (2 << 20) + (2 << 20)
    return per_job * jobs <= host.hugetlb_free_nbytes()


@dataclass(frozen=True)
class FioJob:
    """One sequential job over ``path``, or over several files at once (one job per file, run
    together, their bandwidth summed: the drives' aggregate limit). ``nbytes`` is per file."""

    path: Path | tuple[Path, ...]
    nbytes: int
    op: Literal["read", "write"]
    block_size: int
    queue_depth: int
    jobs: int = 1
    iomem: IoMem = "shmhuge"
    direct: bool = True

    @property
    def paths(self) -> tuple[Path, ...]:
        return self.path if isinstance(self.path, tuple) else (self.path,)

    def argv(self, exe: str) -> list[str]:
        per_job = self.nbytes // self.jobs // self.block_size * self.block_size
        argv = [
            exe,
            f"--rw={self.op}",
            f"--bs={self.block_size}",
            f"--iodepth={self.queue_depth}",
            "--ioengine=io_uring",
            f"--direct={int(self.direct)}",
            f"--size={per_job}",
            f"--numjobs={self.jobs}",
            f"--offset_increment={per_job}",
            "--group_reporting",
            f"--iomem={self.iomem}",
            "--output-format=json",
        ]
        if not self.direct:
            argv.append("--end_fsync=1")  # buffered writes count only once on disk
        # Options above are global; each --name starts a job (group_reporting sums them all).
        for i, path in enumerate(self.paths):
            argv += [f"--name=infinity{i or ''}", f"--filename={path}"]
        return argv

    def run(self, timeout_s: float = 600) -> float:
        """Runs the job; returns GB/s (1e9 bytes per second) over the whole job."""
        exe = fio_path()
        if exe is None:
            raise FioError("fio is not installed (Debian: apt-get install fio)")
        r = subprocess.run(self.argv(exe), capture_output=True, text=True, timeout=timeout_s)
        if r.returncode != 0:
            raise FioError(
                f"fio failed ({' '.join(self.argv(exe))}): {(r.stderr or r.stdout).strip()[-500:]}"
            )
        try:
            job = json.loads(r.stdout[r.stdout.index("{") :])["jobs"][0]
        except (ValueError, KeyError, IndexError) as e:
            raise FioError(f"cannot read fio's JSON output: {e}: {r.stdout[-300:]!r}") from None
        if job.get("error"):
            raise FioError(f"fio job error {job['error']}: {r.stderr.strip()[-300:]}")
        return job[self.op]["bw_bytes"] / 1e9
