"""to_dict() is a DeepSpeed-shaped dict that loads back to the same config; summary() reads well."""

import json
import logging
from pathlib import Path

import pytest

from infinity.config import InfinityConfig, describe_config, load_config

DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize(
    "name", ["zero2_offload_cpu.json", "zero3_offload_cpu.json", "zero3_infinity_nvme.json"]
)
def test_to_dict_loads_back_to_the_same_config(name):
    kwargs = {} if name == "zero3_infinity_nvme.json" else {"lr": 2e-4, "warmup_num_steps": 10}
    cfg = load_config(DATA / name, world_size=2, **kwargs)
    d = cfg.to_dict()
    json.dumps(d)  # plain JSON types only
    again = load_config(d, world_size=2)
    assert again == cfg
    assert again.to_dict() == d


def test_to_dict_has_deepspeeds_shape_and_keeps_unread_sections():
    raw = {
        "bfloat16": {"enabled": True},
        "flops_profiler": {"enabled": True, "output_file": "runs"},
        "zero_optimization": {
            "stage": 3,
            "prefetch_bucket_size": 5,
            "zenflow": {"topk_ratio": 0.1},
        },
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100}},
        "aio": {"intra_op_parallelism": 2},
    }
    d = load_config(raw).to_dict()
    assert d["bf16"]["enabled"] is True and "bfloat16" not in d
    assert d["flops_profiler"] == {"enabled": True, "output_file": "runs"}
    assert d["zero_optimization"]["stage3_prefetch_bucket_size"] == 5
    assert d["zero_optimization"]["zenflow"] == {"topk_ratio": 0.1}
    assert d["zero_optimization"]["offload_param"]["device"] == "none"
    assert d["optimizer"] == {
        "type": "adam",
        "params": {
            "lr": 1e-3,
            "betas": [0.9, 0.999],
            "eps": 1e-8,
            "weight_decay": 0.0,
            "adam_w_mode": True,
            "torch_adam": False,
            "bias_correction": True,
            "amsgrad": False,
        },
        "legacy_fusion": False,
    }
    assert (
        d["scheduler"]["type"] == "WarmupDecayLR"
        and d["scheduler"]["params"]["warmup_max_lr"] == 0.001
    )
    assert d["aio"]["intra_op_parallelism"] == 2 and "thread_count" not in d["aio"]
    assert d["preflight"] is True
    assert (
        d["train_batch_size"],
        d["train_micro_batch_size_per_gpu"],
        d["gradient_accumulation_steps"],
    ) == (1, 1, 1)


def test_an_infinity_config_passes_through_load_config():
    cfg = load_config({"zero_optimization": {"stage": 2}}, world_size=2)
    assert load_config(cfg) is cfg
    re = load_config(cfg, world_size=4)
    assert (
        re.train_batch_size == 4 and re.world_size == 4
    )  # micro and accumulation kept; total recomputed
    assert isinstance(re, InfinityConfig)


def test_summary_names_what_runs_what_auto_became_and_what_is_ignored(caplog):
    caplog.set_level(logging.WARNING, "infinity.config")
    cfg = load_config(DATA / "zero3_offload_cpu.json", lr=5e-5, hidden_size=512, world_size=2)
    text = describe_config(cfg)
    assert text.splitlines()[0] == "infinity config: world size 2, fp32"
    assert "train_batch_size 2 = micro 1 x accumulation 1 x world 2" in text
    assert "stage 3; sub_group_size 1,000,000,000 elements" in text
    assert "params     cpu (pinned)" in text
    assert "prefetch 235,929, persistence threshold 5,120" in text
    assert (
        "adamw (decoupled weight decay): lr 5e-05, betas (0.9, 0.999), eps 1e-08, weight_decay 0"
        in text
    )
    assert (
        "scheduler  WarmupLR: warmup_min_lr 0.0, warmup_max_lr 5e-05, warmup_num_steps 1000" in text
    )
    assert "    optimizer.params.lr <- lr=" in text
    assert "    zero_optimization.reduce_bucket_size <- hidden_size=512" in text
    assert "accepted, no effect here: zero_optimization.contiguous_gradients" in text


def test_summary_of_nvme_and_fp16_configs():
    raw = json.loads((DATA / "zero3_infinity_nvme.json").read_text())
    text = describe_config(load_config(raw))
    assert (
        "params     nvme at /local_nvme (pinned; 5 buffers x 100,000,000 elements; max_in_cpu 1,000,000,000)"
        in text
    )
    assert (
        "optimizer  nvme at /local_nvme (pinned; 4 buffers; pipelined read off, write off)" in text
    )
    assert "precision  bf16, fp32 master weights" in text
    raw["bf16"]["enabled"] = False
    raw["fp16"] = {"enabled": True}
    text = describe_config(load_config(raw))
    assert (
        "precision  fp16, fp32 master weights, dynamic loss scale from 2^16, window 1000, hysteresis 2, min 1"
        in text
    )
