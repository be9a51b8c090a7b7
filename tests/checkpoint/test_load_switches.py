"""DeepSpeed's load_checkpoint switches ([Note: what a load restores] in scope.py), each against an
oracle that does not use them: a fresh engine built from the checkpoint's exported weights, or the saving
engine itself carrying on with another schedule. And resuming under a config whose hyperparameters
differ from the checkpoint's says which values are used."""

from __future__ import annotations

import copy
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import infinity
from infinity.engine.checkpoint import export_checkpoint
from infinity.optim.lr_schedules import build_scheduler
from tests.checkpoint.helpers import (
    M_STEPS,
    MODELS,
    N_STEPS,
    assert_same,
    config,
    make_engine,
    snapshot,
    train,
    weights,
)
from tests.engine.reference import LR

RESEED = (
    77  # both runs compared draw dropout masks from here on (where the RNG state is not restored)
)


def other_schedule(cfg: dict) -> dict:
    cfg = copy.deepcopy(cfg)
    cfg["scheduler"]["params"].update(warmup_max_lr=LR / 2, warmup_num_steps=6)
    return cfg


def other_hyperparameters(cfg: dict) -> dict:
    cfg = copy.deepcopy(cfg)
    cfg["optimizer"]["params"].update(weight_decay=0.01, eps=1e-5, betas=[0.8, 0.9])
    return cfg


@pytest.fixture(scope="module")
def saved():
    """TiedNet (dropout, BatchNorm, a tied head) under stage 3 with everything on NVMe: N steps, a
    checkpoint, its weights exported; then the same engine goes on for M steps under another schedule."""
    base = Path(os.environ.get("INFINITY_TEST_NVME", Path.home() / ".cache" / "infinity-tests"))
    root = base / f"{os.getpid()}-switches"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    cfg = config(3, "nvme", "nvme", root)
    engine, _ = make_engine("tied", cfg, seed=0)
    try:
        train(engine, 0, N_STEPS)
        ckpt = engine.save_checkpoint(root / "ckpt")
        export = export_checkpoint(ckpt, root / "weights.safetensors")
        lr_at_save = engine.get_lr()
        engine.lr_scheduler = build_scheduler(other_schedule(cfg)["scheduler"], engine.optimizer)
        losses = train(engine, N_STEPS, M_STEPS)
        carried_on = {"losses": losses, "weights": weights(engine)}
    finally:
        engine.close()
    yield {
        "root": root,
        "cfg": cfg,
        "ckpt": ckpt,
        "export": export,
        "lr_at_save": lr_at_save,
        "carried_on": carried_on,
    }
    shutil.rmtree(root, ignore_errors=True)


def from_export(export: Path, cfg: dict):
    """A fresh engine whose model starts from the exported weights and buffers (its own optimizer state)."""
    torch.manual_seed(5)
    model = MODELS["tied"]()
    model.load_state_dict(load_file(str(export)), strict=True)
    return infinity.initialize(model, cfg)


def run_on(engine, *, reseed: bool) -> dict:
    if reseed:
        torch.manual_seed(RESEED)
    try:
        return {"losses": train(engine, N_STEPS, M_STEPS), "weights": weights(engine)}
    finally:
        engine.close()


