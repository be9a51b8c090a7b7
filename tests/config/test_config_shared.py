"""The configs users bring (copies in tests/config/data) load unchanged, to the values DeepSpeed would use."""

import json
import logging
import warnings
from pathlib import Path

import pytest

from infinity.config import InfinityConfig, load_config

DATA = Path(__file__).parent / "data"

NAMES = ["zero2_offload_cpu.json", "zero3_offload_cpu.json", "zero3_infinity_nvme.json"]


@pytest.mark.parametrize("name", NAMES)
def test_every_shared_config_loads_unchanged_without_warnings(name):
    text_before = (DATA / name).read_text()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = (
            load_config(DATA / name, lr=3e-4)
            if name != "zero3_infinity_nvme.json"
            else load_config(DATA / name)
        )
    assert isinstance(cfg, InfinityConfig)
    assert (DATA / name).read_text() == text_before


def test_zero2_offload_cpu_resolved_values(caplog):
    caplog.set_level(logging.INFO, "infinity.config")
    cfg = load_config(
        DATA / "zero2_offload_cpu.json",
        lr=3e-4,
        betas=(0.9, 0.98),
        eps=1e-6,
        weight_decay=0.01,
        warmup_num_steps=50,
        train_micro_batch_size_per_gpu=4,
        gradient_accumulation_steps=2,
        gradient_clipping=1.0,
        bf16=True,
        world_size=2,
    )
    assert cfg.precision == "bf16" and not cfg.fp16.enabled
    # fp16's explicit knobs are kept even though fp16 is off
    assert (cfg.fp16.loss_scale, cfg.fp16.loss_scale_window, cfg.fp16.initial_scale_power) == (
        0.0,
        1000,
        16,
    )
    assert (cfg.fp16.hysteresis, cfg.fp16.min_loss_scale) == (2, 1.0)
    o = cfg.optimizer
    assert o.type == "adamw" and o.adamw_mode
    assert (o.params.lr, o.params.betas, o.params.eps, o.params.weight_decay) == (
        3e-4,
        (0.9, 0.98),
        1e-6,
        0.01,
    )
    s = cfg.scheduler
    assert s.type == "WarmupLR"
    assert (s.params.warmup_min_lr, s.params.warmup_max_lr, s.params.warmup_num_steps) == (
        0.0,
        3e-4,
        50,
    )
    assert s.params.warmup_type == "log"
    z = cfg.zero_optimization
    assert z.stage == 2
    assert z.offload_optimizer.device == "cpu" and z.offload_optimizer.pin_memory
    assert z.offload_param.device == "none"
    assert z.allgather_bucket_size == 200_000_000 and isinstance(z.allgather_bucket_size, int)
    assert z.reduce_bucket_size == 200_000_000 and z.overlap_comm and z.contiguous_gradients
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (4, 2)
    assert cfg.train_batch_size == 16 and cfg.world_size == 2
    assert cfg.gradient_clipping == 1.0
    assert cfg.steps_per_print == 100_000 and isinstance(cfg.steps_per_print, int)
    assert cfg.preflight is True
    sources = dict(cfg.auto_filled)
    assert sources["optimizer.params.lr"] == "lr="
    assert sources["scheduler.params.warmup_max_lr"] == "lr="  # HF's table: learning_rate fills it
    assert sources["scheduler.params.warmup_min_lr"] == "default 0.0"
    assert sources["train_batch_size"].startswith(
        "batch arithmetic: 16 = 4 (micro) x 2 (accumulation) x 2"
    )
    assert sources["bf16.enabled"] == "bf16=" and sources["fp16.enabled"] == "default False"
    ignored = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(ignored) == 1
    for key in (
        "allgather_bucket_size",
        "allgather_partitions",
        "overlap_comm",
        "reduce_scatter",
        "reduce_bucket_size",
        "contiguous_gradients",
    ):
        assert f"zero_optimization.{key}" in ignored[0]


def test_zero2_offload_cpu_with_only_lr_takes_deepspeed_defaults():
    cfg = load_config(DATA / "zero2_offload_cpu.json", lr=1e-3)
    p = cfg.optimizer.params
    assert (p.betas, p.eps, p.weight_decay) == ((0.9, 0.999), 1e-8, 0.0)
    assert cfg.precision == "fp32"
    assert (
        cfg.train_batch_size,
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
    ) == (1, 1, 1)
    assert cfg.gradient_clipping == 0.0
    assert cfg.scheduler.params.warmup_num_steps == 1000
    assert cfg.scheduler.params.warmup_max_lr == 1e-3


def test_zero3_offload_cpu_resolved_values():
    cfg = load_config(
        DATA / "zero3_offload_cpu.json", lr=2e-5, hidden_size=1024, fp16=True, world_size=4
    )
    z = cfg.zero_optimization
    assert z.stage == 3
    assert z.offload_param.device == "cpu" and z.offload_param.pin_memory
    assert z.offload_optimizer.device == "cpu"
    assert z.sub_group_size == 1_000_000_000
    # hidden_size fills the three "auto" sizes as HF transformers does
    assert z.reduce_bucket_size == 1024 * 1024
    assert z.stage3_prefetch_bucket_size == int(0.9 * 1024 * 1024)
    assert z.stage3_param_persistence_threshold == 10 * 1024
    assert (z.stage3_max_live_parameters, z.stage3_max_reuse_distance) == (
        1_000_000_000,
        1_000_000_000,
    )
    # the deprecated fp16 spelling lands on the 16bit key
    assert z.stage3_gather_16bit_weights_on_model_save is True
    assert cfg.precision == "fp16" and cfg.fp16.initial_dynamic_scale() == 65536.0
    assert cfg.bf16.enabled is False
    assert cfg.train_batch_size == 4 and cfg.train_micro_batch_size_per_gpu == 1
    assert cfg.wall_clock_breakdown is False
    assert "wall_clock_breakdown" not in cfg.ignored_keys()  # acted on (the engine times steps)


