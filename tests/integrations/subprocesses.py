"""Running a script the way a user does (a fresh interpreter), with deepspeed made unimportable."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def without_deepspeed(tmp_path: Path) -> dict[str, str]:
    """The environment for a child process in which ``import deepspeed`` raises ImportError (a package
    of that name first on the path that refuses to load); the repository root is importable too."""
    blocker = tmp_path / "no_deepspeed" / "deepspeed"
    blocker.mkdir(parents=True, exist_ok=True)
    (blocker / "__init__.py").write_text(
        'raise ImportError("deepspeed was imported; infinity\'s Lightning and Fabric paths must not need it")\n')
    path = [str(blocker.parent), str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONWARNINGS": "ignore"}


def run(args: list[str], *, cwd: Path, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{args} exited with {r.returncode}:\n{r.stdout[-4000:]}\n{r.stderr[-8000:]}"
    assert "deepspeed was imported" not in r.stderr
    return r
