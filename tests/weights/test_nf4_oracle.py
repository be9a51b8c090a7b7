"""NF4 against bitsandbytes (an implementation no one here wrote): ``nf4.quantize`` makes the bytes and
scales ``bitsandbytes.functional.quantize_4bit(..., quant_type="nf4")`` makes, and the kernel dequantises
bitsandbytes' own packed bytes to exactly what its ``dequantize_4bit`` gives, in fp32, bf16 and fp16, for
sizes with and without a shorter last group, and weights of any scale (an all-zero group too); with
double quantisation (``compress_statistics=True``) ``nf4.quantize_scales`` makes bitsandbytes' nested
state and the kernel gives its ``dequantize_4bit`` values; each ISA's kernel this CPU runs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from infinity import _adam
from infinity.optim import kernel
from infinity.weights import nf4

bnb = pytest.importorskip("bitsandbytes.functional")

CODES = {"scalar": _adam.SCALAR, "avx2": _adam.AVX2, "avx512": _adam.AVX512}
BLOCKSIZES = [32, 64, 128, 256]  # bitsandbytes takes powers of two from 32


def dequantize(codes, scales, n: int, group_size: int, dtype, isa: str) -> torch.Tensor:
    """The kernel of one ISA (each ISA this CPU runs is held to bitsandbytes, not only to scalar)."""
    out = torch.empty(n, dtype=dtype)
    nf4.dequantize_into(codes, scales, out, group_size, isa=CODES[isa])
    return out


def weights(n: int, seed: int, scale: float, zero_group: bool) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale
    if zero_group:
        x[: min(n, 64)] = 0
    return x


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 3000),
    blocksize=st.sampled_from(BLOCKSIZES),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    scale=st.sampled_from([1e-3, 0.02, 1.0, 300.0]),
    zero_group=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_quantize_and_dequantize_equal_bitsandbytes(n, blocksize, dtype, scale, zero_group, seed):
    x = weights(n, seed, scale, zero_group).to(dtype)
    packed, state = bnb.quantize_4bit(x, blocksize=blocksize, quant_type="nf4")
    codes, absmax = nf4.quantize(x, blocksize)
    assert torch.equal(codes, packed.reshape(-1))
    assert torch.equal(absmax, state.absmax)
    if n % 2:
        # bitsandbytes' CPU back end dequantises odd sizes with a torch function it compiles per
        # shape (seconds each); the kernel's odd tails are held to the format's definition in
        # test_nf4_kernel.py
        return
    want = bnb.dequantize_4bit(packed, state).reshape(-1)
    assert want.dtype == dtype
    for isa in kernel.supported_isas():
        got = dequantize(packed.reshape(-1), state.absmax, n, blocksize, dtype, isa)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), isa


def test_dynamic_code_is_bitsandbytes():
    assert torch.equal(nf4.DYNAMIC_CODE, bnb.create_dynamic_map())


@settings(max_examples=20, deadline=None)
@given(
    groups=st.integers(1, 700),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    scale=st.sampled_from([1e-3, 0.02, 300.0]),
    zero_groups=st.sampled_from([0, 1, 300]),
    seed=st.integers(0, 2**16),
)
def test_double_quant_equals_bitsandbytes(groups, dtype, scale, zero_groups, seed):
    """compress_statistics=True: the nested codes, block absmax and offset are bitsandbytes', and the
    kernel's values (the nested scales dequantised in the same pass) equal its dequantize_4bit bit for
    bit; group counts not multiples of the nested block of 256, whole nested blocks of zero groups
    (bitsandbytes' code 0 for an all-equal block) too. Sizes are even (see above: odd ones compile)."""
    n = groups * 64
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale
    x[: zero_groups * 64] = 0
    x = x.to(dtype)
    packed, state = bnb.quantize_4bit(x, blocksize=64, quant_type="nf4", compress_statistics=True)
    codes, absmax = nf4.quantize(x, 64)
    nested = nf4.quantize_scales(absmax)
    assert torch.equal(codes, packed.reshape(-1))
    assert torch.equal(nested.codes, state.absmax)
    assert torch.equal(nested.absmax, state.state2.absmax)
    assert nested.offset == state.offset.item()
    want = bnb.dequantize_4bit(packed, state).reshape(-1)
    for isa in kernel.supported_isas():
        got = dequantize(codes, nested, n, 64, dtype, isa)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), isa


def test_a_real_shaped_weight_round_trips_within_the_codes_resolution():
    """A Llama-shaped projection (std 0.02): every value within half the widest gap between adjacent
    codes, times its group's absmax (the most NF4 can be off by, by construction)."""
    x = torch.randn(256, 512, generator=torch.Generator().manual_seed(3)) * 0.02
    codes, absmax = nf4.quantize(x, 64)
    back = nf4.dequantize(codes, absmax, x.numel(), 64).view_as(x)
    half_gap = (nf4.CODE[1:] - nf4.CODE[:-1]).max() / 2
    bound = absmax.repeat_interleave(64).view_as(x) * half_gap
    assert ((back - x).abs() <= bound * (1 + 1e-6)).all()


def test_non_finite_weights_are_refused():
    with pytest.raises(ValueError, match="finite"):
        nf4.quantize(torch.tensor([1.0, float("nan")]), 64)
