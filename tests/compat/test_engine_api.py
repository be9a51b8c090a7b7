"""The DeepSpeed-shaped engine and calls, against DeepSpeed's documented behaviour: initialize's
config sources and return tuple, model_parameters and lr_scheduler, the engine's queries, the
checkpoint round trip with DeepSpeed's return values, the ds_* attributes of ZeRO-3 parameters,
add_config_arguments, and a clear error for each thing infinity cannot honour."""

from __future__ import annotations

import argparse
import copy
import json
import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn

import infinity.compat.deepspeed as deepspeed
from infinity.compat.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from infinity.compat.deepspeed.zero import ZeroParamStatus
from tests.compat import models


def _cfg(stage=3, **extra):
    zero = {"stage": stage}
    if stage == 3:
        zero.update(offload_param={"device": "cpu"}, stage3_param_persistence_threshold=0)
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": zero,
        **extra,
    }


def _batches(n, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 8, generator=g), torch.randn(2, 1, generator=g)) for _ in range(n)]


def _assert_trains_as(engine, ref, ropt, batches, *, after_step=None):
    """The engine's loss on every micro-batch is plain torch's: ``ref`` trained by ``ropt`` with
    _cfg's accumulation of 2 (then ``after_step()``, a scheduler's step, say)."""
    losses, expected = [], []
    for i, batch in enumerate(batches):
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        rl = ref(batch)
        (rl / 2).backward()
        expected.append(rl.item())
        if i % 2 == 1:
            ropt.step()
            ropt.zero_grad()
            if after_step is not None:
                after_step()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-7)


def test_initialize_returns_deepspeeds_tuple_and_the_engine_answers_its_queries():
    torch.manual_seed(0)
    model = models.Regressor()
    data = models.dataset(10)
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        model=model, training_data=data, config=_cfg(dataloader_drop_last=True)
    )
    assert isinstance(engine, deepspeed.DeepSpeedEngine) and isinstance(engine, nn.Module)
    assert engine.module is model and optimizer is engine.optimizer and scheduler is None
    assert loader.batch_size == 2 and len(loader) == 5 and dist.is_initialized()
    assert (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu()) == (4, 2)
    assert engine.gradient_accumulation_steps() == 2 and engine.zero_optimization_stage() == 3
    assert engine.get_lr() == [1e-2] and engine.global_steps == 0
    boundaries = []
    for batch in _batches(4):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(engine(batch))
        engine.step()
    assert boundaries == [False, True, False, True]
    assert engine.global_steps == 2 and engine.global_samples == 8
    assert engine.get_global_grad_norm() > 0
    assert engine.net is model.net  # attributes the engine lacks are the model's, as in DeepSpeed
    engine.destroy()


@pytest.mark.parametrize("source", ["args", "args_deepscale", "config", "config_params"])
def test_config_from_args_or_either_keyword(tmp_path, source):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_cfg(2)))
    kwargs = {}
    if source == "args":
        kwargs["args"] = deepspeed.add_config_arguments(argparse.ArgumentParser()).parse_args(
            ["--deepspeed", "--deepspeed_config", str(path)]
        )
    elif source == "args_deepscale":
        kwargs["args"] = argparse.Namespace(deepspeed_config=None, deepscale_config=str(path))
    else:
        kwargs[source] = str(path)
    engine, *_ = deepspeed.initialize(model=models.Regressor(), **kwargs)
    assert engine.zero_optimization_stage() == 2
    engine.destroy()


def test_config_twice_or_never_is_refused():
    args = argparse.Namespace(deepspeed_config=_cfg())
    with pytest.raises(ValueError, match="given a config twice"):
        deepspeed.initialize(args=args, model=models.Regressor(), config=_cfg())
    with pytest.raises(ValueError, match="needs a config: --deepspeed_config"):
        deepspeed.initialize(model=models.Regressor())


def test_add_config_arguments_adds_deepspeeds_arguments():
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args([])
    assert (args.deepspeed, args.deepspeed_config) == (False, None)
    assert (args.deepscale, args.deepscale_config) == (False, None)
    assert parser.parse_args(["--deepspeed_config", "x.json"]).deepspeed_config == "x.json"


