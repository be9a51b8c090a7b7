"""CPU Adam equals torch.optim.AdamW / Adam (foreach=False) over 100 steps."""

import pytest
import torch
from adam_helpers import assert_adam_close, bits

from infinity.optim import AdamHyper, CPUAdam, adam_step

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    # Odd sizes: no tensor is a multiple of the vector width.
    return torch.nn.Sequential(torch.nn.Linear(13, 37), torch.nn.Tanh(), torch.nn.Linear(37, 5))


def _groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    first, second = model[0], model[2]
    return [
        {"params": [first.weight, first.bias]},
        {
            "params": [second.weight, second.bias],
            "lr": 3e-3,
            "weight_decay": 2 * weight_decay,
            "betas": (0.8, 0.99),
            "eps": 1e-6,
        },
    ]


@pytest.mark.parametrize("adamw", [True, False], ids=["AdamW", "Adam"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_cpu_adam_trains_like_torch(isa, adamw, weight_decay):
    """A small MLP trained 100 steps: same losses, weights and moments as torch's optimizer."""
    ours, ref = _mlp(0), _mlp(0)
    opt = CPUAdam(_groups(ours, weight_decay), lr=1e-3, weight_decay=weight_decay, adamw_mode=adamw)
    ref_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    ref_opt = ref_cls(_groups(ref, weight_decay), lr=1e-3, weight_decay=weight_decay, foreach=False)
    data = torch.Generator().manual_seed(1)
    for _ in range(100):
        x = torch.randn(16, 13, generator=data)
        y = torch.randn(16, 5, generator=data)
        losses = []
        for model, optimizer in ((ours, opt), (ref, ref_opt)):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
        assert_adam_close(p.detach(), q.detach())
        s, r = opt.state[p], ref_opt.state[q]
        assert s["step"].item() == r["step"].item() == 100
        assert_adam_close(s["exp_avg"], r["exp_avg"])
        assert_adam_close(s["exp_avg_sq"], r["exp_avg_sq"])


@pytest.mark.parametrize("grad_dtype", [F32, BF16, F16], ids=str)
@pytest.mark.parametrize("half", [None, BF16, F16], ids=str)
@pytest.mark.parametrize("adamw", [True, False], ids=["AdamW", "Adam"])
def test_adam_step_matches_torch(isa, grad_dtype, half, adamw):
    """The flat entry point on 1031 elements, 100 steps; the 16-bit copy is param.to(dtype) every step."""
    n, lr, betas, eps, wd = 1031, 2e-3, (0.9, 0.995), 1e-8, 0.05
    gen = torch.Generator().manual_seed(2)
    param = torch.randn(n, generator=gen)
    ref = torch.nn.Parameter(param.clone())
    ref_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    ref_opt = ref_cls([ref], lr=lr, betas=betas, eps=eps, weight_decay=wd, foreach=False)
    exp_avg, exp_avg_sq = torch.zeros(n), torch.zeros(n)
    out = None if half is None else torch.empty(n, dtype=half)
    hyper = AdamHyper(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=wd, adamw=adamw)
    for step in range(1, 101):
        grad = (torch.randn(n, generator=gen) * 0.1).to(grad_dtype)
        ref.grad = grad.float()  # the reference sees the same values (16-bit to fp32 is exact)
        ref_opt.step()
        adam_step(param, grad, exp_avg, exp_avg_sq, hyper, step=step, out_half=out)
        if out is not None:
            assert torch.equal(bits(out), bits(param.to(half)))
    assert_adam_close(param, ref.detach())
    assert_adam_close(exp_avg, ref_opt.state[ref]["exp_avg"])
    assert_adam_close(exp_avg_sq, ref_opt.state[ref]["exp_avg_sq"])


def test_bias_correction_off_matches_the_formula(isa):
    """bias_correction=False (DeepSpeed's option; torch has none): checked against the formula in fp64."""
    n, lr, b1, b2, eps, wd = 333, 1e-2, 0.9, 0.99, 1e-8, 0.1
    gen = torch.Generator().manual_seed(3)
    p, m, v = torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)
    p64, m64, v64 = p.double(), m.double(), v.double()
    hyper = AdamHyper(
        lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd, adamw=True, bias_correction=False
    )
    for step in range(1, 21):
        g = torch.randn(n, generator=gen)
        adam_step(p, g, m, v, hyper, step=step)
        g64 = g.double()
        p64 = p64 * (1 - lr * wd)
        m64 = b1 * m64 + (1 - b1) * g64
        v64 = b2 * v64 + (1 - b2) * g64 * g64
        p64 = p64 - lr * m64 / (v64.sqrt() + eps)
    torch.testing.assert_close(p, p64.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m, m64.float(), rtol=1e-5, atol=1e-7)


def test_nan_and_inf_propagate_like_torch(isa):
    """Non-finite gradients (and params) give the same NaN/inf pattern as torch's optimizer."""
    n = 40
    gen = torch.Generator().manual_seed(4)
    for adamw in (True, False):
        param = torch.randn(n, generator=gen)
        param[[1, 17]] = torch.tensor([float("inf"), float("-inf")])
        ref = torch.nn.Parameter(param.clone())
        ref_opt = (torch.optim.AdamW if adamw else torch.optim.Adam)(
            [ref], lr=1e-3, weight_decay=0.1, foreach=False
        )
        m, v = torch.zeros(n), torch.zeros(n)
        out = torch.empty(n, dtype=BF16)
        hyper = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=adamw)
        for step in range(1, 4):
            grad = torch.randn(n, generator=gen)
            grad[[3, 20, 33]] = torch.tensor([float("nan"), float("inf"), float("-inf")])
            if step == 2:
                grad[5] = float("nan")
            ref.grad = grad.clone()
            ref_opt.step()
            adam_step(param, grad, m, v, hyper, step=step, out_half=out)
        state = ref_opt.state[ref]
        for ours, theirs in (
            (param, ref.detach()),
            (m, state["exp_avg"]),
            (v, state["exp_avg_sq"]),
        ):
            assert torch.equal(ours.isnan(), theirs.isnan())
            assert torch.equal(ours.isinf(), theirs.isinf())
            assert_adam_close(ours, theirs)
        assert torch.equal(out.isnan(), param.isnan())
        assert param.isnan().any() and param.isfinite().any()


def test_parameters_that_skip_steps(isa):
    """A parameter without a gradient is not stepped, so step counts diverge: each keeps its own, as in torch."""
    gen = torch.Generator().manual_seed(6)
    init = [
        torch.randn(50, generator=gen),
        torch.randn(7, generator=gen),
        torch.randn(300, generator=gen),
    ]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    opt = CPUAdam(ours, lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(20):
        for i, (p, q) in enumerate(zip(ours, ref, strict=True)):
            has_grad = i == 0 or (i == 1 and step % 2 == 0) or (i == 2 and step % 3 == 1)
            g = torch.randn(p.shape, generator=gen) if has_grad else None
            p.grad, q.grad = g, None if g is None else g.clone()
        opt.step()
        ref_opt.step()
    assert [opt.state[p]["step"].item() for p in ours] == [20, 10, 7]
    for p, q in zip(ours, ref, strict=True):
        assert_adam_close(p.detach(), q.detach())
