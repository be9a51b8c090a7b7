"""Running a script the way a user does (a fresh interpreter), with deepspeed made unimportable."""

import os
import subprocess
import sys
from pathlib import Path

from tests import process_group

ROOT = Path(__file__).resolve().parents[2]
LAUNCH_VARIABLES = (
    "LOCAL_RANK",
    "NODE_RANK",
    "GROUP_RANK",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PL_GLOBAL_SEED",
)


def without_deepspeed(tmp_path: Path) -> dict[str, str]:
    """The environment for a child process in which ``import deepspeed`` raises ImportError (a package
    of that name first on the path that refuses to load); the repository root is importable too."""
    blocker = tmp_path / "no_deepspeed" / "deepspeed"
    blocker.mkdir(parents=True, exist_ok=True)
    (blocker / "__init__.py").write_text(
        'raise ImportError("deepspeed was imported; infinity\'s framework adapters must not need it")\n'
    )
    path = [str(blocker.parent), str(ROOT)] + [
        p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p
    ]
    # A user's shell has no rank layout: Lightning would take one for ranks started on its behalf.
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    return {**env, "PYTHONPATH": os.pathsep.join(path), "PYTHONWARNINGS": "ignore"}


def run(
    args: list[str], *, cwd: Path, env: dict[str, str], timeout: float = 1800
) -> subprocess.CompletedProcess:
    """``python *args``; the launch and every rank it starts form one process group, all killed if
    it outlives ``timeout`` (a safety net for a hung rank on a loaded machine, not a timing check)."""
    r = process_group.finish(
        process_group.start([sys.executable, *args], cwd=cwd, env=env), timeout=timeout
    )
    assert r.returncode == 0, (
        f"{args} exited with {r.returncode}:\n{r.stdout[-4000:]}\n{r.stderr[-8000:]}"
    )
    assert "deepspeed was imported" not in r.stderr
    return r


def leave_process_group() -> None:
    """End a rank script: wait for every rank, then destroy the group. A gloo group left for the
    interpreter's exit can abort the process ("terminate called without an active exception": its
    threads are still joinable when their destructors run), which the plain DDP references hit at random."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
