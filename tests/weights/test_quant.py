"""Shard quantisation at rest ([Note: quantised shards] in infinity/weights/quant.py), checked against its
own definition: pieces tile the shard, raw pieces come back bit for bit, and every quantised element comes
back within half a quantisation step of its group (plus what fp16 scales, clamping and the unit's dtype
add), with the step computed here from the group's values as the note defines it."""

from __future__ import annotations

import math
from itertools import pairwise

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from infinity.aio import DIRECT_ALIGNMENT
from infinity.weights.quant import (
    PART_ALIGN,
    QuantSpec,
    dequantize_into,
    quantize_into,
    shard_format,
)

F16 = torch.float16


@st.composite
def shards(draw):
    """A shard: stretches of parameters of random shapes (1-D stay raw), gaps of padding between them."""
    stretches, pos = [], 0
    for _ in range(draw(st.integers(0, 4))):
        pos += draw(st.integers(0, 5))  # padding, or another rank's part of a parameter
        shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
        n = draw(st.integers(1, math.prod(shape)))  # the part of the parameter in this shard
        stretches.append((pos, pos + n, shape))
        pos += n
    numel = pos + draw(st.integers(0 if pos else 1, 7))
    spec = QuantSpec(
        draw(st.sampled_from([4, 8])), draw(st.sampled_from([2, 4, 8, 64])), draw(st.booleans())
    )
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    return stretches, numel, dtype, spec


@settings(max_examples=150, deadline=None)
@given(shard=shards())
def test_pieces_tile_the_shard_in_aligned_parts(shard):
    stretches, numel, dtype, spec = shard
    fmt = shard_format(stretches, numel, dtype, spec)
    assert [(p.lo, p.hi) for p in fmt.pieces] == sorted((p.lo, p.hi) for p in fmt.pieces)
    assert fmt.pieces[0].lo == 0 and fmt.pieces[-1].hi == numel
    assert all(a.hi == b.lo for a, b in pairwise(fmt.pieces))
    matrices = {(lo, hi) for lo, hi, shape in stretches if len(shape) >= 2 and hi > lo}
    assert {(p.lo, p.hi) for p in fmt.pieces if p.quantized} == matrices
    assert all(p.offset % PART_ALIGN == 0 for p in fmt.pieces)
    assert all(a.offset < b.offset for a, b in pairwise(fmt.pieces))
    assert fmt.nbytes % DIRECT_ALIGNMENT == 0 and fmt.nbytes > fmt.pieces[-1].offset


@settings(max_examples=60, deadline=None)
@given(shard=shards(), seed=st.integers(0, 2**16), magnitude=st.sampled_from([1e-3, 1.0, 300.0]))
def test_dequantised_values_are_within_half_a_step(shard, seed, magnitude):
    stretches, numel, dtype, spec = shard
    fmt = shard_format(stretches, numel, dtype, spec)
    g = torch.Generator().manual_seed(seed)
    values = (torch.randn(numel, generator=g) * magnitude).to(dtype)
    packed = torch.zeros(fmt.nbytes, dtype=torch.uint8)
    quantize_into(fmt, values, packed)
    out = torch.empty(numel, dtype=dtype)
    dequantize_into(fmt, packed, out)
    eps = torch.finfo(dtype).eps
    for p in fmt.pieces:
        x, y = values[p.lo : p.hi], out[p.lo : p.hi]
        if not p.quantized:
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))  # bit for bit
            continue
        for k in range(0, p.numel, spec.group_size):
            group, back = x[k : k + spec.group_size].double(), y[k : k + spec.group_size].double()
            if spec.symmetric:
                half = 1 << (spec.num_bits - 1)
                step = float(torch.tensor(float(group.abs().max()) / (half - 1)).to(F16))
                clamp = max(
                    0.0, float(group.abs().max()) - step * (half - 1)
                )  # fp16 rounded the step down
            else:
                base = float(torch.tensor(float(group.min())).to(F16))
                step = float(
                    torch.tensor((float(group.max()) - base) / ((1 << spec.num_bits) - 1)).to(F16)
                )
                top = base + step * ((1 << spec.num_bits) - 1)
                clamp = max(0.0, base - float(group.min()), float(group.max()) - top)
            bound = step / 2 + clamp + (group.abs().max() + step) * (eps + 1e-6)
            err = float((group - back).abs().max())
            assert err <= bound, (p, k, err, bound)


def test_a_group_too_wide_for_fp16_scales_is_named():
    fmt = shard_format([(0, 4, (2, 2))], 4, torch.float32, QuantSpec(8, 4, False))
    packed = torch.zeros(fmt.nbytes, dtype=torch.uint8)
    with pytest.raises(
        ValueError, match=r"layer\.0: a weight group's range does not fit fp16 scales"
    ):
        quantize_into(fmt, torch.tensor([-1e6, 0.0, 1.0, 1e6]), packed, name="layer.0")


