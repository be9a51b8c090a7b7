"""The estimate against the OS: train in a subprocess, measure peak RSS and swap-file bytes, compare.

Each case trains a GPT for a few steps through infinity.initialize in a fresh
process (tests/estimate/probe.py), which reports its baseline (measured after
importing torch and infinity, before building the model), its peak host
memory (VmHWM plus hugetlb pages) and the bytes its swap files occupy on disk.
The estimate for the same model and config, given that baseline, must be at
least the measurement and at most 15% above it. Three model sizes, four
settings; the runs go two at a time. transformers models (GPT-2, Llama), with
and without activation checkpointing, are held to at most 40% above.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from infinity.estimate import ZeroSetting, estimate_memory
from infinity.models import GPTConfig

PROBE = Path(__file__).with_name("probe.py")
ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20
TOLERANCE = 0.15

SIZES = {
    "13M": dict(vocab_size=256, seq_len=256, n_layer=4, n_head=8, d_model=512),
    "25M": dict(vocab_size=256, seq_len=64, n_layer=8, n_head=8, d_model=512),
    "57M": dict(vocab_size=256, seq_len=64, n_layer=8, n_head=12, d_model=768),
    "110M": dict(vocab_size=256, seq_len=128, n_layer=12, n_head=12, d_model=864),
}


def _config(stage, p="none", o="none", *, dtype="fp32", micro_batch=1, nvme="", **zero):
    z = {"stage": stage, **zero}
    if p != "none":
        z["offload_param"] = {"device": p, "nvme_path": nvme}
        if p == "nvme":
            z["offload_param"].update(max_in_cpu=0, buffer_count=4, buffer_size=2_000_000)
    if o != "none":
        z["offload_optimizer"] = {"device": o, "nvme_path": nvme}
    cfg = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": z,
    }
    if dtype != "fp32":
        cfg[dtype] = {"enabled": True}
    return cfg


# name: (model size, micro-batch, seq, config arguments)
CASES = {
    "13M-stage2-bf16-activations": ("13M", 4, 256, dict(stage=2, o="cpu", dtype="bf16")),
    "25M-stage3-bf16-nvme-nvme": (
        "25M",
        1,
        64,
        dict(stage=3, p="nvme", o="nvme", dtype="bf16", sub_group_size=1_000_000),
    ),
    "25M-stage1-fp32-optimizer-nvme": (
        "25M",
        1,
        64,
        dict(stage=1, o="nvme", sub_group_size=2_000_000),
    ),
    "57M-stage0-fp32": ("57M", 2, 64, dict(stage=0)),
}
# Steps per probe (the optimizer's state appears in the first; the heap keeps growing a little after).
STEPS = 3
# bf16 matmuls on a CPU without native bf16 take about a minute a step on one core; this case's
# peak after two steps was within 1% of its peak after three (VmHWM 673 and 677 MB, the estimate
# 8% above both), so two steps show the same.
STEPS_OF = {"13M-stage2-bf16-activations": 2}
SLOW_CASES = {
    "110M-stage3-fp32-cpu-cpu": ("110M", 2, 128, dict(stage=3, p="cpu", o="cpu")),
}
# Built under zero.Init: the heap's keeping of what construction freed is measured, not mirrored,
# and the estimate is conservative there (1.1-1.3 × for these sizes): never below is what is
# asserted for host memory; the swap files (zero.Init's own, during initialize) must match.
ZERO_INIT_CASES = {
    "25M-zero.Init-stage3-bf16-nvme-nvme": (
        "25M",
        1,
        64,
        dict(stage=3, p="nvme", o="nvme", dtype="bf16", sub_group_size=1_000_000),
    ),
    "110M-zero.Init-stage3-fp32-cpu-cpu": ("110M", 1, 64, dict(stage=3, p="cpu", o="cpu")),
}


def _probe(spec: dict) -> dict:
    """What tests/estimate/probe.py measured training ``spec`` in a fresh process."""
    r = subprocess.run(
        [sys.executable, str(PROBE), json.dumps(spec)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _run(
    case: tuple, nvme: Path, *, zero_init: bool = False, steps: int = STEPS
) -> tuple[dict, dict]:
    size, mb, seq, kw = case
    kw = dict(kw)
    stage = kw.pop("stage")
    cfg = _config(
        stage,
        kw.pop("p", "none"),
        kw.pop("o", "none"),
        dtype=kw.pop("dtype", "fp32"),
        micro_batch=mb,
        nvme=str(nvme),
        **kw,
    )
    spec = {
        "model": SIZES[size],
        "config": cfg,
        "micro_batch": mb,
        "seq": seq,
        "steps": steps,
        "nvme_path": str(nvme),
        "zero_init": zero_init,
    }
    return cfg, _probe(spec)


def _estimate(case: tuple, cfg: dict, measured: dict, *, zero_init: bool = False):
    size, mb, seq, _ = case
    z = cfg["zero_optimization"]
    setting = ZeroSetting(
        z["stage"],
        z.get("offload_param", {}).get("device", "none"),
        z.get("offload_optimizer", {}).get("device", "none"),
    )
    est = estimate_memory(
        GPTConfig(**SIZES[size]),
        config=cfg,
        micro_batch=mb,
        seq=seq,
        device="cpu",
        zero_init=zero_init,
        baseline_nbytes=measured["baseline"],
        machine=False,
        settings=[setting],
    )
    return est.settings[0].breakdown


def _check(name: str, case: tuple, cfg: dict, m: dict, *, zero_init: bool = False) -> None:
    plan = _estimate(case, cfg, m, zero_init=zero_init)
    ram, peak = plan.ram_nbytes, m["peak"]
    line = (
        f"{name}: {m['num_params'] / 1e6:.1f}M params, peak RSS {peak / MiB:.1f} MiB, estimate "
        f"{ram / MiB:.1f} MiB ({ram / peak:.3f}); swap {m['swap'] / MiB:.1f} MiB, estimate "
        f"{plan.nvme_nbytes / MiB:.1f} MiB"
    )
    print(line)
    assert ram >= peak, "estimate below the measured peak RSS: " + line
    assert zero_init or ram <= (1 + TOLERANCE) * peak, (
        "estimate more than 15% above the measured peak RSS: " + line
    )
    assert plan.nvme_nbytes >= m["swap"], "estimate below the swap-file bytes: " + line
    assert plan.nvme_nbytes <= (1 + TOLERANCE) * m["swap"], (
        "estimate more than 15% above the swap files: " + line
    )
    assert all(x == x and x < 10 for x in m["losses"]), f"training diverged: {m['losses']}"
    # The estimate counts zero.Init's pool (64 MiB, touched) until initialize only; a pool kept
    # through training (a reference cycle did, until the next cyclic gc) is memory it does not know.
    assert not m.get("init_pool_alive"), "zero.Init's pool outlived initialize(): " + line


@pytest.mark.parametrize("name", list(CASES))
def test_estimate_holds_the_measured_peak_within_15_percent(name, probes):
    cfg, m = probes.result(test_estimate_holds_the_measured_peak_within_15_percent, name)
    _check(name, CASES[name], cfg, m)


def test_cases_span_three_model_sizes_and_nvme():
    assert len({c[0] for c in CASES.values()}) >= 3
    assert any("nvme" in name for name in CASES)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW_CASES))
def test_estimate_holds_for_a_larger_model(name, probes):
    cfg, m = probes.result(test_estimate_holds_for_a_larger_model, name)
    _check(name, SLOW_CASES[name], cfg, m)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ZERO_INIT_CASES))
def test_estimate_holds_a_model_built_under_zero_init(name, probes):
    cfg, m = probes.result(test_estimate_holds_a_model_built_under_zero_init, name)
    _check(name, ZERO_INIT_CASES[name], cfg, m, zero_init=True)


# transformers models: the activations counted in one forward on fake tensors (traced.py), as the model
# checkpoints. The CPU heap's keeping of freed intermediates varies more with the architecture than
# infinity GPT's ([Note: the CPU heap's margin]): never below is asserted, and at most 40% above, as
# the margin that covers the 8-layer GPT-2's heap leaves the 4-layer one's lowest peaks ~32% under it.
HF_MODELS = {
    "gpt2": (
        "gpt2",
        dict(
            n_layer=4,
            n_embd=512,
            n_head=8,
            vocab_size=256,
            n_positions=256,
            bos_token_id=0,
            eos_token_id=0,
        ),
    ),
    "gpt2-deep": (
        "gpt2",
        dict(
            n_layer=8,
            n_embd=256,
            n_head=4,
            vocab_size=1024,
            n_positions=512,
            bos_token_id=0,
            eos_token_id=0,
        ),
    ),
    "llama": (
        "llama",
        dict(
            num_hidden_layers=4,
            hidden_size=512,
            intermediate_size=1376,
            num_attention_heads=8,
            num_key_value_heads=8,
            vocab_size=256,
            max_position_embeddings=512,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        ),
    ),
}
HF_TOLERANCE = 0.40
HF_BATCH = (4, 256)  # micro-batch, tokens
# name: (model, checkpointing, dtype); micro-batch 4 × 256 tokens, stage 2 with the optimizer on the CPU
HF_CASES = {
    "gpt2-fp32": ("gpt2", None, "fp32"),
    "gpt2-fp32-non_reentrant": ("gpt2", "non_reentrant", "fp32"),
    "gpt2-bf16-non_reentrant": ("gpt2", "non_reentrant", "bf16"),
    "gpt2-deep-fp32": ("gpt2-deep", None, "fp32"),
    "gpt2-deep-fp32-reentrant": ("gpt2-deep", "reentrant", "fp32"),
    "llama-fp32": ("llama", None, "fp32"),
    "llama-fp32-reentrant": ("llama", "reentrant", "fp32"),
}


def _hf(name: str) -> dict:
    model, checkpointing, _ = HF_CASES[name]
    arch, config = HF_MODELS[model]
    return {"arch": arch, "config": config, "checkpointing": checkpointing}


def _run_hf(name: str, nvme: Path) -> tuple[dict, dict]:
    mb, seq = HF_BATCH
    cfg = _config(2, o="cpu", dtype=HF_CASES[name][2], micro_batch=mb, nvme=str(nvme))
    return cfg, _probe(
        {"hf": _hf(name), "config": cfg, "micro_batch": mb, "seq": seq, "steps": STEPS}
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", list(HF_CASES))
def test_estimate_holds_a_transformers_model(name, probes):
    pytest.importorskip("transformers")
    from tests.estimate.probe import build_hf

    checkpointing = HF_CASES[name][1]
    mb, seq = HF_BATCH
    cfg, m = probes.result(test_estimate_holds_a_transformers_model, name)
    est = estimate_memory(
        build_hf(_hf(name)),
        config=cfg,
        micro_batch=mb,
        seq=seq,
        device="cpu",
        baseline_nbytes=m["baseline"],
        machine=False,
        settings=[ZeroSetting(2, "none", "cpu")],
    )
    assert est.checkpointing == (checkpointing is not None)
    assert "counted in one forward" in est.activations.source
    ram, peak = est.settings[0].breakdown.ram_nbytes, m["peak"]
    line = f"{name}: peak RSS {peak / MiB:.1f} MiB, estimate {ram / MiB:.1f} MiB ({ram / peak:.3f})"
    print(line)
    assert ram >= peak, "estimate below the measured peak RSS: " + line
    assert ram <= (1 + HF_TOLERANCE) * peak, (
        f"estimate more than {HF_TOLERANCE:.0%} above the measured peak RSS: " + line
    )
    assert all(x == x and x < 10 for x in m["losses"]), f"training diverged: {m['losses']}"


# LoRA over a frozen base streamed from NVMe (stage 3, parameters and optimizer on NVMe), the base at
# rest in NF4 or unquantised, checkpointed: what the frozen units take in backward is the sizing
# model's frozen_buffers_nbytes ([Note: frozen units in backward]). Held to 15% (measured: 1.03 for
# NF4, 1.02 unquantised).
LORA = {"r": 8, "targets": ["q_proj", "k_proj", "v_proj", "o_proj"]}
LORA_BATCH = (1, 256)
LORA_CASES = {"llama-lora-nf4-non_reentrant": "nf4", "llama-lora-fp32-non_reentrant": None}


def _lora_spec() -> dict:
    arch, config = HF_MODELS["llama"]
    return {"arch": arch, "config": config, "checkpointing": "non_reentrant", "lora": LORA}


def _run_lora(name: str, nvme: Path) -> tuple[dict, dict]:
    mb, seq = LORA_BATCH
    cfg = _config(3, "nvme", "nvme", micro_batch=mb, nvme=str(nvme), sub_group_size=1_000_000)
    if LORA_CASES[name] == "nf4":
        cfg["zero_optimization"]["zero_quantized_nontrainable_weights"] = True
        cfg["weight_quantization"] = {
            "quantized_initialization": {"num_bits": 4, "group_size": 32, "quant_type": "nf4"}
        }
    return cfg, _probe(
        {
            "hf": _lora_spec(),
            "config": cfg,
            "micro_batch": mb,
            "seq": seq,
            "steps": STEPS,
            "nvme_path": str(nvme),
        }
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LORA_CASES))
def test_estimate_holds_a_lora_run_over_a_frozen_base_on_nvme(name, probes):
    pytest.importorskip("peft")
    from tests.estimate.probe import build_hf

    mb, seq = LORA_BATCH
    cfg, m = probes.result(test_estimate_holds_a_lora_run_over_a_frozen_base_on_nvme, name)
    est = estimate_memory(
        build_hf(_lora_spec()),
        config=cfg,
        micro_batch=mb,
        seq=seq,
        device="cpu",
        baseline_nbytes=m["baseline"],
        machine=False,
        settings=[ZeroSetting(3, "nvme", "nvme")],
    )
    ram, peak = est.settings[0].breakdown.ram_nbytes, m["peak"]
    line = f"{name}: peak RSS {peak / MiB:.1f} MiB, estimate {ram / MiB:.1f} MiB ({ram / peak:.3f})"
    print(line)
    assert ram >= peak, "estimate below the measured peak RSS: " + line
    assert ram <= (1 + TOLERANCE) * peak, (
        f"estimate more than {TOLERANCE:.0%} above the measured peak RSS: " + line
    )
    assert all(x == x and x < 10 for x in m["losses"]), f"training diverged: {m['losses']}"


# Each test's probe run: (config, measurement) from its case's name and a swap directory.
RUNS = {
    test_estimate_holds_the_measured_peak_within_15_percent: lambda name, d: _run(
        CASES[name], d, steps=STEPS_OF.get(name, STEPS)
    ),
    test_estimate_holds_for_a_larger_model: lambda name, d: _run(SLOW_CASES[name], d),
    test_estimate_holds_a_model_built_under_zero_init: lambda name, d: _run(
        ZERO_INIT_CASES[name], d, zero_init=True
    ),
    test_estimate_holds_a_transformers_model: _run_hf,
    test_estimate_holds_a_lora_run_over_a_frozen_base_on_nvme: _run_lora,
}
# The probes that take longest start first (bf16 matmuls are slow on CPUs without native bf16), so
# the other worker gets through the rest meanwhile.
FIRST = ("gpt2-bf16-non_reentrant", "13M-stage2-bf16-activations", "25M-stage3-bf16-nvme-nvme")


class Probes:
    """Every probe this session's selected tests of this module need, started at once two at a
    time (each probe trains on one thread; each measures its own process, so two side by side do
    not disturb each other's figures). A test waits for its own run; one run's failure fails only
    the test that reads it."""

    def __init__(self, jobs: list[tuple], root: Path):
        self.pool = concurrent.futures.ThreadPoolExecutor(2)
        self.futures = {}
        jobs = sorted(jobs, key=lambda j: FIRST.index(j[1]) if j[1] in FIRST else len(FIRST))
        for test, name in jobs:
            d = root / f"{test.__name__}-{name}"
            d.mkdir(parents=True, exist_ok=True)
            self.futures[test.__name__, name] = self.pool.submit(RUNS[test], name, d)

    def result(self, test, name: str) -> tuple[dict, dict]:
        return self.futures[test.__name__, name].result()


@pytest.fixture(scope="module")
def probes(request):
    root = Path(os.environ.get("INFINITY_TEST_NVME", Path.home() / ".cache" / "infinity-tests"))
    root = root / f"reality-{os.getpid()}"
    tests = {t.__name__: t for t in RUNS}
    jobs = [
        (tests[item.originalname], item.callspec.params["name"])
        for item in request.session.items
        if item.module is request.module and item.originalname in tests
    ]
    if importlib.util.find_spec("transformers") is None:
        jobs = [j for j in jobs if j[0] is not test_estimate_holds_a_transformers_model]
    probes = Probes(jobs, root)
    try:
        yield probes
    finally:
        probes.pool.shutdown(cancel_futures=True)
        shutil.rmtree(root, ignore_errors=True)
