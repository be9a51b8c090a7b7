"""stream_bound_step, the bandwidth probe bench/adam.py measures against: it must do exactly its 4 reads and 3 writes."""

import pytest
import torch

from infinity.optim import stream_bound_step


def test_adds_grad_to_three_arrays(isa):
    gen = torch.Generator().manual_seed(7)
    for sizes in ([1], [1000], [17, 0, 300_000, 5]):
        p, g, m, v = ([torch.randn(n, generator=gen) for n in sizes] for _ in range(4))
        expected = [(a + b, c + b, d + b) for a, b, c, d in zip(p, g, m, v, strict=True)]
        if len(sizes) == 1:
            stream_bound_step(p[0], g[0], m[0], v[0], num_threads=2)
        else:
            stream_bound_step(p, g, m, v, num_threads=2)
        for got, want in zip(zip(p, m, v, strict=True), expected, strict=True):
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a, b)


def test_needs_fp32_gradients():
    p, m, v = torch.zeros(4), torch.zeros(4), torch.zeros(4)
    with pytest.raises(
        TypeError,
        match=r"grad\[1\] has dtype torch.bfloat16; the CPU Adam kernel needs torch.float32",
    ):
        stream_bound_step(
            [p, p.clone()],
            [torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16)],
            [m, m.clone()],
            [v, v.clone()],
        )
