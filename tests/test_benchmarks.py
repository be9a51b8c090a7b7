"""Every bench/*.py runs in --quick mode, so no benchmark can rot (KvikIO's test_benchmarks.py).

Each runs in a fresh interpreter with the on-disk test directory as its working directory (so its
default ./infinity_nvme is on a disk, not tmpfs) and INFINITY_BENCH_RESULTS pointing at a
temporary directory, so that smoke runs never overwrite the results checked in under bench/results.
Nothing asserts on a figure: CI does not fail on a number.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if not p.name.startswith("_"))  # _*.py: helpers


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_quick_run(script, nvme_dir, tmp_path):
    env = {**os.environ, "INFINITY_BENCH_RESULTS": str(tmp_path)}
    r = subprocess.run(
        [sys.executable, str(script), "--quick"],
        cwd=nvme_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    written = list(tmp_path.glob("*.json"))
    assert written, f"{script.name} --quick wrote no JSON under INFINITY_BENCH_RESULTS"
