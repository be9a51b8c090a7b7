"""``infinity estimate``: arguments, table, JSON, model and DeepSpeed config files, errors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from infinity.cli.estimate import parse_count
from infinity.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def _run(capsys, *argv):
    code = main(["estimate", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    "text, n", [("13e9", 13e9), ("13B", 13e9), ("150M", 150e6), ("1.5e9", 1.5e9), ("7k", 7e3)]
)
def test_parameter_counts_read_as_people_write_them(text, n):
    assert parse_count(text) == n


def test_json_has_every_setting_and_the_machine(capsys, tmp_path):
    code, out, _ = _run(capsys, "--params", "150M", "--nvme-path", str(tmp_path), "--json")
    assert code == 0
    d = json.loads(out)
    assert abs(d["num_params"] - 150e6) / 150e6 < 0.05
    assert len(d["settings"]) >= 16 and all(s["items"] for s in d["settings"])
    assert d["machine"]["mem_total_nbytes"] > 0
    assert d["recommendation"]


def test_several_nvme_paths_get_their_bytes_each(capsys, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    code, out, _ = _run(capsys, "--params", "150M", "--nvme-path", str(a), str(b), "--json")
    assert code == 0
    nn = next(
        s
        for s in json.loads(out)["settings"]
        if (s["stage"], s["offload_param"], s["offload_optimizer"]) == (3, "nvme", "nvme")
    )
    assert list(nn["nvme_by_path"]) == [str(a), str(b)]
    assert nn["nvme_by_path"][str(a)] == nn["nvme_by_path"][str(b)] == nn["nvme_nbytes"] // 2
    code, out, _ = _run(capsys, "--params", "150M", "--nvme-path", str(a), str(b))
    assert (
        code == 0
        and f"nvme_path    {b}: " in out
        and f"the file system of {a}: free space and bandwidth shared" in out
    )


def test_table_with_activations_and_a_model_config(capsys, tmp_path):
    cfg = tmp_path / "gpt.json"
    cfg.write_text(
        json.dumps(
            {"n_layer": 12, "d_model": 768, "n_head": 12, "vocab_size": 50257, "seq_len": 1024}
        )
    )
    code, out, _ = _run(capsys, "--model-config", str(cfg), "--micro-batch", "2", "--seq", "1024")
    assert code == 0
    assert "GPT (model config)" in out and "activations micro-batch 2 × seq 1024" in out
    assert "stage 3, params nvme, optimizer nvme" in out


MODEL_CONFIGS = Path(__file__).resolve().parent / "model_configs"


@pytest.mark.parametrize(
    "name, published",
    [
        ("llama-2-7b", 6_738_415_616),
        ("llama-2-70b", 68_976_648_192),
        ("mixtral-8x7b", 46_702_792_704),
        ("t5-base", None),
    ],
)
def test_a_hugging_face_config_is_counted_as_from_config_builds_it(capsys, name, published):
    """The real model, built on the meta device by transformers' from_config (here: the auto class for
    the architecture the config names), counted exactly; the published counts where they are known."""
    transformers = pytest.importorskip("transformers")
    path = MODEL_CONFIGS / f"{name}.json"
    config = transformers.AutoConfig.from_pretrained(str(path))
    auto = (
        transformers.AutoModelForSeq2SeqLM
        if config.is_encoder_decoder
        else transformers.AutoModelForCausalLM
    )
    with torch.device("meta"):
        model = auto.from_config(config)
    built = sum(p.numel() for p in model.parameters())
    code, out, _ = _run(capsys, "--model-config", str(path), "--json", "--device", "cpu")
    assert code == 0
    d = json.loads(out)
    assert d["num_params"] == built and d["model"].startswith(config.architectures[0])
    assert published is None or built == published


def test_a_config_json_that_is_neither_hugging_faces_nor_gpts_is_refused(capsys, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(
        json.dumps(
            {"n_embd": 256, "n_layer": 2, "n_head": 4, "n_positions": 128, "vocab_size": 512}
        )
    )
    code, _, err = _run(capsys, "--model-config", str(cfg))
    assert code == 2 and 'no "model_type"' in err and "unknown keys n_embd, n_positions" in err
    cfg.write_text(json.dumps({"model_type": "no-such-architecture", "hidden_size": 8}))
    code, _, err = _run(capsys, "--model-config", str(cfg))
    assert code == 2 and "transformers cannot read it" in err


def test_a_deepspeed_config_is_marked_as_the_configs_own(capsys, tmp_path):
    ds = tmp_path / "ds.json"
    text = """{
      // DeepSpeed reads hjson: comments and trailing commas
      "bf16": {"enabled": true},
      "zero_optimization": {"stage": 3,
        "offload_param": {"device": "nvme", "nvme_path": "PATH", "max_in_cpu": 0},
        "offload_optimizer": {"device": "nvme", "nvme_path": "PATH"},},
    }"""
    ds.write_text(text.replace("PATH", str(tmp_path)))
    code, out, _ = _run(
        capsys, "--params", "1e9", "--config", str(ds), "--nodes", "2", "--gpus-per-node", "4"
    )
    assert code == 0
    assert "stage 3, params nvme, optimizer nvme *" in out
    assert "world size 8" in out and "a node holds 4 ranks" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "give --params"),
        (["--params", "1e9", "--nodes", "0"], "--nodes and --gpus-per-node must be at least 1"),
        (["--model-config", "/nonexistent/gpt.json"], "cannot read --model-config"),
        (["--params", "1e9", "--config", "/nonexistent/ds.json"], "does not exist"),
    ],
)
def test_errors_exit_2_and_say_why(capsys, argv, message):
    code, _, err = _run(capsys, *argv)
    assert code == 2 and message in err


def test_a_model_config_without_its_shape_is_refused(capsys, tmp_path):
    cfg = tmp_path / "gpt.json"
    cfg.write_text(json.dumps({"vocab_size": 100}))
    code, _, err = _run(capsys, "--model-config", str(cfg))
    assert code == 2 and "lacks d_model, n_head, n_layer" in err


def test_an_unreadable_count_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["estimate", "--params", "13X"])
    assert e.value.code == 2
    assert "not a parameter count: '13X'" in capsys.readouterr().err


def test_the_command_runs_as_a_program():
    r = subprocess.run(
        [sys.executable, "-m", "infinity.cli.main", "estimate", "--params", "2e6", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["settings"]


@pytest.mark.parametrize(
    "name", ["zero2_offload_cpu.json", "zero3_offload_cpu.json", "zero3_infinity_nvme.json"]
)
def test_the_configs_users_bring_estimate_as_they_are(capsys, name):
    """DeepSpeed/HF configs full of "auto" (lr, batch sizes, ZeRO sizes): the optimizer and scheduler
    change no allocation, the ZeRO sizes follow the model's hidden size as HF derives them."""
    path = ROOT / "tests" / "config" / "data" / name
    code, out, err = _run(capsys, "--params", "1e9", "--config", str(path), "--json")
    assert code == 0, err
    d = json.loads(out)
    own = [
        s
        for s in d["settings"]
        if (s["stage"], s["offload_param"], s["offload_optimizer"])
        == (
            d["selected"]["stage"],
            d["selected"]["offload_param"],
            d["selected"]["offload_optimizer"],
        )
    ]
    assert own and d["selected"]["stage"] in (2, 3)


