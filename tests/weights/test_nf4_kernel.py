"""The NF4 dequantisation kernel gives the same bits on every ISA this CPU runs as on the scalar path,
for any size, group size (odd ones too: groups that start mid-byte; ones below, at and around the
vector kernels' blocks of 32 and 64 elements), output dtype, thread count and range of the elements
(a start or end inside a group or a byte); the scalar path is checked against the format's definition
written in torch (code[q] · absmax, rounded once; with double-quantised scales, absmax = code8[c] ·
block absmax + offset, each step rounded); bad arguments are refused with the reason. Cheap: also run
under ASan/UBSan (.ci/sanitize.sh).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from infinity import _adam
from infinity.optim import kernel
from infinity.weights import nf4
from tests.optim.adam_helpers import streamed_stores

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CODES = {"scalar": _adam.SCALAR, "avx2": _adam.AVX2, "avx512": _adam.AVX512}


def random_packed(n: int, group_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every byte value and scales over many magnitudes (fp16 overflow and subnormals included)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (nf4.codes_nbytes(n),), generator=g, dtype=torch.uint8)
    exponent = torch.randint(-30, 30, (nf4.groups(n, group_size),), generator=g).float()
    absmax = torch.rand(exponent.shape, generator=g) * torch.exp2(exponent)
    return codes, absmax


def random_nested(n: int, group_size: int, seed: int) -> nf4.NestedScales:
    """Scales quantised again: every 8-bit code, block absmax and offsets over many magnitudes."""
    g = torch.Generator().manual_seed(seed + 1)
    groups = nf4.groups(n, group_size)
    codes = torch.randint(0, 256, (groups,), generator=g, dtype=torch.uint8)
    exponent = torch.randint(-30, 30, (nf4.scale_blocks(groups),), generator=g).float()
    absmax = torch.rand(exponent.shape, generator=g) * torch.exp2(exponent)
    offset = float(
        torch.rand(1, generator=g) * torch.exp2(torch.randint(-30, 30, (1,), generator=g))
    )
    return nf4.NestedScales(codes, absmax, float(torch.tensor(offset, dtype=torch.float32)))


def by_definition(codes: torch.Tensor, scales, n: int, group_size: int, dtype):
    q = torch.stack((codes >> 4, codes & 0xF), dim=1).reshape(-1)[:n].long()
    per_group = scales.values() if isinstance(scales, nf4.NestedScales) else scales
    scale = per_group.repeat_interleave(group_size)[:n]
    return (nf4.CODE[q] * scale).to(dtype)


def run(codes, scales, n, group_size, dtype, isa: str, threads: int) -> torch.Tensor:
    out = torch.empty(n, dtype=dtype)
    nf4.dequantize_into(codes, scales, out, group_size, isa=CODES[isa], num_threads=threads)
    return out


@pytest.mark.parametrize("isa", kernel.ISAS)
@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(0, 5000),
    group_size=st.sampled_from([1, 2, 3, 5, 16, 30, 32, 34, 63, 64, 65, 96, 128, 4096]),
    dtype=st.sampled_from(DTYPES),
    threads=st.sampled_from([1, 2]),
    nested=st.booleans(),
    stream=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_every_isa_equals_scalar_bit_for_bit(
    isa, n, group_size, dtype, threads, nested, stream, seed
):
    """Plain and double-quantised scales (group counts not multiples of the nested block of 256);
    plain and non-temporal stores of the output."""
    if isa not in kernel.supported_isas():
        pytest.skip(f"this CPU cannot run the {isa} kernels")
    codes, absmax = random_packed(n, group_size, seed)
    scales = random_nested(n, group_size, seed) if nested else absmax
    with streamed_stores(stream):
        got = run(codes, scales, n, group_size, dtype, isa, threads)
    with streamed_stores(False):
        want = run(codes, scales, n, group_size, dtype, "scalar", 1)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(0, 3000),
    group_size=st.sampled_from([1, 2, 7, 17, 64, 100]),
    dtype=st.sampled_from(DTYPES),
    nested=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_scalar_kernel_is_the_formats_definition(n, group_size, dtype, nested, seed):
    codes, absmax = random_packed(n, group_size, seed)
    scales = random_nested(n, group_size, seed) if nested else absmax
    got = run(codes, scales, n, group_size, dtype, "scalar", 1)
    assert torch.equal(got, by_definition(codes, scales, n, group_size, dtype))


def run_range(codes, scales, n, group_size, dtype, isa: str, threads: int, begin: int, end: int):
    """Elements [begin, end) dequantised into an output filled with 0xff bytes (a NaN in every
    dtype, so that no element the kernel writes can equal it)."""
    out = torch.full((n,), -1, dtype=torch.int32 if dtype == torch.float32 else torch.int16)
    out = out.view(dtype)
    nested = scales if isinstance(scales, nf4.NestedScales) else None
    by_scales = (
        dict(
            absmax=0,
            scale_codes=nested.codes.data_ptr(),
            scale_code=nf4.DYNAMIC_CODE.data_ptr(),
            scale_absmax=nested.absmax.data_ptr(),
            scale_offset=nested.offset,
        )
        if nested is not None
        else dict(absmax=scales.data_ptr())
    )
    _adam.dequantize_nf4(
        codes=codes.data_ptr(),
        out=out.data_ptr(),
        dtype={torch.float32: _adam.FLOAT32, torch.bfloat16: _adam.BFLOAT16}.get(
            dtype, _adam.FLOAT16
        ),
        numel=n,
        group_size=group_size,
        isa=CODES[isa],
        num_threads=threads,
        begin=begin,
        end=end,
        **by_scales,
    )
    return out


@pytest.mark.parametrize("isa", kernel.ISAS)
@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 3000),
    group_size=st.sampled_from([2, 3, 32, 64, 65, 96, 128]),
    dtype=st.sampled_from(DTYPES),
    nested=st.booleans(),
    cut=st.tuples(st.floats(0, 1), st.floats(0, 1)),
    seed=st.integers(0, 2**16),
)
def test_a_range_of_the_elements_is_those_elements_of_the_whole(
    isa, n, group_size, dtype, nested, cut, seed
):
    """Any [begin, end): inside a group or a byte, across groups and blocks; the rest untouched."""
    if isa not in kernel.supported_isas():
        pytest.skip(f"this CPU cannot run the {isa} kernels")
    begin, end = sorted(round(c * n) for c in cut)
    codes, absmax = random_packed(n, group_size, seed)
    scales = random_nested(n, group_size, seed) if nested else absmax
    whole = run(codes, scales, n, group_size, dtype, "scalar", 1)
    with streamed_stores(True):
        got = run_range(codes, scales, n, group_size, dtype, isa, 2, begin, end)
    bits = got.view(torch.int32 if dtype == torch.float32 else torch.int16)
    assert torch.equal(got[begin:end].view(torch.uint8), whole[begin:end].view(torch.uint8))
    assert bool((bits[:begin] == -1).all()) and bool((bits[end:] == -1).all())


def test_large_inputs_split_over_threads_give_the_same_bits():
    """Several chunks of the kernel's partitioning, one group straddling each chunk boundary; plain and
    double-quantised scales (several of the kernel's batches of nested scales per chunk)."""
    n, group_size = 3 * 32768 + 77, 96
    codes, absmax = random_packed(n, group_size, 7)
    best = kernel.best_isa()
    for scales in (absmax, random_nested(n, group_size, 7)):
        want = run(codes, scales, n, group_size, torch.bfloat16, "scalar", 1)
        for threads in (1, 2, 3):
            got = run(codes, scales, n, group_size, torch.bfloat16, best, threads)
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def raw_dequantize_128(**pointers: int) -> None:
    """The binding called directly on 128 fp32 elements in groups of 64, scalar, one thread (the
    checks the Python face cannot reach: overlaps, ranges, the nested scales' block)."""
    _adam.dequantize_nf4(
        dtype=_adam.FLOAT32, numel=128, group_size=64, isa=_adam.SCALAR, num_threads=1, **pointers
    )


def test_bad_arguments_are_refused_with_the_reason():
    codes, absmax = random_packed(128, 64, 0)
    with pytest.raises(ValueError, match="need 64 code bytes and 2 scales; got 10"):
        nf4.dequantize_into(codes[:10], absmax, torch.empty(128), 64)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        nf4.dequantize_into(codes, absmax, torch.empty(128, dtype=torch.float64), 64)
    with pytest.raises(ValueError, match="not contiguous"):
        nf4.dequantize_into(codes, absmax, torch.empty(256)[::2], 64)
    with pytest.raises(ValueError, match="absmax float32"):
        nf4.dequantize_into(codes, absmax.double(), torch.empty(128), 64)
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        nf4.dequantize_into(codes, absmax, torch.empty(128), 0)
    shared = torch.zeros(1024, dtype=torch.uint8)
    with pytest.raises(ValueError, match="out overlaps"):
        raw_dequantize_128(
            codes=shared.data_ptr(),
            absmax=absmax.data_ptr(),
            out=shared.data_ptr() + 16,
        )
    with pytest.raises(ValueError, match=r"the range \[100, 129\) is not inside the 128 elements"):
        raw_dequantize_128(
            codes=codes.data_ptr(),
            absmax=absmax.data_ptr(),
            out=torch.empty(128).data_ptr(),
            begin=100,
            end=129,
        )
    with pytest.raises(ValueError, match="num_threads must be >= 1"):
        nf4.dequantize_into(codes, absmax, torch.empty(128), 64, num_threads=0)
    nested = random_nested(128, 64, 0)
    with pytest.raises(
        ValueError, match="2 nested scales need 1 float32 block absmax values; got 0"
    ):
        nf4.dequantize_into(
            codes, nf4.NestedScales(nested.codes, nested.absmax[:0], 0.0), torch.empty(128), 64
        )
    with pytest.raises(ValueError, match="nested scales: uint8 codes"):
        nf4.dequantize_into(
            codes, nf4.NestedScales(nested.codes.float(), nested.absmax, 0.0), torch.empty(128), 64
        )
    with pytest.raises(ValueError, match="out overlaps"):
        raw_dequantize_128(
            codes=codes.data_ptr(),
            absmax=0,
            out=shared.data_ptr(),
            scale_codes=shared.data_ptr() + 8,
            scale_code=nf4.DYNAMIC_CODE.data_ptr(),
            scale_absmax=nested.absmax.data_ptr(),
        )
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        raw_dequantize_128(
            codes=codes.data_ptr(),
            absmax=0,
            out=torch.empty(128).data_ptr(),
            scale_codes=nested.codes.data_ptr(),
            scale_code=nf4.DYNAMIC_CODE.data_ptr(),
            scale_absmax=nested.absmax.data_ptr(),
            scale_block=0,
        )