@settings(max_examples=60, deadline=None)
@given(
    shard=shards(),
    seed=st.integers(0, 2**16),
    group_size=st.sampled_from([2, 3, 64]),
    double_quant=st.booleans(),
)
def test_nf4_pieces_hold_each_stretch_as_nf4_does(shard, seed, group_size, double_quant):
    """With quant_type "nf4" each quantised piece is its stretch quantised alone (nf4.quantize: the bytes
    bitsandbytes makes, tests/weights/test_nf4_oracle.py; with double_quant its scales quantised again
    by nf4.quantize_scales) and comes back as nf4 dequantises it; raw pieces come back bit for bit; the
    pieces tile the shard in aligned parts as the integer formats'."""
    from infinity.weights import nf4

    stretches, numel, dtype, _ = shard
    spec = QuantSpec(4, group_size, True, "nf4", double_quant)
    fmt = shard_format(stretches, numel, dtype, spec)
    assert all(p.offset % PART_ALIGN == 0 for p in fmt.pieces)
    values = (torch.randn(numel, generator=torch.Generator().manual_seed(seed))).to(dtype)
    packed = torch.zeros(fmt.nbytes, dtype=torch.uint8)
    quantize_into(fmt, values, packed)
    out = torch.empty(numel, dtype=dtype)
    dequantize_into(fmt, packed, out)
    for p in fmt.pieces:
        x, y = values[p.lo : p.hi], out[p.lo : p.hi]
        if p.quantized:
            codes, absmax = nf4.quantize(x, group_size)
            scales = nf4.quantize_scales(absmax) if double_quant else absmax
            want = nf4.dequantize(codes, scales, p.numel, group_size, dtype)
            assert torch.equal(y.view(torch.uint8), want.view(torch.uint8))
        else:
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


def test_nf4_needs_four_bits():
    with pytest.raises(ValueError, match="NF4 stores 4 bits per weight; got num_bits=8"):
        QuantSpec(8, 64, False, "nf4")


@pytest.mark.parametrize(
    ("double_quant", "per_weight"), [(False, 0.5 + 4 / 64), (True, 0.5 + 1 / 64 + 4 / (64 * 256))]
)
def test_nf4_at_rest_bytes_per_weight(double_quant, per_weight):
    """A 4096 x 4096 matrix at rest: codes and scales, nothing else but the parts' alignment."""
    n = 4096 * 4096
    fmt = shard_format(
        [(0, n, (4096, 4096))], n, torch.bfloat16, QuantSpec(4, 64, True, "nf4", double_quant)
    )
    assert fmt.nbytes == pytest.approx(n * per_weight, abs=3 * PART_ALIGN + DIRECT_ALIGNMENT)


def test_double_quant_is_for_nf4_only():
    with pytest.raises(ValueError, match="double quantisation applies to NF4 scales"):
        QuantSpec(4, 64, False, "int", double_quant=True)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 9),
    cols=st.sampled_from([3, 8, 24, 64]),
    group=st.sampled_from([3, 4, 8, 64]),
    chunk=st.integers(1, 40),
    double_quant=st.booleans(),
)
def test_nf4_quantised_a_chunk_at_a_time_is_byte_for_byte_the_whole_piece_at_once(
    rows, cols, group, chunk, double_quant
):
    """quantize_into bounds NF4's temporaries by quantising NF4_CHUNK_NUMEL elements at a time; the
    oracle is nf4.quantize over the whole piece (one call, as bitsandbytes quantises a tensor)."""
    from infinity.weights import nf4, quant

    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * cols + chunk))
    spec = QuantSpec(4, group, True, quant_type="nf4", double_quant=double_quant)
    fmt = shard_format([(0, w.numel(), tuple(w.shape))], w.numel(), torch.float32, spec)

    def packed() -> torch.Tensor:
        out = torch.zeros(fmt.nbytes, dtype=torch.uint8)
        quantize_into(fmt, w.reshape(-1), out)
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(quant, "NF4_CHUNK_NUMEL", chunk)
        chunked = packed()
        mp.setattr(quant, "NF4_CHUNK_NUMEL", 1 << 30)
        assert torch.equal(chunked, packed())
    codes, absmax = nf4.quantize(w.reshape(-1), group)
    assert torch.equal(chunked[: codes.numel()], codes)
    if not double_quant:
        c, so, _ = fmt._parts(fmt.pieces[0])
        assert torch.equal(chunked[so : so + 4 * absmax.numel()].view(torch.float32), absmax)
