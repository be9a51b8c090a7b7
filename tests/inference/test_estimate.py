"""estimate_inference and ``infinity estimate --inference`` (issue 15): no gradient or optimizer item, the
swap files the engine writes, the KV cache Hugging Face allocates, the largest batch that fits.

Oracles: the engine's swap files on disk (st_blocks), the tensors of the cache ``generate`` returns, and
check_fit on a machine view whose memory is set between two batches' plans.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

import infinity
from infinity.cli.main import main
from infinity.inference import GenerationSize, InferenceOptions, estimate_inference
from tests.inference.models import PAD, inference_config, pair, prompts

TRAINING_WORDS = ("optimizer", "Adam", "master", "gradient")


def _disk_nbytes(d) -> int:
    return sum(f.stat().st_blocks * 512 for f in d.rglob("*") if f.is_file())


@pytest.mark.parametrize("bits", [None, 8, "nf4-dq"])
def test_the_estimate_has_no_training_state_and_the_engines_swap_files(bits, nvme_dir):
    """Also NF4 with double quantisation: the swap files hold the nested scales' format as sized."""
    model, _ = pair("llama")
    cfg = inference_config(nvme_dir)
    if bits:
        quant = {"num_bits": 8 if bits == 8 else 4, "group_size": 64}
        if bits == "nf4-dq":
            quant.update(quant_type="nf4", double_quant=True)
        cfg["weight_quantization"] = {"quantized_initialization": quant}
        cfg["zero_optimization"]["offload_param"]["buffer_size"] = 9216
    est = estimate_inference(model, config=cfg, batch=2, prompt=7, gen=8, machine=False)
    assert not [i for i in est.breakdown.items if any(w in i.name for w in TRAINING_WORDS)]
    assert est.breakdown.runtime.optimizer is None
    engine = infinity.initialize(model, cfg)
    try:
        (param_dir,) = sorted((nvme_dir / "rank0").glob("infinity-params-*"))
        on_disk = _disk_nbytes(param_dir)
        assert on_disk <= est.breakdown.nvme_nbytes <= 1.15 * on_disk
    finally:
        engine.close()


@pytest.mark.parametrize("double_quant", [False, True])
def test_quantised_shards_kept_in_host_memory_are_counted_at_their_packed_size(
    double_quant, nvme_dir
):
    """offload_param.max_in_cpu keeps every shard in host memory: the estimate's item is the bytes the
    engine's parameter store registers for them (packed NF4, with double quantisation fewer)."""
    model, _ = pair("llama")
    cfg = inference_config(nvme_dir)
    cfg["zero_optimization"]["offload_param"]["max_in_cpu"] = 10**9
    quant = {"num_bits": 4, "group_size": 64, "quant_type": "nf4", "double_quant": double_quant}
    cfg["weight_quantization"] = {"quantized_initialization": quant}
    est = estimate_inference(model, config=cfg, batch=1, prompt=7, gen=2, machine=False)
    (item,) = [i for i in est.breakdown.items if i.name.startswith("parameter shards in host")]
    assert ("nf4+dq" if double_quant else "nf4,") in item.name
    engine = infinity.initialize(model, cfg)
    try:
        store = engine.runtime.param_store
        held = sum(store.spec(u.key).nbytes for u in engine.runtime.unit_map.units)
    finally:
        engine.close()
    assert item.nbytes == held


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_the_kv_cache_item_holds_the_cache_generate_makes(name):
    model, _ = pair(name)
    batch, prompt, gen = 3, 7, 8
    ids, mask = prompts(batch, padded=True)
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=gen,
        do_sample=False,
        pad_token_id=PAD,
        return_dict_in_generate=True,
    )
    cache = out.past_key_values
    actual = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    est = estimate_inference(model, batch=batch, prompt=prompt, gen=gen, machine=False)
    (kv,) = [i.nbytes for i in est.breakdown.items if i.name == "KV cache"]
    # the cache holds every position but the last token's (generate never feeds it back)
    assert actual == kv * (prompt + gen - 1) // (prompt + gen)


