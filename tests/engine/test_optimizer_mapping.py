"""A user's torch optimizer and lr schedule, mapped onto the partitioned CPU Adam.

Oracle: the same torch optimizer (two param groups with their own lr and weight
decay: the usual decay / no-decay split) and the same schedule, stepping an
ordinary module.
"""

import pytest
import torch

import infinity
from infinity.optim import CPUAdam
from infinity.optim.lr_schedules import WarmupDecayLR
from infinity.zero.gathered import GatheredParameters
from tests.engine.models import batch, tiny_gpt
from tests.engine.reference import CLIP, EPS, engine_config

STEPS = 8


def groups(model, kind):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return kind(
        [
            {"params": decay, "weight_decay": 0.1},
            {"params": no_decay, "weight_decay": 0.0, "lr": 1e-3},
        ],
        lr=3e-3,
        betas=(0.9, 0.95),
        eps=EPS,
    )


def schedule(opt):
    return WarmupDecayLR(
        opt,
        total_num_steps=STEPS,
        warmup_min_lr=0.0,
        warmup_max_lr=None,
        warmup_num_steps=3,
        warmup_type="linear",
    )


def train_plain(kind):
    torch.manual_seed(0)
    model = tiny_gpt()
    opt = groups(model, kind)
    sched = schedule(opt)
    losses, lrs = [], []
    for step in range(STEPS):
        x, y = batch(step, 0, 0)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        lrs.append([g["lr"] for g in opt.param_groups])
        sched.step()
        losses.append(loss.item())
    return losses, lrs, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", [torch.optim.AdamW, torch.optim.Adam])
@pytest.mark.parametrize(
    "stage,offload_param,offload_optimizer", [(1, "none", "cpu"), (3, "nvme", "nvme")]
)
def test_torch_optimizer_with_param_groups_and_scheduler(
    kind, stage, offload_param, offload_optimizer, nvme_dir
):
    ref_losses, ref_lrs, ref_weights = train_plain(kind)
    cfg = engine_config(stage, offload_param, offload_optimizer, nvme_dir, gas=1)
    del cfg["optimizer"]
    torch.manual_seed(0)
    model = tiny_gpt()
    opt = groups(model, kind)
    engine = infinity.initialize(model, cfg, optimizer=opt, lr_scheduler=schedule)
    losses, lrs = [], []
    try:
        assert (
            engine.optimizer.param_groups is opt.param_groups
        )  # shared: the user's view stays true
        for step in range(STEPS):
            x, y = batch(step, 0, 0)
            loss = engine(x, y)
            engine.backward(loss)
            lrs.append(engine.get_lr())
            engine.step()
            losses.append(loss.item())
        with GatheredParameters(engine):
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        engine.close()
    assert lrs == ref_lrs
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for n, ref in ref_weights.items():
        assert (weights[n] - ref).abs().max() <= 1e-5 * ref.abs().max(), n


def test_cpu_adam_in_adam_mode_stays_adam(nvme_dir):
    """CPUAdam(adamw_mode=False) is torch's Adam (L2 weight decay) in the engine too: the engine
    reads the mode under torch's name, decoupled_weight_decay."""
    ref_losses, _, _ = train_plain(torch.optim.Adam)
    cfg = engine_config(1, "none", "cpu", nvme_dir, gas=1)
    del cfg["optimizer"]
    torch.manual_seed(0)
    model = tiny_gpt()
    opt = groups(model, lambda g, **kw: CPUAdam(g, adamw_mode=False, **kw))
    engine = infinity.initialize(model, cfg, optimizer=opt, lr_scheduler=schedule)
    try:
        losses = []
        for step in range(STEPS):
            x, y = batch(step, 0, 0)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    finally:
        engine.close()
    assert losses == pytest.approx(ref_losses, rel=1e-5)


def test_scheduler_from_config_drives_the_lr(nvme_dir):
    cfg = engine_config(3, "cpu", "cpu", nvme_dir, gas=2)
    cfg["scheduler"] = {
        "type": "WarmupLR",
        "params": {
            "warmup_min_lr": 0.0,
            "warmup_max_lr": 1e-3,
            "warmup_num_steps": 4,
            "warmup_type": "linear",
        },
    }
    torch.manual_seed(0)
    engine = infinity.initialize(tiny_gpt(), cfg)
    seen = []
    try:
        for step in range(6):
            for micro in range(2):
                x, y = batch(step, micro, 0)
                engine.backward(engine(x, y))
                engine.step()
            seen.append(engine.get_lr()[0])
    finally:
        engine.close()
    # The oracle: the same schedule on a plain optimizer, stepped once per optimizer step
    # (not per micro-batch: accumulation 2 must not double the schedule's pace).
    from infinity.optim.lr_schedules import WarmupLR

    plain = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = WarmupLR(
        plain, warmup_min_lr=0.0, warmup_max_lr=1e-3, warmup_num_steps=4, warmup_type="linear"
    )
    expected = []
    for _ in range(6):
        plain.step()
        sched.step()
        expected.append(plain.param_groups[0]["lr"])
    assert seen == pytest.approx(expected) and seen[-1] == pytest.approx(1e-3)
    assert engine.global_steps == 6 and engine.micro_steps == 12
