"""The bf16/fp16 copy written in the step equals torch's .to(dtype), bit for bit, edge cases included."""

import pytest
import torch
from adam_helpers import bits

from infinity.optim import AdamHyper, adam_step

BF16, F16 = torch.bfloat16, torch.float16


def _hyper(lr: float) -> AdamHyper:
    return AdamHyper(lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True)


def _copy_through_step(values: torch.Tensor, half: torch.dtype, grad_dtype=torch.float32):
    """A step with lr = 0 leaves param as it is (NaNs made quiet), so out_half is its conversion."""
    p = values.clone()
    g = torch.ones(p.numel(), dtype=grad_dtype)
    out = torch.empty(p.numel(), dtype=half)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    adam_step(p, g, m, v, _hyper(lr=0.0), step=1, out_half=out)
    return p, out


def _assert_same_conversion(p: torch.Tensor, out: torch.Tensor, half: torch.dtype):
    expected = p.to(half)
    nan = expected.isnan()
    assert torch.equal(out.isnan(), nan), "NaN must stay NaN (and nothing else may become NaN)"
    assert torch.equal(bits(out)[~nan], bits(expected)[~nan])


@pytest.mark.parametrize("half", [BF16, F16], ids=str)
def test_every_fp32_bit_pattern_class(isa, half, copy_mode):
    """2^20 random fp32 bit patterns: normals, subnormals, ties, infs, NaNs with payloads, both signs."""
    gen = torch.Generator().manual_seed(5)
    values = (
        torch.randint(-(2**31), 2**31, (1 << 20,), dtype=torch.int64, generator=gen)
        .to(torch.int32)
        .view(torch.float32)
    )
    p, out = _copy_through_step(values, half)
    finite = values.isfinite() | values.isinf()
    assert torch.equal(bits(p)[finite], bits(values)[finite]), (
        "lr=0 must leave non-NaN params untouched"
    )
    _assert_same_conversion(p, out, half)


def _edges() -> torch.Tensor:
    tiny = torch.finfo(torch.float32).tiny
    vals = [
        0.0,
        -0.0,
        1.0,
        -1.0,
        float("inf"),
        float("-inf"),
        float("nan"),
        -float("nan"),
        65504.0,
        65519.99,
        65520.0,
        65536.0,
        1e10,
        -65520.0,  # fp16 max, rounding to inf
        2.0**-14,
        2.0**-14 * (1 - 2**-11),
        2.0**-24,
        2.0**-25,
        2.0**-25 * (1 + 2**-20),  # fp16 subnormals
        3 * 2.0**-26,
        2.0**-26,
        1e-30,
        tiny,
        tiny / 3,
        -tiny / 7,  # ties and fp32 subnormals
        torch.finfo(torch.float32).max,
        -torch.finfo(torch.float32).max,
        3.3895314e38,  # bf16 overflow
    ]
    t = torch.tensor(vals, dtype=torch.float32)
    # bf16 ties: 1 + k*2^-8 + 2^-9 (exactly halfway) for even and odd k, and one ulp above/below
    ties = torch.tensor(
        [0x3F808000, 0x3F818000, 0x3F808001, 0x3F817FFF, 0x7F7F8000, 0x00008000, 0x80018000],
        dtype=torch.int64,
    )
    return torch.cat([t, ties.to(torch.int32).view(torch.float32)])


@pytest.mark.parametrize("half", [BF16, F16], ids=str)
def test_edge_values(isa, half, copy_mode):
    values = _edges()
    p, out = _copy_through_step(values, half)
    _assert_same_conversion(p, out, half)
    assert out.isinf().sum() >= 2


@pytest.mark.parametrize("grad_dtype", [BF16, F16], ids=str)
def test_half_gradients_are_read_exactly(isa, grad_dtype):
    """Every 16-bit gradient pattern (all 65536) is widened like torch's .float(): same step as an fp32 grad."""
    g16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(grad_dtype)
    n = g16.numel()
    results = []
    for g in (g16, g16.float()):
        p, m, v = torch.ones(n), torch.zeros(n), torch.zeros(n)
        adam_step(p, g, m, v, _hyper(lr=1e-3), step=1)
        results.append((p, m, v))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a.isnan(), b.isnan())
        assert torch.equal(bits(a)[~a.isnan()], bits(b)[~b.isnan()])


@pytest.mark.parametrize("offset", [0, 1, 7, 16, 33])
def test_copy_into_unaligned_views(isa, copy_mode, offset):
    """out_half may start anywhere: streamed stores need alignment, reached element by element."""
    n = 1000
    values = torch.randn(n)
    buffer = torch.full((n + 64,), -7.0, dtype=BF16)
    out = buffer[offset : offset + n]
    p, g, m, v = values.clone(), torch.randn(n), torch.zeros(n), torch.zeros(n)
    adam_step(p, g, m, v, _hyper(lr=1e-2), step=1, out_half=out)
    assert torch.equal(bits(out), bits(p.to(BF16)))
    untouched = torch.cat([buffer[:offset], buffer[offset + n :]])
    assert bool((untouched == -7.0).all()), "nothing outside out_half is written"