def test_model_parameters_param_groups_and_callable_scheduler_are_honoured():
    torch.manual_seed(0)
    model = models.Regressor()
    ref = copy.deepcopy(model)
    first, second = model.net[0], model.net[2]
    groups = [
        {"params": first.parameters(), "lr": 5e-3},
        {"params": [second.weight]},  # second.bias is in no group: DeepSpeed never updates it
    ]
    cfg = {**_cfg(), "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}}
    engine, opt, _, sched = deepspeed.initialize(
        model=model,
        model_parameters=groups,
        config=cfg,
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
    )
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR) and engine.lr_scheduler is sched
    r1, r2 = ref.net[0], ref.net[2]
    ropt = torch.optim.AdamW(
        [{"params": r1.parameters(), "lr": 5e-3}, {"params": [r2.weight]}],
        lr=1e-2,
        weight_decay=0.1,
    )
    rsched = torch.optim.lr_scheduler.StepLR(ropt, step_size=1, gamma=0.5)
    _assert_trains_as(engine, ref, ropt, _batches(6), after_step=rsched.step)
    assert engine.get_lr() == rsched.get_last_lr()
    with deepspeed.zero.GatheredParameters(second.bias):
        torch.testing.assert_close(second.bias.data, ref.net[2].bias.data)  # never updated
    engine.destroy()


@pytest.mark.parametrize("cls", [DeepSpeedCPUAdam, FusedAdam])
def test_deepspeed_adam_in_adam_mode_is_torchs_adam_with_l2(cls):
    torch.manual_seed(0)
    model = models.Regressor()
    ref = copy.deepcopy(model)
    mode = {"adamw_mode": False} if cls is DeepSpeedCPUAdam else {"adam_w_mode": False}
    opt = cls(model.parameters(), lr=1e-2, weight_decay=0.1, **mode)
    cfg = {k: v for k, v in _cfg().items() if k != "optimizer"}
    engine, returned, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    ropt = torch.optim.Adam(ref.parameters(), lr=1e-2, weight_decay=0.1)
    _assert_trains_as(engine, ref, ropt, _batches(4))
    engine.destroy()


def test_checkpoint_round_trip_returns_deepspeeds_values(tmp_path, caplog):
    torch.manual_seed(0)
    model = models.Regressor()
    start = copy.deepcopy(model)
    engine, *_ = deepspeed.initialize(model=model, config=_cfg())
    for batch in _batches(4):
        engine.backward(engine(batch))
        engine.step()
    client = {"epoch": 3, "note": "resume here", "best": [0.5, 0.25]}
    assert engine.save_checkpoint(tmp_path, client_state=client) is True
    assert (tmp_path / "latest").read_text().strip() == "global_step2"
    assert engine.save_checkpoint(tmp_path, tag="extra", save_latest=False) is True
    assert (tmp_path / "latest").read_text().strip() == "global_step2"
    after = [engine(b).item() for b in _batches(2, seed=9)]

    fresh, *_ = deepspeed.initialize(model=copy.deepcopy(start), config=_cfg())
    load_path, client_state = fresh.load_checkpoint(tmp_path)
    assert load_path == str(tmp_path / "global_step2") and client_state == client
    assert fresh.global_steps == 2
    assert [fresh(b).item() for b in _batches(2, seed=9)] == after
    path, state = fresh.load_checkpoint(tmp_path, tag="extra", load_optimizer_states=False)
    assert (path, state) == (str(tmp_path / "extra"), {})

    empty = tmp_path / "empty"
    empty.mkdir()
    with caplog.at_level(logging.WARNING, logger="infinity.compat"):
        assert fresh.load_checkpoint(empty) == (None, None)
    assert "Unable to find latest file" in caplog.text
    engine.destroy()
    fresh.destroy()


