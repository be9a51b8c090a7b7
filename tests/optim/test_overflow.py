"""has_overflow: inf/NaN anywhere in fp32/bf16/fp16 tensors, against torch.isfinite."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from infinity.optim import has_overflow, kernel

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_finds_each_kind_at_every_kind_of_position(isa, dtype):
    n = 100_003  # several blocks and threads, and a tail
    base = torch.randn(n).to(dtype)
    assert not has_overflow(base)
    biggest = torch.tensor(torch.finfo(dtype).max, dtype=dtype)
    assert not has_overflow(torch.cat([base, biggest.view(1), -biggest.view(1)])), (
        "the largest finite is finite"
    )
    for pos in (0, 1, 15, 16, 63, 64, n // 2, n - 17, n - 1):
        for bad in (float("inf"), float("-inf"), float("nan")):
            t = base.clone()
            t[pos] = bad
            assert has_overflow(t), (pos, bad)
            assert has_overflow([torch.randn(5).to(dtype), t])


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 5000), min_size=0, max_size=4),
    dtype=st.sampled_from(DTYPES),
    bad=st.sampled_from([None, float("inf"), float("-inf"), float("nan")]),
    where=st.floats(0, 1, exclude_max=True),
    threads=st.integers(1, 3),
)
def test_agrees_with_torch_isfinite(sizes, dtype, bad, where, threads):
    tensors = [torch.randn(n).to(dtype) * 100 for n in sizes]
    total = sum(sizes)
    if bad is not None and total:
        k = int(where * total)
        for t in tensors:
            if k < t.numel():
                t[k] = bad
                break
            k -= t.numel()
    expected = any(not torch.isfinite(t).all() for t in tensors)
    for isa in kernel.supported_isas():
        with kernel.use_isa(isa):
            assert has_overflow(tensors, num_threads=threads) == expected


def test_single_tensor_and_empty():
    assert not has_overflow([])
    assert not has_overflow(torch.empty(0))
    assert has_overflow(torch.tensor([float("nan")]))
