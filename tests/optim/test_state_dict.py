"""CPUAdam's state dict is torch's layout: checkpoints move both ways between CPUAdam and torch.optim."""

import copy

import pytest
import torch
from adam_helpers import assert_adam_close

from infinity.optim import CPUAdam

TORCH = {True: torch.optim.AdamW, False: torch.optim.Adam}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(9, 17), torch.nn.ReLU(), torch.nn.Linear(17, 3))


def _groups(model):
    return [
        {"params": model[0].parameters()},
        {"params": model[2].parameters(), "lr": 5e-3, "weight_decay": 0.2},
    ]


def _train(model, opt, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        loss = model(torch.randn(8, 9, generator=gen)).square().mean()
        loss.backward()
        opt.step()


@pytest.mark.parametrize("adamw", [True, False], ids=["AdamW", "Adam"])
@pytest.mark.parametrize("direction", ["torch->ours", "ours->torch"])
def test_switch_mid_training(adamw, direction):
    """Train 5 steps with one optimizer, load its state into the other, train 5 more: same as 10 with torch."""
    ref = _model()
    ref_opt = TORCH[adamw](_groups(ref), lr=1e-3, weight_decay=0.01, foreach=False)
    _train(ref, ref_opt, 5, seed=1)
    _train(ref, ref_opt, 5, seed=2)

    model = _model()
    make_ours = lambda: CPUAdam(_groups(model), lr=1e-3, weight_decay=0.01, adamw_mode=adamw)  # noqa: E731
    make_torch = lambda: TORCH[adamw](_groups(model), lr=1e-3, weight_decay=0.01, foreach=False)  # noqa: E731
    first, second = (
        (make_torch, make_ours) if direction == "torch->ours" else (make_ours, make_torch)
    )
    opt1 = first()
    _train(model, opt1, 5, seed=1)
    saved = copy.deepcopy(opt1.state_dict())
    opt2 = second()
    opt2.load_state_dict(saved)
    _train(model, opt2, 5, seed=2)

    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert_adam_close(p.detach(), q.detach())
        assert opt2.state[p]["step"].item() == 10
        assert_adam_close(opt2.state[p]["exp_avg"], ref_opt.state[q]["exp_avg"])
        assert_adam_close(opt2.state[p]["exp_avg_sq"], ref_opt.state[q]["exp_avg_sq"])
    if isinstance(opt2, CPUAdam):
        assert all(g["decoupled_weight_decay"] is adamw for g in opt2.param_groups)
        assert [g["lr"] for g in opt2.param_groups] == [1e-3, 5e-3]


def test_state_dict_without_the_new_keys_keeps_this_optimizers_mode():
    """A group saved without decoupled_weight_decay/bias_correction (older torch) keeps the constructed mode."""
    model = _model()
    opt = CPUAdam(model.parameters(), adamw_mode=False)
    _train(model, opt, 2, seed=3)
    saved = opt.state_dict()
    for group in saved["param_groups"]:
        del group["decoupled_weight_decay"], group["bias_correction"]
    fresh = CPUAdam(model.parameters(), adamw_mode=False, bias_correction=False)
    fresh.load_state_dict(saved)
    assert fresh.param_groups[0]["decoupled_weight_decay"] is False
    assert fresh.param_groups[0]["bias_correction"] is False


def test_refuses_state_it_cannot_continue():
    model = _model()
    torch_opt = torch.optim.AdamW(model.parameters(), amsgrad=True)
    _train(model, torch_opt, 1, seed=4)
    with pytest.raises(
        ValueError, match=r"param group 0 has amsgrad=True, which CPUAdam does not implement"
    ):
        CPUAdam(model.parameters()).load_state_dict(torch_opt.state_dict())
    with pytest.raises(ValueError, match=r"the state dict has 1 param groups, this optimizer 2"):
        CPUAdam(_groups(model)).load_state_dict(torch_opt.state_dict())


def test_loaded_state_is_made_contiguous():
    w = torch.nn.Parameter(torch.randn(4, 6))
    opt = CPUAdam([w])
    w.grad = torch.randn(4, 6)
    opt.step()
    saved = opt.state_dict()
    for key in ("exp_avg", "exp_avg_sq"):
        saved["state"][0][key] = (
            saved["state"][0][key].t().contiguous().t()
        )  # same values, column-major
    opt.load_state_dict(saved)
    assert all(opt.state[w][k].is_contiguous() for k in ("exp_avg", "exp_avg_sq"))
    opt.step()


@pytest.mark.parametrize(
    "make_step", [lambda: 3, lambda: torch.tensor(3.0, dtype=torch.float64)], ids=["int", "float64"]
)
def test_old_and_double_step_counts(make_step):
    """Step counts saved as ints (old checkpoints) or fp64 tensors (default dtype double) continue the count."""
    model, ref = _model(), _model()
    opt = CPUAdam(model.parameters())
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False)
    _train(model, opt, 3, seed=5)
    _train(ref, ref_opt, 3, seed=5)
    saved = opt.state_dict()
    for s in saved["state"].values():
        s["step"] = make_step()
    opt.load_state_dict(saved)
    _train(model, opt, 2, seed=6)
    _train(ref, ref_opt, 2, seed=6)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert float(opt.state[p]["step"]) == 5
        assert_adam_close(p.detach(), q.detach())