def test_ds_attributes_on_a_zero_init_model():
    with deepspeed.zero.Init(config_dict_or_path=_cfg(), remote_device="cpu"):
        model = models.Regressor(width=6)
    params = list(model.parameters())
    shapes = [(6, 8), (6,), (1, 6), (1,)]
    assert [tuple(p.ds_shape) for p in params] == shapes
    assert [p.ds_numel for p in params] == [48, 6, 6, 1]
    assert len({p.ds_id for p in params}) == 4
    assert all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in params)
    assert all(isinstance(p, nn.Parameter) and p.numel() == 0 for p in params)
    with deepspeed.zero.GatheredParameters(params[0]):
        assert params[0].ds_status is ZeroParamStatus.AVAILABLE
        assert params[0].shape == (6, 8) and params[1].ds_status is ZeroParamStatus.NOT_AVAILABLE
    assert params[0].ds_status is ZeroParamStatus.NOT_AVAILABLE
    ids = [p.ds_id for p in params]
    engine, *_ = deepspeed.initialize(model=model, config=_cfg())
    assert [p.ds_id for p in params] == ids and [p.ds_numel for p in params] == [48, 6, 6, 1]
    assert all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in params)
    with deepspeed.zero.GatheredParameters(engine):  # DeepSpeed takes an engine too
        assert all(p.ds_status is ZeroParamStatus.AVAILABLE for p in params)
    engine.destroy()


def test_ds_attributes_only_under_stage_3():
    model = models.Regressor()
    engine, *_ = deepspeed.initialize(model=model, config=_cfg(2))
    assert not any(hasattr(p, "ds_numel") or hasattr(p, "ds_status") for p in model.parameters())
    engine.destroy()


def test_checkpointing_is_deepspeeds_api():
    layer = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    deepspeed.checkpointing.configure(None, partition_activations=False)
    assert deepspeed.checkpointing.is_configured()
    out = deepspeed.checkpointing.checkpoint(layer, x)
    out.sum().backward()
    ref = copy.deepcopy(layer)
    xr = x.detach().requires_grad_()
    ref(xr).sum().backward()
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad)
    torch.testing.assert_close(x.grad, xr.grad)


@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda: deepspeed.initialize(model=models.Regressor(), config=_cfg(), mpu=object()),
            r"initialize\(mpu=...\): infinity has no model",
        ),
        (
            lambda: deepspeed.initialize(
                model=models.Regressor(), config=_cfg(), mesh_param=(2, 1)
            ),
            r"initialize\(mesh_param=...\)",
        ),
        (lambda: deepspeed.zero.Init(module=nn.Linear(2, 2)), r"zero.Init\(module=...\)"),
        (lambda: deepspeed.zero.Init(remote_device="cuda"), r"remote_device='cuda'"),
        (lambda: deepspeed.zero.Init(mpu=object()), r"zero.Init\(mpu=...\)"),
        (lambda: deepspeed.zero.GatheredParameters([], fwd_module=nn.Linear(2, 2)), "fwd_module"),
        (lambda: DeepSpeedCPUAdam(nn.Linear(2, 2).parameters(), amsgrad=True), "amsgrad=True"),
        (lambda: FusedAdam(nn.Linear(2, 2).parameters(), amsgrad=True), "amsgrad=True"),
        (lambda: deepspeed.checkpointing.model_parallel_cuda_manual_seed(1), "model-parallel"),
        (lambda: deepspeed.init_distributed(config={}), r"init_distributed\(config=...\)"),
    ],
)
def test_what_infinity_cannot_honour_is_refused_naming_the_call(call, match):
    with pytest.raises(deepspeed.UnsupportedByInfinity, match=match):
        call()


def test_engine_calls_infinity_cannot_honour_are_refused(tmp_path):
    engine, *_ = deepspeed.initialize(model=models.Regressor(), config=_cfg())
    batch = _batches(1)[0]
    with pytest.raises(deepspeed.UnsupportedByInfinity, match="retain_graph=True"):
        engine.backward(engine(batch), retain_graph=True)
    with pytest.raises(deepspeed.UnsupportedByInfinity, match="scale_wrt_gas=False"):
        engine.backward(engine(batch), scale_wrt_gas=False)
    with pytest.raises(deepspeed.UnsupportedByInfinity, match="lr_kwargs"):
        engine.step(lr_kwargs={"increment": 2})
    with pytest.raises(deepspeed.UnsupportedByInfinity, match="exclude_frozen_parameters"):
        engine.save_checkpoint(tmp_path, exclude_frozen_parameters=True)
    with pytest.raises(deepspeed.UnsupportedByInfinity, match="custom_load_fn"):
        engine.load_checkpoint(tmp_path, custom_load_fn=lambda src, dst: None)
    with pytest.raises(deepspeed.UnsupportedByInfinity, match="set_gradient_accumulation"):
        engine.set_gradient_accumulation_boundary(True)
    engine.destroy()


