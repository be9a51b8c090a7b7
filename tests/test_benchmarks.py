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


def _bench_module(name: str):
    import importlib

    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    from transformers import LlamaConfig

    d = tmp_path_factory.mktemp("tiny-llama")
    LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    ).save_pretrained(d)
    return d


def test_inference_bench_largest_batch_is_the_last_that_fits(tiny_llama_dir, tmp_path):
    bench = _bench_module("inference")
    common = {
        "base": str(tmp_path),
        "buffer_count": 4,
        "buffer_size": 1 << 17,
        "prompt": 64,
        "new": 8,
    }
    _, small = bench.largest_batch(tiny_llama_dir, common, 1 << 40, 1)
    assert small["capped"] and small["generation_nbytes"] < small["next_batch_nbytes"]
    limit = (
        small["generation_nbytes"]
        + 3 * (small["next_batch_nbytes"] - small["generation_nbytes"])
        + 1
    )
    n, info = bench.largest_batch(tiny_llama_dir, common, limit, 256)
    assert 1 <= n < 256 and not info["capped"]
    assert (
        info["generation_nbytes"] <= limit < info["next_batch_nbytes"]
    )  # fits, and one more would not


def test_inference_bench_refuses_a_limit_nothing_fits(tiny_llama_dir, tmp_path):
    bench = _bench_module("inference")
    common = {
        "base": str(tmp_path),
        "buffer_count": 4,
        "buffer_size": 1 << 17,
        "prompt": 64,
        "new": 8,
    }
    with pytest.raises(
        SystemExit,
        match=r"--batches max: not even batch 1 fits the 0\.00 GiB limit by the estimate",
    ):
        bench.largest_batch(tiny_llama_dir, common, 1 << 20, 8)
