"""backward() / step() / zero_grad() in any order do what torch's loss.backward() / optimizer.step() /
optimizer.zero_grad() do ([Note: the training loop's call order] in infinity/engine/engine.py).

Each case is a script of calls run twice: through the engine at stages 0, 2 and 3 (NVMe), and on a
plain module with torch's AdamW, clip_grad_norm_ and an lr schedule (the oracle), where step() updates
at the accumulation boundary as DeepSpeed's does. Losses and final weights must agree (fp32, 1e-5).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import infinity
from infinity.zero.gathered import GatheredParameters
from tests.engine.models import VOCAB, batch
from tests.engine.reference import BETAS, CLIP, EPS, LR, WD, engine_config

LAYOUTS = [(0, "none", "none"), (2, "none", "nvme"), (3, "nvme", "nvme")]


class Failing(torch.autograd.Function):
    """The identity, whose backward raises when its model says so: what reached the parameters
    behind it (head, fc2) by then stays, what lies before it (fc1, emb) gets nothing."""

    @staticmethod
    def forward(ctx, x, model):
        ctx.model = model
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.model.fail_backward:
            raise RuntimeError("injected failure in backward")
        return grad, None


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 24)
        self.fc1 = nn.Linear(24, 48)
        self.fc2 = nn.Linear(48, 24)
        self.head = nn.Linear(24, VOCAB)
        self.fail_backward = False

    def forward(self, x, y):
        h = torch.tanh(self.fc1(self.emb(x)))
        h = torch.tanh(self.fc2(Failing.apply(h, self)))
        return F.cross_entropy(self.head(h).reshape(-1, VOCAB), y.reshape(-1))


def schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))


# Calls: ("b", i) backward of batch i; ("B", i) the same, raising midway; "s" step; "z" zero_grad.
SCRIPTS = {
    "two_backwards_then_step": (1, [("b", 0), ("b", 1), "s", ("b", 2), "s"]),
    "three_backwards_with_accumulation": (
        2,
        [("b", 0), ("b", 1), "s", ("b", 2), "s", ("b", 3), "s"],
    ),
    "step_without_backward": (1, [("b", 0), "s", "s", "s", ("b", 1), "s"]),
    "boundary_step_without_backward": (
        2,
        [("b", 0), "s", "s", "s", "s", ("b", 1), "s", ("b", 2), "s"],
    ),
    "backward_raises_then_step": (1, [("b", 0), ("B", 1), "s", ("b", 2), "s"]),
    "backward_raises_then_zero_grad": (1, [("b", 0), ("B", 1), "z", ("b", 2), "s", ("b", 3), "s"]),
    "backward_raises_mid_accumulation": (
        2,
        [("b", 0), "s", ("B", 1), ("b", 2), "s", ("b", 3), "s", ("b", 4), "s"],
    ),
}


def oracle(script, gas):
    torch.manual_seed(0)
    model = Chain()
    opt = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False
    )
    sched = schedule(opt)
    losses, micro = [], 0
    for call in script:
        if call == "s":
            if (micro + 1) % gas == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            micro += 1
        elif call == "z":
            opt.zero_grad(set_to_none=True)
        else:
            kind, i = call
            model.fail_backward = kind == "B"
            loss = model(*batch(i, 0, 0))
            losses.append(loss.item())
            try:
                (loss / gas).backward()
            except RuntimeError:
                assert kind == "B"
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def run(script, gas, layout, nvme, notes):
    cfg = engine_config(*layout, nvme, gas=gas)
    torch.manual_seed(0)
    model = Chain()
    engine = infinity.initialize(model, cfg, lr_scheduler=schedule)
    losses = []
    try:
        for call in script:
            if call == "s":
                engine.step()
            elif call == "z":
                engine.zero_grad()
            else:
                kind, i = call
                model.fail_backward = kind == "B"
                loss = engine(*batch(i, 0, 0))
                losses.append(loss.item())
                if kind == "b":
                    engine.backward(loss)
                    continue
                with pytest.raises(RuntimeError, match="injected failure in backward") as e:
                    engine.backward(loss)
                notes.append("\n".join(getattr(e.value, "__notes__", [])))
        with GatheredParameters(engine):
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        engine.close()
    return losses, weights


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda c: "stage{}-param_{}-optim_{}".format(*c))
@pytest.mark.parametrize("name", list(SCRIPTS))
def test_call_order_matches_torch(name, layout, nvme_dir, caplog):
    gas, script = SCRIPTS[name]
    notes: list[str] = []
    with caplog.at_level(logging.WARNING, logger="infinity.engine"):
        losses, weights = run(script, gas, layout, nvme_dir, notes)
    ref_losses, ref_weights = oracle(script, gas)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for n, ref in ref_weights.items():
        err = (weights[n] - ref).abs().max().item() / ref.abs().max().item()
        assert err < 1e-5, f"{n}: relative difference {err:.2e}"
    logged = [r.getMessage() for r in caplog.records if r.name == "infinity.engine"]
    no_backward = [m for m in logged if "no backward() since the last update" in m]
    assert len(no_backward) == {
        "step_without_backward": 2,
        "boundary_step_without_backward": 1,
    }.get(name, 0)
    if "raises" in name:
        assert len(notes) == 1
        assert "backward() raised at micro-step" in notes[0] and "the engine is usable" in notes[0]
        assert "keeps the 1 complete backward() call(s) before this one" in notes[0]
        assert "engine.zero_grad()" in notes[0]
        applied = [m for m in logged if "holds part of a backward() that raised" in m]
        assert len(applied) == (0 if name.endswith("zero_grad") else 1)
