"""The estimate of a LoRA run (infinity.estimate.lora) and the largest base that fits a budget
(infinity.estimate.largest).

Oracles: the engine's own stores for the same tiny Llama built for real under zero.Init, wrapped by
PEFT and initialised (each frozen key's bytes and home in the parameter store, each optimizer array
in the state store); PEFT's own count of trainable parameters; the published parameter counts of the
Llama checkpoints the family names; for the largest base, the rows' needs against the budget
compared directly (a fit is every need within its budget).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import infinity
from infinity.cli.main import main
from infinity.estimate import EstimateOptions, ZeroSetting, estimate_memory
from infinity.estimate.largest import LLAMA_FAMILY, Budget, LlamaShape, judge, scan_family
from infinity.estimate.lora import lora_footprint, with_lora
from infinity.memory import format_nbytes
from tests.hf.lora import lora
from tests.hf.models import build_under_init, config, ds_config

NF4 = {"quantized_initialization": {"num_bits": 4, "group_size": 32, "quant_type": "nf4"}}


def _quantised(cfg: dict) -> dict:
    cfg["zero_optimization"]["zero_quantized_nontrainable_weights"] = True
    cfg["weight_quantization"] = NF4
    return cfg


def _llama() -> torch.nn.Module:
    import transformers

    return transformers.LlamaForCausalLM(config("llama"))


@pytest.mark.parametrize("quantised", [False, True], ids=["fp32", "nf4"])
def test_the_lora_estimate_holds_what_the_engine_holds(quantised, nvme_dir):
    cfg = ds_config(nvme_dir)
    if quantised:
        cfg = _quantised(cfg)
    model = lora(build_under_init("llama", cfg))  # r 4, alpha 8, on q_proj and v_proj
    engine = infinity.initialize(model, cfg)
    try:
        rt = engine.runtime
        frozen = [u for u in rt.unit_map.units if not u.trainable]
        held: dict[str, int] = {}
        for u in frozen:
            spec = rt.param_store.spec(u.key)
            held[spec.home] = held.get(spec.home, 0) + spec.nbytes
        plan_at_rest = sum(rt.plan.at_rest_nbytes(u) for u in frozen)
        state: dict[str, int] = {}
        for key in rt.state_store.keys():
            spec = rt.state_store.spec(key)
            state[spec.home] = state.get(spec.home, 0) + spec.nbytes
        state_units = {i for i, _ in rt.state_store.keys()}
        trained_units = {u.index for u in rt.unit_map.units if u.trainable}
    finally:
        engine.close()

    with torch.device("meta"):
        meta = with_lora(_llama(), 4, ["q_proj", "v_proj"])
    trainable, total = meta.get_nb_trainable_parameters()  # PEFT's own count
    est = estimate_memory(
        meta,
        config=cfg,
        machine=False,
        settings=[ZeroSetting(3, "nvme", "nvme")],
    )
    fp = lora_footprint(est.focus.breakdown)
    assert dict(fp.frozen_at_rest) == held and fp.frozen_nbytes == plan_at_rest
    assert held.get("nvme"), "max_in_cpu 0: the frozen base rests on NVMe"
    assert state_units == trained_units, "optimizer state for the adapters only"
    assert {h: n for h, n in fp.optimizer_state if n} == state
    assert fp.trainable_params == trainable and fp.frozen_params == total - trainable
    if quantised:
        assert fp.frozen_format == "nf4, groups of 32"
        # packed as bitsandbytes packs NF4: 4-bit codes and an fp32 absmax per 32 weights of each
        # frozen matrix (vectors raw), each piece padded to its alignment; fp32 takes 4 B a weight
        frozen = [p for p in meta.parameters() if not p.requires_grad]
        least = sum(
            p.numel() // 2 + p.numel() // 32 * 4 if p.dim() == 2 else 4 * p.numel() for p in frozen
        )
        assert least <= fp.frozen_nbytes < 4 * fp.frozen_params
    else:
        assert fp.frozen_format == "float32"


def _write_llama_config(tmp_path) -> str:
    path = tmp_path / "config.json"
    path.write_text(config("llama").to_json_string())
    return str(path)


def _cli(capsys, *argv):
    code = main(["estimate", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_cli_counts_the_lora_run_from_the_same_plan(capsys, tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(_quantised(ds_config(tmp_path / "nvme"))))
    model_config = _write_llama_config(tmp_path)
    argv = ["--model-config", model_config, "--config", str(cfg), "--lora", "4"]
    code, out, err = _cli(capsys, *argv, "--lora-targets", "q_proj,v_proj", "--json")
    assert code == 0, err
    got = json.loads(out)["lora"]
    with torch.device("meta"):
        meta = _llama()
    est = estimate_memory(
        with_lora(meta, 4, ["q_proj", "v_proj"]),
        config=str(cfg),
        machine=False,
        settings=[ZeroSetting(3, "nvme", "nvme")],
    )
    want = dataclasses.asdict(lora_footprint(est.focus.breakdown))
    assert got == json.loads(json.dumps(want))
    code, out, _ = _cli(capsys, *argv)  # PEFT's default targets for Llama: q_proj, v_proj
    assert code == 0
    assert "frozen base  " in out and "nf4, groups of 32" in out and "on NVMe at rest" in out
    assert f"adapters     {got['trainable_params']:,} parameters" in out


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--params", "7B", "--lora", "16"], "--lora needs --model-config"),
        (["--lora", "0"], "rank must be a whole number >= 1"),
        (["--lora", "-2"], "rank must be a whole number >= 1"),
        (["--lora", "4", "--lora-targets", "nope_proj"], "q_proj, up_proj, v_proj"),
        (["--lora-targets", "q_proj"], "give --lora R too"),
        (["--lora", "4", "--inference"], "--inference has no adapters"),
        (["--lora", "4", "--host-memory", "4G"], "are --largest-base's"),
        (["--largest-base", "--params", "7B"], "leave out --params"),
    ],
)
def test_bad_lora_arguments_are_refused_by_name(argv, words, capsys, tmp_path):
    if "--params" not in argv:
        argv = ["--model-config", _write_llama_config(tmp_path), *argv]
    code, _, err = _cli(capsys, *argv)
    assert code == 2 and words in err, err


def test_the_family_is_the_published_checkpoints():
    published = {  # their model cards' and safetensors indexes' parameter counts
        "1.1B": 1_100_048_384,
        "3B": 3_426_473_600,
        "7B": 6_738_415_616,
        "13B": 13_015_864_320,
        "33B": 32_528_943_616,
        "70B": 68_976_648_192,
    }
    counts = {s.name: sum(p.numel() for p in s.build().parameters()) for s in LLAMA_FAMILY}
    assert counts == published


TINY = (  # three tiny Llamas, shuffled: the scan sorts them by size
    LlamaShape("tiny-b", 64, 3, 128, 4, 4, vocab_size=256),
    LlamaShape("tiny-a", 32, 2, 64, 2, 1, vocab_size=256),
    LlamaShape("tiny-c", 96, 4, 192, 4, 2, vocab_size=256),
)


@pytest.fixture(scope="module")
def tiny_scan(tmp_path_factory):
    nvme = tmp_path_factory.mktemp("nvme")
    return scan_family(
        TINY,
        lora_rank=4,
        lora_targets=["q_proj", "v_proj"],
        options=EstimateOptions(nvme_path=str(nvme), baseline_nbytes=0, device="cpu"),
    )


def _oracle(scan, host: int, nvme: int) -> str | None:
    """The largest shape one of whose breakdowns needs at most ``host`` RAM and ``nvme`` space."""
    fitting = [
        s.shape.name
        for s in scan
        if any(
            b.ram_nbytes <= host and b.nvme_nbytes <= nvme and not b.problems for b in s.breakdowns
        )
    ]
    return fitting[-1] if fitting else None


def test_the_scan_is_smallest_first_with_needs_that_grow(tiny_scan):
    assert [s.shape.name for s in tiny_scan] == ["tiny-a", "tiny-b", "tiny-c"]
    rows = judge(tiny_scan, Budget(1 << 40, 1 << 40)).rows
    assert all(r.fits for r in rows)
    assert [r.num_params for r in rows] == sorted(r.num_params for r in rows)
    assert [r.nvme_nbytes for r in rows] == sorted(r.nvme_nbytes for r in rows)


@settings(max_examples=40, deadline=None)
@given(
    host=st.integers(1, 1 << 31),
    nvme=st.integers(1, 1 << 26),
    more_host=st.integers(0, 1 << 31),
    more_nvme=st.integers(0, 1 << 26),
)
def test_a_larger_budget_never_names_a_smaller_base(tiny_scan, host, nvme, more_host, more_nvme):
    small = judge(tiny_scan, Budget(host, nvme))
    large = judge(tiny_scan, Budget(host + more_host, nvme + more_nvme))
    names = [s.shape.name for s in tiny_scan]
    for answer, h, n in ((small, host, nvme), (large, host + more_host, nvme + more_nvme)):
        best = answer.largest
        assert (best.shape.name if best else None) == _oracle(tiny_scan, h, n)
    if small.largest is not None:
        assert large.largest is not None
        assert names.index(large.largest.shape.name) >= names.index(small.largest.shape.name)


def test_below_the_smallest_need_none_fits_and_the_table_says_why(tiny_scan):
    smallest = judge(tiny_scan, Budget(1 << 40, 1 << 40)).rows[0]
    answer = judge(tiny_scan, Budget(smallest.host_nbytes - 1, 1 << 40))
    assert answer.largest is None and not any(r.fits for r in answer.rows)
    table = answer.table()
    assert "none fits: the smallest, tiny-a, host memory" in table
    assert f"needs {format_nbytes(smallest.host_nbytes)}" in table


def test_the_cli_names_the_largest_base_within_its_budget(capsys, tmp_path, monkeypatch, tiny_scan):
    import infinity.cli.estimate as cli
    import infinity.estimate.largest as largest

    monkeypatch.setattr(cli, "LLAMA_FAMILY", TINY)  # the real family takes a minute to trace
    monkeypatch.setattr(largest, "runtime_baseline_nbytes", lambda: 0)  # as tiny_scan's
    rows = judge(tiny_scan, Budget(1 << 40, 1 << 40)).rows
    between = (rows[1].host_nbytes + rows[2].host_nbytes) // 2
    argv = ["--largest-base", "--lora", "4", "--lora-targets", "q_proj,v_proj", "--device", "cpu"]
    argv += ["--nvme-path", str(tmp_path), "--nvme-space", "1T", "--host-memory", str(between)]
    code, out, err = _cli(capsys, *argv, "--json")
    assert code == 0, err
    got = json.loads(out)
    assert got["largest"] == "tiny-b" and got["budget"]["host_nbytes"] == between
    assert [r["fits"] for r in got["rows"]] == [True, True, False]
    code, out, _ = _cli(capsys, *argv)
    assert code == 0 and "largest that fits: tiny-b" in out and "activations not counted" in out
