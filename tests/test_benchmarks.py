"""Every benchmark's --quick run still works (it is a smoke test: no figure is asserted)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# (script, what its JSON must contain)
BENCHMARKS = [
    ("bench/adam.py", ("machine", "cases", "pieces", "overflow")),
]


@pytest.mark.parametrize("script,keys", BENCHMARKS, ids=[b[0] for b in BENCHMARKS])
def test_quick_run(script, keys, tmp_path):
    out = tmp_path / "result.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / script), "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(out.read_text())
    for key in keys:
        assert result[key], f"{script} wrote no {key!r}"
