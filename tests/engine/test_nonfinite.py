"""A step whose loss or gradient norm is inf or NaN ([Note: non-finite steps] in infinity/engine/engine.py).

With ``"skip_nonfinite_steps": true`` such a step changes nothing (parameters, optimizer state, lr
schedule) and training goes on as plain PyTorch does when that step is left out; without it the
step is applied, as in torch, and a warning names the step, the norm and the loss.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

import infinity
from infinity.config import describe_config
from infinity.zero.gathered import GatheredParameters
from tests.engine.models import batch, tiny_gpt
from tests.engine.reference import BETAS, CLIP, EPS, LR, WD, engine_config

LAYOUTS = [(0, "none", "none"), (2, "none", "nvme"), (3, "nvme", "nvme")]
STEPS, BAD = 4, 1
# What the injection does to the loss of step BAD: "inf" and "nan" make every gradient non-finite,
# "nan_loss" only the loss (a NaN constant added: the gradients stay finite).
INJECT = {
    "inf": lambda loss: loss * float("inf"),
    "nan": lambda loss: loss * float("nan"),
    "nan_loss": lambda loss: loss + torch.tensor(float("nan")),
}


def schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))


def layout_id(layout) -> str:
    return layout if isinstance(layout, str) else "stage{}-param_{}-optim_{}".format(*layout)


def oracle(steps, make_optimizer):
    """Plain PyTorch over the given steps (the skipped one left out: no update, no schedule step)."""
    torch.manual_seed(0)
    model = tiny_gpt()
    opt = make_optimizer(model.parameters())
    sched = schedule(opt)
    for step in steps:
        model(*batch(step, 0, 0)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def weights_of(engine):
    with GatheredParameters(engine):
        return {n: p.detach().clone().float() for n, p in engine.module.named_parameters()}


def train(layout, nvme, *, precision="fp32", inject="nan", skip=True):
    """STEPS steps with the loss of step BAD made non-finite; the weights after each step."""
    passthrough = layout == "passthrough"
    cfg = engine_config(*((0, "none", "none") if passthrough else layout), nvme, gas=1)
    if passthrough:
        del cfg["optimizer"]
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    if skip:
        cfg["skip_nonfinite_steps"] = True
    torch.manual_seed(0)
    model = tiny_gpt()
    engine = infinity.initialize(
        model,
        cfg,
        optimizer=sgd(model.parameters()) if passthrough else None,
        lr_scheduler=schedule,
    )
    after = []
    try:
        for step in range(STEPS):
            loss = engine(*batch(step, 0, 0))
            if step == BAD:
                loss = INJECT[inject](loss)
            engine.backward(loss)
            engine.step()
            after.append(weights_of(engine))
        counters = engine.skipped_steps, engine.global_steps, engine.get_lr()
    finally:
        engine.close()
    return after, counters


def assert_close(got, want):
    for n, ref in want.items():
        err = (got[n] - ref).abs().max().item() / ref.abs().max().item()
        assert err < 1e-5, f"{n}: relative difference {err:.2e}"


@pytest.mark.parametrize("inject", list(INJECT))
@pytest.mark.parametrize("layout", [*LAYOUTS, "passthrough"], ids=layout_id)
def test_opt_in_skips_the_step_and_training_goes_on(layout, inject, nvme_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="infinity.engine"):
        after, (skipped, global_steps, lr) = train(layout, nvme_dir, inject=inject)
    for n, w in after[BAD].items():
        assert torch.equal(w, after[BAD - 1][n]), f"{n} moved on the skipped step"
    make = sgd if layout == "passthrough" else adamw
    assert_close(after[-1], oracle([s for s in range(STEPS) if s != BAD], make))
    assert skipped == 1 and global_steps == STEPS
    base = 0.1 if layout == "passthrough" else LR
    assert lr == [pytest.approx(base / STEPS)]  # the schedule stepped 3 times, not 4
    warned = [r.getMessage() for r in caplog.records if "skip_nonfinite_steps" in r.getMessage()]
    assert len(warned) == 1, warned
    assert warned[0].startswith(f"step {BAD}: gradient norm ")
    assert "step skipped" in warned[0]
    if inject == "nan_loss":
        assert "loss nan at micro-step 1" in warned[0]


@pytest.mark.parametrize("layout", [(2, "none", "nvme"), (3, "nvme", "nvme")], ids=layout_id)
def test_opt_in_skips_the_step_in_bf16(layout, nvme_dir):
    after, (skipped, _, _) = train(layout, nvme_dir, precision="bf16", inject="inf")
    for n, w in after[BAD].items():
        assert torch.equal(w, after[BAD - 1][n]), f"{n} moved on the skipped step"
        assert not torch.equal(after[-1][n], w) or n.endswith("bias"), f"{n} stopped training"
        assert torch.isfinite(after[-1][n]).all(), n
    assert skipped == 1


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_without_opt_in_a_warning_names_the_step(layout, precision, nvme_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="infinity.engine"):
        after, (skipped, _, _) = train(
            layout, nvme_dir, precision=precision, inject="nan", skip=False
        )
    warned = [r.getMessage() for r in caplog.records if "skip_nonfinite_steps" in r.getMessage()]
    # once per step: the NaN weights keep every later step's norm NaN too
    assert [w.partition(":")[0] for w in warned] == [f"step {s}" for s in range(BAD, STEPS)], warned
    assert warned[0].startswith(
        f"step {BAD}: gradient norm nan, loss nan at micro-step {BAD}: the update applies it"
    )
    assert 'Set "skip_nonfinite_steps": true' in warned[0]
    assert skipped == 0
    assert any(not torch.isfinite(w).all() for w in after[BAD].values())  # as in torch: applied


def test_the_key_is_read_and_refused_when_not_a_bool():
    from infinity.config import ConfigError, load_config

    assert load_config({}).skip_nonfinite_steps is False
    cfg = load_config({"skip_nonfinite_steps": True})
    assert cfg.skip_nonfinite_steps is True and cfg.to_dict()["skip_nonfinite_steps"] is True
    assert "non-finite steps skipped" in describe_config(cfg)
    with pytest.raises(
        ConfigError, match="^skip_nonfinite_steps must be true or false; got 'yes'$"
    ):
        load_config({"skip_nonfinite_steps": "yes"})
    assert math.isfinite(LR)