def test_stage_3_without_an_optimizer_runs_forward_only():
    model = models.Regressor()
    cfg = {k: v for k, v in _cfg().items() if k != "optimizer"}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=cfg)
    assert optimizer is None
    with torch.no_grad():
        assert torch.isfinite(engine(_batches(1)[0]))
    with pytest.raises(RuntimeError, match="built without an optimizer"):
        _ = engine.global_steps
    engine.destroy()


def test_zero_init_remote_device_and_enabled(tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    cfg = {"zero_optimization": {"stage": 3, "offload_param": {"nvme_path": str(nvme)}}}
    with deepspeed.zero.Init(config_dict_or_path=cfg, remote_device="nvme"):
        model = models.Regressor(width=6)
    assert all(
        p.numel() == 0 and p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in model.parameters()
    )
    assert any(nvme.rglob("*")), "the partitions wait in nvme_path"
    with deepspeed.zero.GatheredParameters(model.net[0].weight):
        assert model.net[0].weight.shape == (6, 8)
    with pytest.raises(ValueError, match="needs zero_optimization.offload_param.nvme_path"):
        deepspeed.zero.Init(
            config_dict_or_path={"zero_optimization": {"stage": 3}}, remote_device="nvme"
        )
    nvme_cfg = {
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": str(nvme)},
        }
    }
    with pytest.raises(ValueError, match="contradicts"):
        deepspeed.zero.Init(config_dict_or_path=nvme_cfg, remote_device="cpu")
    with deepspeed.zero.Init(config_dict_or_path=_cfg(), enabled=False):
        plain = models.Regressor()
    assert not any(hasattr(p, "ds_numel") for p in plain.parameters())
    assert all(p.numel() > 0 for p in plain.parameters())


def test_training_data_with_collate_fn_and_drop_last():
    seen = []

    def collate(samples):
        seen.append(len(samples))
        x = torch.stack([s["x"] for s in samples])
        y = torch.stack([s["y"] for s in samples])
        return x, y

    data = [{"x": x, "y": y} for x, y in models.dataset(7)]
    engine, _, loader, _ = deepspeed.initialize(
        model=models.Regressor(), training_data=data, collate_fn=collate, config=_cfg(2)
    )
    batches = list(loader)
    assert seen == [2, 2, 2, 1] and len(loader) == 4  # dataloader_drop_last defaults to False
    assert batches[0][0].shape == (2, 8)
    engine.destroy()


def test_save_16bit_model_writes_deepspeeds_file_and_was_step_applied(tmp_path):
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=models.Regressor(), config=_cfg())
    applied = []
    for batch in _batches(4):
        engine.backward(engine(batch))
        engine.step()
        applied.append(engine.was_step_applied())
    assert applied == [False, True, False, True]  # gradient_accumulation_steps 2
    gathered = engine.engine.gathered_state_dict()
    assert engine.save_16bit_model(tmp_path / "bin") is True  # DeepSpeed's default name
    loaded = torch.load(tmp_path / "bin" / "pytorch_model.bin", weights_only=True)
    assert loaded.keys() == gathered.keys()
    assert all(torch.equal(loaded[k], gathered[k]) for k in gathered)
    engine.save_16bit_model(tmp_path / "st", "model.safetensors")
    from safetensors.torch import load_file

    streamed = load_file(tmp_path / "st" / "model.safetensors")
    assert all(torch.equal(streamed[k], gathered[k]) for k in gathered)
    with pytest.raises(NotImplementedError, match="exclude_frozen_parameters"):
        engine.save_16bit_model(tmp_path, exclude_frozen_parameters=True)
    engine.destroy()