def test_the_largest_batch_is_the_last_that_fits(tmp_path):
    # A fixed baseline: by default each call reads this process's RSS, which moves between calls
    # (a suite's garbage being freed) and so moved the boundary (CI found 146, not 40).
    fixed = {"prompt": 128, "gen": 16, "nvme_path": str(tmp_path), "baseline_nbytes": 1 << 30}
    probe = estimate_inference(150e6, batch=1, **fixed)
    small = estimate_inference(150e6, batch=40, machine=False, **fixed)
    big = estimate_inference(150e6, batch=41, machine=False, **fixed)
    assert big.breakdown.ram_nbytes > small.breakdown.ram_nbytes
    # a machine with room for batch 40's plan and not batch 41's
    room = (small.breakdown.ram_nbytes + big.breakdown.ram_nbytes) // 2
    view = dataclasses.replace(
        probe.machine,
        mem_total_nbytes=room,
        mem_available_nbytes=room,
        hugetlb_free_nbytes=0,
        self_rss_nbytes=0,
    )
    est = estimate_inference(150e6, batch=8, machine=view, **fixed)
    assert est.fit.ok and est.largest_batch == 40


def test_the_cli_prints_the_plan_and_the_largest_batch(capsys, tmp_path):
    code = main(
        [
            "estimate",
            "--inference",
            "--params",
            "150M",
            "--batch",
            "8",
            "--prompt",
            "128",
            "--gen",
            "16",
            "--nvme-path",
            str(tmp_path),
            "--device",
            "cpu",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "batch 8 × (prompt 128 + 16 new tokens)" in out and "KV cache" in out
    assert "largest batch that fits:" in out
    assert not any(w in out for w in TRAINING_WORDS)
    code = main(
        ["estimate", "--inference", "--params", "150M", "--nvme-path", str(tmp_path), "--json"]
    )
    d = json.loads(capsys.readouterr().out)
    assert code == 0 and d["batch"] == 1 and d["prompt"] == 128 and d["gen"] == 16
    assert d["largest_batch"] >= 1
    # streamed: only the small persistent parameters stay in host memory (not DeepSpeed's max_in_cpu 1e9)
    in_host = sum(
        i["nbytes"] for i in d["items"] if i["name"].startswith("parameter shards in host memory")
    )
    assert in_host < 0.01 * 2 * d["num_params"]


def test_the_cli_refuses_trainings_arguments_with_inference(capsys, tmp_path):
    code = main(
        [
            "estimate",
            "--inference",
            "--params",
            "150M",
            "--seq",
            "2048",
            "--nvme-path",
            str(tmp_path),
        ]
    )
    assert code == 2 and "--inference takes --batch, --prompt and --gen" in capsys.readouterr().err


def test_options_are_the_keywords_in_one_object_and_bad_ones_are_refused(tmp_path):
    # the baseline fixed: measured, it is this process's RSS at each call
    fixed = dict(nvme_path=str(tmp_path), machine=False, baseline_nbytes=1 << 28)
    kw = dict(batch=3, prompt=16, gen=4, **fixed)
    by_keywords = estimate_inference(20e6, **kw)
    options = InferenceOptions(size=GenerationSize(batch=3, prompt=16, gen=4), **fixed)
    assert estimate_inference(20e6, options) == by_keywords
    assert InferenceOptions.from_keywords(**kw) == options
    with pytest.raises(TypeError, match="an InferenceOptions or keywords, not both"):
        estimate_inference(20e6, options, batch=2)
    with pytest.raises(TypeError, match="unknown keyword.*micro_batch.*it takes batch, prompt"):
        estimate_inference(20e6, micro_batch=2)
    with pytest.raises(ValueError, match="prompt must be >= 1; got 0"):
        GenerationSize(prompt=0)
