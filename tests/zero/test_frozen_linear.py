"""The fp32 path of frozen 16-bit Linear layers on the CPU ([Note: frozen 16-bit Linear on the CPU]):
its output and input gradient against an fp64 oracle, within one rounding to the dtype plus fp32
accumulation error, as torch's own 16-bit kernel; which modules it is installed on, and removal."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from infinity.zero import frozen_linear
from infinity.zero.frozen_linear import FrozenLinears, _Fp32FrozenLinear


def _bound(exact: torch.Tensor, terms: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """One rounding to ``dtype`` (an ulp: round to nearest is half, the other half covers the
    exact value landing near a tie) plus fp32 summation of ``k`` terms of magnitude ``terms``."""
    ulp = torch.finfo(dtype).eps * exact.abs()
    return ulp + 2 * k * torch.finfo(torch.float32).eps * terms + torch.finfo(dtype).tiny


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.integers(1, 9),
    rows=st.integers(1, 40),
    cols=st.integers(1, 40),
    bias=st.booleans(),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    block=st.sampled_from([1, 7, 64, 8 << 20]),
    seed=st.integers(0, 2**16),
)
def test_forward_and_input_grad_within_one_rounding(tokens, rows, cols, bias, dtype, block, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, cols, generator=g).to(dtype).requires_grad_()
    w = torch.randn(rows, cols, generator=g).to(dtype)
    b = torch.randn(rows, generator=g).to(dtype) if bias else None
    grad = torch.randn(tokens, rows, generator=g).to(dtype)
    old = frozen_linear._BLOCK_ELEMENTS
    frozen_linear._BLOCK_ELEMENTS = block  # blocks of rows: 1 element per block is one row
    try:
        y = _Fp32FrozenLinear.apply(x, w, b)
        (gx,) = torch.autograd.grad(y, x, grad)
    finally:
        frozen_linear._BLOCK_ELEMENTS = old
    assert y.dtype == dtype and gx.dtype == dtype
    x64, w64 = x.detach().double(), w.double()
    exact = x64 @ w64.T + (0 if b is None else b.double())
    terms = x64.abs() @ w64.abs().T + (0 if b is None else b.double().abs())
    assert ((y.double() - exact).abs() <= _bound(exact, terms, cols + 1, dtype)).all()
    exact_gx = grad.double() @ w64
    terms_gx = grad.double().abs() @ w64.abs()
    assert ((gx.double() - exact_gx).abs() <= _bound(exact_gx, terms_gx, rows, dtype)).all()


def _model(dtype):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(dtype)
    m[0].requires_grad_(False)  # frozen; m[2] trains
    return m


def test_installed_on_frozen_linears_only_and_removed(monkeypatch):
    monkeypatch.setattr(frozen_linear, "cpu_lacks_16bit_matmul", lambda dtype: True)
    m = _model(torch.bfloat16)
    linears = FrozenLinears(m)
    linears.install()
    assert "forward" in vars(m[0]) and "forward" not in vars(m[2])
    x = torch.randn(3, 8, dtype=torch.bfloat16, requires_grad=True)
    m(x).float().sum().backward()
    assert m[2].weight.grad is not None and m[0].weight.grad is None
    assert x.grad is not None
    linears.remove()
    assert "forward" not in vars(m[0])


def test_fp32_input_and_trainable_weights_take_torch_path(monkeypatch):
    monkeypatch.setattr(frozen_linear, "cpu_lacks_16bit_matmul", lambda dtype: True)
    calls = []
    monkeypatch.setattr(
        _Fp32FrozenLinear, "apply", staticmethod(lambda *a: calls.append(a) or None)
    )
    m = _model(torch.float32)
    FrozenLinears(m).install()
    m(torch.randn(2, 8))
    assert calls == []  # fp32 weights: F.linear as the module would


def test_not_installed_where_the_cpu_has_16bit_matmul(monkeypatch):
    monkeypatch.setattr(frozen_linear, "cpu_lacks_16bit_matmul", lambda dtype: False)
    m = _model(torch.bfloat16)
    FrozenLinears(m).install()
    assert "forward" not in vars(m[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_probe_answers_for_16bit_dtypes(dtype):
    assert isinstance(frozen_linear.cpu_lacks_16bit_matmul(dtype), bool)