def assert_same_run(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"]  # bitwise
    for name, w in a["weights"].items():
        assert torch.equal(w, b["weights"][name]), name


def swap_dir(saved, name: str) -> Path:
    d = saved["root"] / name
    d.mkdir()
    return d


def test_load_optimizer_states_false_keeps_the_configs_hyperparameters_and_starts_adam_afresh(
    saved, caplog
):
    cfg = other_hyperparameters(config(3, "nvme", "nvme", swap_dir(saved, "a1")))
    engine, _ = make_engine("tied", cfg, seed=1)
    with caplog.at_level(logging.INFO, logger="infinity.checkpoint"):
        engine.load_checkpoint(saved["ckpt"], load_optimizer_states=False)
    (g,) = engine.optimizer.param_groups
    assert (g["weight_decay"], g["eps"], tuple(g["betas"])) == (0.01, 1e-5, (0.8, 0.9))
    assert (
        engine.global_steps == N_STEPS and engine.get_lr() == saved["lr_at_save"]
    )  # the schedule is loaded
    said = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
    assert "keeping this engine's optimizer hyperparameters" in said
    assert (
        "weight_decay 0.01 (the checkpoint's: 0.1)" in said
        and "eps 1e-05 (the checkpoint's: 1e-06)" in said
    )
    resumed = run_on(engine, reseed=True)
    # Oracle: Adam from scratch on the checkpoint's weights, with this config's hyperparameters and the
    # schedule where the checkpoint's was (DeepSpeed's last_batch_iteration).
    oracle_cfg = other_hyperparameters(config(3, "nvme", "nvme", swap_dir(saved, "a2")))
    oracle_cfg["scheduler"]["params"]["last_batch_iteration"] = N_STEPS - 1
    assert_same_run(resumed, run_on(from_export(saved["export"], oracle_cfg), reseed=True))


def test_load_lr_scheduler_states_false_keeps_the_configs_schedule(saved, caplog):
    cfg = other_schedule(config(3, "nvme", "nvme", swap_dir(saved, "b")))
    engine, _ = make_engine("tied", cfg, seed=1)
    lr_before = engine.get_lr()
    with caplog.at_level(logging.INFO, logger="infinity.checkpoint"):
        engine.load_checkpoint(saved["ckpt"], load_lr_scheduler_states=False)
    assert engine.get_lr() == lr_before and engine.global_steps == N_STEPS
    assert engine.lr_scheduler.state_dict()["max_lrs"] == [LR / 2]
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "keeping this engine's lr schedule (WarmupLR)" in said
    # Oracle: the saving engine itself, carrying on from the checkpoint with this schedule swapped in.
    assert_same_run(run_on(engine, reseed=False), saved["carried_on"])


def test_load_module_only_loads_the_weights_alone(saved):
    engine, _ = make_engine("tied", config(3, "nvme", "nvme", swap_dir(saved, "c1")), seed=1)
    fresh = {
        k: v
        for k, v in snapshot(engine).items()
        if k not in ("weights", "buffers", "shards", "rng")
    }
    engine.load_checkpoint(saved["ckpt"], load_module_only=True)
    assert_same(
        fresh, {k: v for k, v in snapshot(engine).items() if k in fresh}, "all but the weights"
    )
    exported = load_file(str(saved["export"]))
    for name, w in weights(engine).items():
        assert torch.equal(w, exported[name]), name
    # Oracle: a fresh engine built from the same weights.
    oracle = from_export(saved["export"], config(3, "nvme", "nvme", swap_dir(saved, "c2")))
    torch.manual_seed(RESEED)
    resumed = {"losses": train(engine, N_STEPS, M_STEPS), "weights": weights(engine)}
    try:
        assert_same_run(resumed, run_on(oracle, reseed=True))
        # Into an engine that has trained: its moments, step counts, schedule, counters and RNG stay.
        before = snapshot(engine)
        engine.load_checkpoint(saved["ckpt"], load_module_only=True)
        after = snapshot(engine)
        for (index, role), t in before["shards"].items():
            if role != "master":
                assert torch.equal(after["shards"][(index, role)], t), (index, role)
        for key in ("param_steps", "counters", "lr", "scheduler", "loss_scale", "rng"):
            assert_same(before[key], after[key], key)
        for name, w in after["weights"].items():
            assert torch.equal(w, exported[name]), name
    finally:
        engine.close()


def test_resuming_under_other_hyperparameters_says_which_are_used(saved, caplog):
    cfg = config(3, "nvme", "nvme", swap_dir(saved, "d"))
    cfg["optimizer"]["params"].update(lr=1e-3, weight_decay=0.01)
    cfg["scheduler"]["params"]["warmup_max_lr"] = 1e-3
    engine, _ = make_engine("tied", cfg, seed=1)
    try:
        with caplog.at_level(logging.WARNING, logger="infinity.checkpoint"):
            engine.load_checkpoint(saved["ckpt"])
        # DeepSpeed's default: the checkpoint's values win...
        assert engine.optimizer.param_groups[0]["weight_decay"] == 0.1
        assert engine.get_lr() == saved["lr_at_save"]
        assert engine.lr_scheduler.state_dict()["max_lrs"] == [LR]
        # ...and the log says so, naming both values.
        said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        hyper = [m for m in said if "the checkpoint's optimizer hyperparameters" in m]
        assert (
            len(hyper) == 1
            and "weight_decay 0.1 (this engine's config: 0.01) in param group 0" in hyper[0]
        )
        assert "load_optimizer_states=False" in hyper[0]
        schedule = [m for m in said if "the checkpoint's lr schedule (WarmupLR)" in m]
        assert (
            len(schedule) == 1 and f"max_lrs [{LR}] (this engine's config: [0.001])" in schedule[0]
        )
        assert "load_lr_scheduler_states=False" in schedule[0]
    finally:
        engine.close()


def test_stage0_torch_optimizer_load_optimizer_states_false(tmp_path, caplog):
    """Stage 0 with the user's SGD: the momentum starts afresh and the new weight decay stays."""

    def engine_with(model, weight_decay):
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=weight_decay)
        cfg = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 2,
            "zero_optimization": {"stage": 0},
        }
        return infinity.initialize(model, cfg, optimizer=opt)

    torch.manual_seed(0)
    first = engine_with(MODELS["tied"](), 0.0)
    try:
        train(first, 0, N_STEPS)
        first.save_checkpoint(tmp_path / "ckpt")
    finally:
        first.close()
    export = export_checkpoint(tmp_path / "ckpt", tmp_path / "w.safetensors")
    torch.manual_seed(1)
    engine = engine_with(MODELS["tied"](), 0.01)
    with caplog.at_level(logging.INFO, logger="infinity.checkpoint"):
        engine.load_checkpoint(tmp_path / "ckpt", load_optimizer_states=False)
    assert not engine.optimizer.state and engine.optimizer.param_groups[0]["weight_decay"] == 0.01
    assert "weight_decay 0.01 (the checkpoint's: 0.0)" in caplog.text
    torch.manual_seed(5)
    model = MODELS["tied"]()
    model.load_state_dict(load_file(str(export)), strict=True)
    assert_same_run(run_on(engine, reseed=True), run_on(engine_with(model, 0.01), reseed=True))
