"""The DeepSpeed training code of the user guides (tests/compat/snippets: DeepSpeed's getting
started with its checkpoints, the ZeRO-3 offload setup with zero.Init and GatheredParameters,
the Lightning guide's optimizers and activation checkpointing, a DeepSpeed-style script with
--deepspeed_config) run with ``import infinity.compat.deepspeed as deepspeed`` and give plain
PyTorch's losses. fp32 throughout: the CPU Adam kernel is within an ulp of torch's update per
step, so 1e-5 relative over a few steps is the tolerance."""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from infinity.config import read_config_file
from tests.compat import models
from tests.compat.snippets import getting_started, lightning_ops, train_ds, zero3_offload

ROOT = Path(__file__).resolve().parents[2]
SEEDS = ROOT / "tests" / "config" / "data" / "seeds"
RTOL = 1e-5


def _close(actual, expected):
    assert len(actual) == len(expected)
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), rtol=RTOL, atol=1e-7)


def _config(stage: int, **extra) -> dict:
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu"}}
    if stage == 3:
        zero.update(offload_param={"device": "cpu"}, stage3_param_persistence_threshold=0)
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": zero,
        **extra,
    }


def _loader(data, micro=4):
    return DataLoader(data, batch_size=micro, sampler=DistributedSampler(data, 1, 0))


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_getting_started_loop_gives_torchs_losses(stage):
    torch.manual_seed(0)
    model = models.Regressor()
    ref = copy.deepcopy(model)
    data = models.dataset()
    args = argparse.Namespace(deepspeed_config=None, local_rank=0)
    # stage 0 without offload: DeepSpeed's plain data parallelism
    cfg = _config(stage) if stage else {**_config(2), "zero_optimization": {"stage": 0}}
    args.deepspeed_config = cfg  # as the parsed --deepspeed_config, but a dict: no file needed
    losses = getting_started.train(args, model, _loader(data))
    expected = models.reference_losses(
        ref, data, micro=4, accumulation=2, lr=1e-2, weight_decay=0.01
    )
    _close(losses, expected)


def test_checkpoint_every_interval_and_resume_gives_the_uninterrupted_losses(tmp_path):
    torch.manual_seed(0)
    model = models.Regressor()
    start = copy.deepcopy(model)
    data = models.dataset()
    args = argparse.Namespace(
        deepspeed_config=_config(3), save_interval=4, save_dir=str(tmp_path), local_rank=0
    )
    losses, tags = getting_started.train_with_checkpoints(args, model, _loader(data))
    assert len(tags) == 3 and (tmp_path / "latest").read_text().strip() == tags[-1]
    # resume from the first checkpoint (micro step 3 done: two updates) in a fresh engine
    args.load_dir, args.ckpt_id = str(tmp_path), tags[0]
    (load_path, client_sd), resumed = getting_started.resume(
        args, copy.deepcopy(start), _loader(data)
    )
    assert load_path == str(tmp_path / tags[0])
    assert client_sd == {"step": 3}
    _close(resumed, losses[4:])


def test_zero3_offload_setup_from_the_guide(tmp_path):
    # The deepspeed guide's ZeRO-3 offload config, its "auto" values filled as HF's Trainer fills
    # them (DeepSpeed itself refuses "auto"): lr, AdamW's defaults, clipping 1.0, no fp16, a
    # WarmupLR from lr to lr (a constant lr the oracle can follow).
    cfg = read_config_file(SEEDS / "deepspeed_guide_zero3_offload.json")
    lr = 5e-3
    cfg["fp16"]["enabled"] = False
    cfg["optimizer"]["params"] = {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    cfg["scheduler"]["params"] = {"warmup_min_lr": lr, "warmup_max_lr": lr, "warmup_num_steps": 5}
    zero = cfg["zero_optimization"]
    zero.update(
        reduce_bucket_size=256,
        stage3_prefetch_bucket_size=230,
        stage3_param_persistence_threshold=0,
    )
    cfg.update(
        gradient_accumulation_steps=2,
        gradient_clipping=1.0,
        train_batch_size=8,
        train_micro_batch_size_per_gpu=4,
    )
    torch.manual_seed(0)
    init_state = {k: v.clone() for k, v in models.Regressor().state_dict().items()}
    model = zero3_offload.build(models.Regressor, cfg, init_state)
    ref = models.Regressor()
    ref.load_state_dict(init_state)
    assert zero3_offload.count_parameters(model) == sum(p.numel() for p in ref.parameters())
    assert all(
        p.numel() == 0 for p in model.parameters()
    )  # partitioned: the counter needs ds_numel
    data = models.dataset()
    engine, losses = zero3_offload.train(model, cfg, data, epochs=2)
    expected = models.reference_losses(
        ref, data, micro=4, accumulation=2, lr=lr, clip=1.0, epochs=2
    )
    _close(losses, expected)
    assert engine.global_steps == len(losses) // 2
    assert engine.get_lr() == [lr]
    engine.destroy()


def test_zero_init_with_the_config_as_first_argument(tmp_path):
    # The Accelerate guide: ``with deepspeed.zero.Init(accelerator.deepspeed_plugin.config):``
    cfg = read_config_file(SEEDS / "accelerate_zero3_teacher.json")
    torch.manual_seed(0)
    model = zero3_offload.build_positional(models.Regressor, cfg)
    assert all(p.numel() == 0 for p in model.parameters())
    assert zero3_offload.count_parameters(model) == 8 * 16 + 16 + 16 + 1


@pytest.mark.parametrize("fused", [False, True])
def test_lightning_guides_optimizers_and_activation_checkpointing(fused):
    torch.manual_seed(0)
    model = lightning_ops.MyModel()
    ref = copy.deepcopy(model)
    batches = lightning_ops.batches(4)
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu"},
            "offload_optimizer": {"device": "cpu"},
            "stage3_param_persistence_threshold": 0,
        },
    }
    losses = lightning_ops.train(model, cfg, batches, fused=fused)
    # DeepSpeedCPUAdam's and FusedAdam's defaults: lr 1e-3, weight decay 0, AdamW mode
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.0)
    expected = []
    for batch in batches:
        loss = ref(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(loss.item())
    _close(losses, expected)


def test_deepspeed_style_script_with_deepspeed_config_runs_as_a_script(tmp_path):
    # The ZeRO-Offload tutorial's config, verbatim (hjson: a comma is missing, DeepSpeed reads it)
    config = tmp_path / "ds_zero_offload.config"
    text = (SEEDS / "zero_offload_tutorial.json").read_text()
    # the tutorial's script sets the batch size (--batch-size); here the config carries it
    config.write_text(text.replace("{", '{\n    "train_micro_batch_size_per_gpu": 4,', 1))
    out = tmp_path / "losses.json"
    script = Path(train_ds.__file__)
    subprocess.run(
        [
            sys.executable,
            str(script),
            "--deepspeed",
            "--deepspeed_config",
            str(config),
            "--steps",
            "6",
            "--out",
            str(out),
        ],
        check=True,
        timeout=300,
        cwd=tmp_path,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        },
    )
    result = json.loads(out.read_text())
    assert result["stage"] == 2 and result["train_batch_size"] == 4 and result["global_steps"] == 6
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, generator=g), torch.randn(1, generator=g)) for _ in range(64)]
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.01)
    expected = []
    for x, y in list(_loader(data))[:6]:
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(loss.item())
    _close(result["losses"], expected)
