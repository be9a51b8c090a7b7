"""Every bench script still runs: its --quick mode, as CI does (figures are never asserted)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# (script, extra arguments); each writes JSON to --out.
BENCHES = [
    ("store.py", ["--dir", "{nvme_dir}"]),
]


@pytest.mark.parametrize("script,args", BENCHES, ids=[b[0] for b in BENCHES])
def test_bench_quick(script, args, nvme_dir, tmp_path):
    out = tmp_path / "result.json"
    argv = [a.format(nvme_dir=nvme_dir) for a in args]
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), "--quick", "--out", str(out), *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    record = json.loads(out.read_text())
    assert record["mode"] == "quick" and record["versions"] and record["machine"]
