"""Plain PyTorch training of the Hugging Face models: the oracles of tests/hf.

The same rules as tests/engine/reference.py (its constants, its notes on eps and
on a 16-bit oracle that does not depend on the CPU), for models called with
keyword batches (``model(**batch).loss``). Every training step is followed by an
eval forward under ``torch.no_grad()`` in ``eval()`` mode, as a user evaluates
between steps.
"""

from __future__ import annotations

import torch

from infinity.zero.cpu_linear import Fp32Linears
from tests.engine.reference import (
    BETAS,
    CLIP,
    EPS,
    LR,
    WD,
    CorrectlyRoundedSqrt,
    clip_in_float64,
    trainable_adamw,
    update,
)
from tests.hf.models import batch, build

EVAL_STEP = 99  # the eval batch's seed offset


def eval_loss(forward, arch: str, step: int) -> float:
    with torch.no_grad():
        return forward(**batch(arch, EVAL_STEP + step)).loss.item()


def plain_run(arch: str, *, steps: int) -> dict:
    """Per-step training and eval losses of torch AdamW (foreach=False) with clipping, fp32."""
    model = build(arch)
    model.train()
    opt = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False
    )
    losses = {}
    for step in range(steps):
        loss = model(**batch(arch, step)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses[step] = loss.item()
        model.eval()
        losses[(step, "eval")] = eval_loss(model, arch, step)
        model.train()
    return losses


def mixed_run(
    arch: str, dtype: torch.dtype, *, steps: int, rounded_start: bool = False
) -> tuple[dict, dict]:
    """Mixed precision by hand: the parameters in ``dtype`` for forward and backward (buffers as the
    model made them, as the engine leaves them), fp32 masters stepped by torch AdamW with a correctly
    rounded sqrt, the clip norm in float64 (tests/engine/reference.py [Note: a 16-bit oracle that does
    not depend on the CPU]; its 16-bit linears multiply as the engine's on this CPU). The masters start from the fp32 weights as built, or with
    ``rounded_start`` from the ``dtype`` weights, widened (DeepSpeed's optimizer over a model built in
    16 bits). Returns the losses and the final masters by name."""
    model = build(arch)
    model.train()
    names = [n for n, _ in model.named_parameters()]
    for p in model.parameters() if rounded_start else ():
        p.data = p.data.to(dtype)
    masters = [p.detach().clone().float().requires_grad_(True) for p in model.parameters()]
    for p in model.parameters():
        p.data = p.data.to(dtype)
    Fp32Linears(model).install()
    opt = torch.optim.AdamW(masters, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    losses = {}
    for step in range(steps):
        loss = model(**batch(arch, step)).loss
        loss.backward()
        for m, p in zip(masters, model.parameters(), strict=True):
            m.grad = p.grad.float() if p.grad is not None else None
            p.grad = None
        clip_in_float64(masters, CLIP)
        with CorrectlyRoundedSqrt():
            opt.step()
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters, strict=True):
                p.copy_(m)
        losses[step] = loss.item()
        model.eval()
        losses[(step, "eval")] = eval_loss(model, arch, step)
        model.train()
    return losses, {n: m.detach().clone() for n, m in zip(names, masters, strict=True)}


def plain_train(model: torch.nn.Module, arch: str, *, steps: int) -> list[float]:
    """Trains ``model`` in place for ``steps`` of plain_run's training (torch AdamW, foreach=False,
    clipping; no eval forwards), each forward after ``torch.manual_seed(step)``; only parameters with
    requires_grad train. Returns each step's loss."""
    model.train()
    opt = trainable_adamw(model)
    losses = []
    for step in range(steps):
        torch.manual_seed(step)
        loss = model(**batch(arch, step)).loss
        loss.backward()
        update(model, opt)
        losses.append(loss.item())
    return losses