def test_zero3_infinity_nvme_resolved_values():
    cfg = load_config(DATA / "zero3_infinity_nvme.json")
    z = cfg.zero_optimization
    assert z.stage == 3
    p, o = z.offload_param, z.offload_optimizer
    assert (p.device, p.nvme_path, p.pin_memory, p.buffer_count) == ("nvme", "/local_nvme", True, 5)
    assert (p.buffer_size, p.max_in_cpu) == (100_000_000, 1_000_000_000)
    assert isinstance(p.buffer_size, int) and isinstance(p.max_in_cpu, int)
    assert (o.device, o.nvme_path, o.buffer_count, o.fast_init) == ("nvme", "/local_nvme", 4, False)
    assert (o.pipeline_read, o.pipeline_write) == (False, False)
    assert (
        z.stage3_prefetch_bucket_size == 50_000_000
        and z.stage3_param_persistence_threshold == 100_000
    )
    assert z.stage3_gather_16bit_weights_on_model_save is True
    assert cfg.precision == "bf16"
    assert cfg.optimizer.params.betas == (0.9, 0.95) and cfg.optimizer.params.weight_decay == 0.1
    assert cfg.scheduler is None
    assert cfg.gradient_clipping == 1.0
    a = cfg.aio
    assert (a.block_size, a.queue_depth, a.thread_count, a.single_submit, a.overlap_events) == (
        1048576,
        8,
        1,
        False,
        True,
    )
    assert "zero_optimization.offload_optimizer.fast_init" in cfg.ignored_keys()


def test_nvme_path_overridden_by_editing_the_dict(tmp_path):
    raw = json.loads((DATA / "zero3_infinity_nvme.json").read_text())
    for section in ("offload_param", "offload_optimizer"):
        raw["zero_optimization"][section]["nvme_path"] = str(tmp_path)
    cfg = load_config(raw)
    assert cfg.zero_optimization.offload_param.nvme_path == str(tmp_path)
    assert cfg.zero_optimization.offload_optimizer.nvme_path == str(tmp_path)


def test_engine_default_nvme_path_does_not_override_the_configs(tmp_path):
    cfg = load_config(DATA / "zero3_infinity_nvme.json", nvme_path=tmp_path)
    assert cfg.zero_optimization.offload_param.nvme_path == "/local_nvme"


# Configs copied verbatim from the user guides into data/seeds (DeepSpeed's ZeRO-Offload tutorial,
# HF's DeepSpeed guide, Accelerate's several-models guide), with the
# arguments HF / Accelerate would pass for their "auto" values.
SEEDS = {
    "zero_offload_tutorial.json": {},  # a comma missing at a line end: DeepSpeed reads hjson
    "deepspeed_guide_zero2_offload.json": {"lr": 3e-4},
    "deepspeed_guide_zero3_offload.json": {"lr": 3e-4, "hidden_size": 1024},
    "accelerate_zero3_teacher.json": {"bf16": True, "hidden_size": 512},
    "accelerate_zero2_student.json": {"lr": 1e-4, "bf16": True},
}


@pytest.mark.parametrize("name", sorted(SEEDS))
def test_every_seed_config_loads_unchanged_without_warnings(name):
    path = DATA / "seeds" / name
    text_before = path.read_text()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config(path, **SEEDS[name])
    assert isinstance(cfg, InfinityConfig)
    assert path.read_text() == text_before


def test_the_zero_offload_tutorial_config_with_its_missing_comma():
    cfg = load_config(DATA / "seeds" / "zero_offload_tutorial.json")
    z = cfg.zero_optimization
    assert z.stage == 2 and z.offload_optimizer.device == "cpu"
    assert z.contiguous_gradients is True and z.overlap_comm is True
    assert cfg.user_keys >= {
        "zero_optimization.contiguous_gradients",
        "zero_optimization.overlap_comm",
    }


def test_the_accelerate_configs_resolve_as_accelerate_would():
    teacher = load_config(
        DATA / "seeds" / "accelerate_zero3_teacher.json", bf16=True, hidden_size=512
    )
    z = teacher.zero_optimization
    assert z.stage == 3 and teacher.precision == "bf16"
    assert (z.reduce_bucket_size, z.stage3_prefetch_bucket_size) == (
        512 * 512,
        int(0.9 * 512 * 512),
    )
    assert (z.stage3_max_live_parameters, z.stage3_max_reuse_distance) == (
        1_000_000_000,
        1_000_000_000,
    )
    student = load_config(DATA / "seeds" / "accelerate_zero2_student.json", lr=1e-4, bf16=True)
    o = student.optimizer
    assert (
        o.params.torch_adam and o.adamw_mode and o.params.weight_decay == 0.01
    )  # torch's AdamW default
    assert student.zero_optimization.offload_optimizer.device == "cpu"