def test_doctor_prints_the_estimators_view_of_the_machine(capsys, tmp_path):
    assert main(["doctor", "--path", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "as `infinity estimate` and the pre-flight check see it" in out
    assert f"nvme_path    {tmp_path}" in out and "host memory" in out
    assert main(["doctor", "--path", str(tmp_path), "--json"]) == 0
    view = json.loads(capsys.readouterr().out)["machine_view"]
    assert view["mem_available_nbytes"] > 0 and view["disks"][0]["path"] == str(tmp_path)


def test_an_auto_config_shows_the_planners_placement_and_its_bytes_per_step(capsys, tmp_path):
    """ "device": "auto": the config's own row is the planner's choice within host_memory_budget, itemised
    with where each state class rests and the NVMe bytes per step; --json gives the homes per unit."""
    nvme = str(tmp_path / "nvme")
    raw = {
        "train_micro_batch_size_per_gpu": 1,
        "host_memory_budget": "1GiB",
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "auto", "nvme_path": nvme},
            "offload_optimizer": {"device": "auto", "nvme_path": nvme},
        },
    }
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(raw))
    code, out, _ = _run(
        capsys, "--params", "150M", "--config", str(cfg), "--precision", "fp32", "--seq", "256"
    )
    assert code == 0
    assert "stage 3, params auto, optimizer auto *" in out
    assert "where the training state rests, and what it moves per step:" in out
    assert "placement planner: budget 1.0 GiB (host_memory_budget='1GiB')" in out
    assert "NVMe per step: read" in out
    code, out, _ = _run(
        capsys,
        "--params",
        "150M",
        "--config",
        str(cfg),
        "--precision",
        "fp32",
        "--seq",
        "256",
        "--json",
    )
    d = json.loads(out)
    own = next(s for s in d["settings"] if s["offload_param"] == "auto")
    placed = own["placement"]
    assert placed["budget_nbytes"] == 1 << 30 and placed["need_nbytes"] <= 1 << 30
    homes = placed["homes"]
    assert {h["m"] for h in homes} == {"cpu", "nvme"} or {h["param"] for h in homes} == {
        "cpu",
        "nvme",
    }
    assert own["nvme_read_nbytes_per_step"] > 0
