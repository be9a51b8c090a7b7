"""The fp32 path of 16-bit Linear layers on the CPU ([Note: 16-bit Linear on the CPU]): its output
and its input, weight and bias gradients against an fp64 oracle, within one rounding to the dtype
plus fp32 accumulation error, as torch's own 16-bit kernel; which modules it is installed on, the
same training as ``F.linear``'s, and removal."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from infinity.zero import cpu_linear
from infinity.zero.cpu_linear import Fp32Linears, _Fp32Linear


def _bound(exact: torch.Tensor, terms: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """One rounding to ``dtype`` (an ulp: round to nearest is half, the other half covers the
    exact value landing near a tie) plus fp32 summation of ``k`` terms of magnitude ``terms``."""
    ulp = torch.finfo(dtype).eps * exact.abs()
    return ulp + 2 * k * torch.finfo(torch.float32).eps * terms + torch.finfo(dtype).tiny


def _within(got: torch.Tensor, exact: torch.Tensor, terms: torch.Tensor, k: int, dtype) -> bool:
    return bool(((got.double() - exact).abs() <= _bound(exact, terms, k, dtype)).all())


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.integers(1, 9),
    rows=st.integers(1, 40),
    cols=st.integers(1, 40),
    bias=st.booleans(),
    trainable=st.booleans(),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    block=st.sampled_from([1, 7, 64, 8 << 20]),
    seed=st.integers(0, 2**16),
)
def test_output_and_gradients_within_one_rounding(
    tokens, rows, cols, bias, trainable, dtype, block, seed
):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, tokens, cols, generator=g).to(dtype).requires_grad_()
    w = torch.randn(rows, cols, generator=g).to(dtype).requires_grad_(trainable)
    b = torch.randn(rows, generator=g).to(dtype).requires_grad_(trainable) if bias else None
    grad = torch.randn(2, tokens, rows, generator=g).to(dtype)
    old = cpu_linear._BLOCK_ELEMENTS
    cpu_linear._BLOCK_ELEMENTS = block  # blocks of rows: 1 element per block is one row
    try:
        y = _Fp32Linear.apply(x, w, b)
        wrt = [x] + ([w] + ([b] if bias else []) if trainable else [])
        gx, *gparams = torch.autograd.grad(y, wrt, grad)
    finally:
        cpu_linear._BLOCK_ELEMENTS = old
    assert y.dtype == dtype and gx.dtype == dtype
    x64, w64, g64 = x.detach().double(), w.detach().double(), grad.double()
    b64 = None if b is None else b.detach().double()
    exact = x64 @ w64.T + (0 if b64 is None else b64)
    terms = x64.abs() @ w64.abs().T + (0 if b64 is None else b64.abs())
    assert _within(y, exact, terms, cols + 1, dtype)
    assert _within(gx, g64 @ w64, g64.abs() @ w64.abs(), rows, dtype)
    if trainable:
        g2, x2 = g64.reshape(-1, rows), x64.reshape(-1, cols)
        assert gparams[0].dtype == dtype
        assert _within(gparams[0], g2.T @ x2, g2.abs().T @ x2.abs(), 2 * tokens, dtype)
        if bias:
            assert _within(gparams[1], g2.sum(0), g2.abs().sum(0), 2 * tokens, dtype)


def _model(dtype):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(dtype)
    m[0].requires_grad_(False)  # frozen; m[2] trains
    return m


def test_installed_on_every_linear_and_removed(monkeypatch):
    monkeypatch.setattr(cpu_linear, "cpu_lacks_16bit_matmul", lambda dtype: True)
    m = _model(torch.bfloat16)
    linears = Fp32Linears(m)
    linears.install()
    assert "forward" in vars(m[0]) and "forward" in vars(m[2])
    x = torch.randn(3, 8, dtype=torch.bfloat16, requires_grad=True)
    m(x).float().sum().backward()
    assert m[2].weight.grad is not None and m[2].bias.grad is not None
    assert m[0].weight.grad is None
    assert x.grad is not None
    linears.remove()
    assert "forward" not in vars(m[0]) and "forward" not in vars(m[2])


def test_trains_as_f_linear_does(monkeypatch):
    """A few SGD steps of a bf16 MLP (one frozen layer, one trainable) with the fp32 path and with
    torch's own kernel, in fp32 as the oracle for both: the paths differ only in the order of fp32
    additions, so each stays within the bf16 rounding of the fp32 run that torch's does."""
    monkeypatch.setattr(cpu_linear, "cpu_lacks_16bit_matmul", lambda dtype: True)

    def train(dtype, fp32_path):
        m = _model(dtype)
        if fp32_path:
            Fp32Linears(m).install()
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randn(5, 8, generator=g).to(dtype)
            loss = m(x).float().square().mean()
            loss.backward()
            with torch.no_grad():
                for p in m.parameters():
                    if p.grad is not None:
                        p -= 0.1 * p.grad
                        p.grad = None
        return m[2].weight.detach().float()

    oracle = train(torch.float32, False)
    ours, torchs = train(torch.bfloat16, True), train(torch.bfloat16, False)
    tol = 8 * torch.finfo(torch.bfloat16).eps * oracle.abs().max()
    assert (ours - oracle).abs().max() <= tol
    assert (torchs - oracle).abs().max() <= tol


def test_fp32_layers_take_torch_path(monkeypatch):
    monkeypatch.setattr(cpu_linear, "cpu_lacks_16bit_matmul", lambda dtype: True)
    calls = []
    monkeypatch.setattr(_Fp32Linear, "apply", staticmethod(lambda *a: calls.append(a) or None))
    m = _model(torch.float32)
    Fp32Linears(m).install()
    m(torch.randn(2, 8))
    assert calls == []  # fp32 weights: F.linear as the module would
    assert "forward" not in vars(m[0])  # an fp32 run's linears keep a plain call


def test_a_16bit_run_installs_on_linears_built_in_fp32(monkeypatch):
    """The engine casts to the training dtype after building: the config's dtype decides too."""
    monkeypatch.setattr(cpu_linear, "cpu_lacks_16bit_matmul", lambda dtype: True)
    m = _model(torch.float32)
    Fp32Linears(m, train_dtype=torch.bfloat16).install()
    assert "forward" in vars(m[0]) and "forward" in vars(m[2])


def test_not_installed_where_the_cpu_has_16bit_matmul(monkeypatch):
    monkeypatch.setattr(cpu_linear, "cpu_lacks_16bit_matmul", lambda dtype: False)
    m = _model(torch.bfloat16)
    Fp32Linears(m).install()
    assert "forward" not in vars(m[0]) and "forward" not in vars(m[2])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_probe_answers_for_16bit_dtypes(dtype):
    assert isinstance(cpu_linear.cpu_lacks_16bit_matmul(dtype), bool)
