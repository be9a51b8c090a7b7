"""sum_squares: the gradient norm's sum, against math.fsum, and the same bits on every ISA and thread count."""

import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from infinity.optim import kernel, sum_squares


def _exact(tensors) -> float:
    """The correctly rounded sum of the squares (each square of a float is exact in double)."""
    return math.fsum(float(x) ** 2 for t in tensors for x in t.double().tolist())


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 70_000), min_size=1, max_size=4),
    scale=st.sampled_from([1e-20, 1e-3, 1.0, 1e6, 1e15]),
    seed=st.integers(0, 2**16),
)
def test_equals_the_exact_sum_and_the_same_bits_everywhere(sizes, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(n, generator=gen) * scale for n in sizes]
    exact = _exact(tensors)
    n = sum(sizes)
    results = []
    for isa in kernel.supported_isas():
        with kernel.use_isa(isa):
            for threads in (1, 2, 3):
                results.append(sum_squares(tensors, num_threads=threads))
    # Summing n non-negative terms in double: relative error at most n ulps (2^-53 each).
    assert results[0] == pytest.approx(exact, rel=max(n, 1) * 2.0**-53, abs=0.0)
    assert {_bits(r) for r in results} == {_bits(results[0])}, (
        "results differ between ISAs or thread counts"
    )


def test_refuses_what_it_cannot_read():
    with pytest.raises(TypeError, match=r"tensors\[1\] has dtype torch.float16"):
        sum_squares([torch.ones(3), torch.ones(3, dtype=torch.float16)])
    with pytest.raises(ValueError, match=r"tensors\[0\] is not contiguous"):
        sum_squares(torch.ones(4, 4).t())
