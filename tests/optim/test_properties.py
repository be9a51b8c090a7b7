"""Property tests: any size (0, 1, not a multiple of the vector width) and hyper-parameters.

Every kernel set this CPU supports gives the same bits, and they match torch.
"""

import torch
from adam_helpers import assert_adam_close, bits, streamed_stores
from hypothesis import given, settings
from hypothesis import strategies as st

from infinity.optim import AdamHyper, adam_step, foreach_adam_step, kernel

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

sizes = st.one_of(st.integers(0, 70), st.integers(71, 3000))
hyper = st.fixed_dictionaries(
    {
        "lr": st.floats(0.0, 0.1),
        "beta1": st.floats(0.0, 0.999),
        "beta2": st.floats(0.0, 0.9999),
        "eps": st.sampled_from([0.0, 1e-12, 1e-8, 1e-3]),
        "weight_decay": st.one_of(st.just(0.0), st.floats(0.0, 0.5)),
        "adamw": st.booleans(),
    }
)


def _run_ours(isa, p, grads, half, h, bias_correction=True):
    p, m, v = p.clone(), torch.zeros_like(p), torch.zeros_like(p)
    out = None if half is None else torch.empty(p.numel(), dtype=half)
    with kernel.use_isa(isa):
        for step, g in enumerate(grads, 1):
            hyper = AdamHyper(**h, bias_correction=bias_correction)
            adam_step(p, g, m, v, hyper, step=step, out_half=out)
    return p, m, v, out


@settings(max_examples=60, deadline=None)
@given(
    numel=sizes,
    h=hyper,
    steps=st.integers(1, 4),
    grad_dtype=st.sampled_from([F32, BF16, F16]),
    half=st.sampled_from([None, BF16, F16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_every_isa_gives_the_same_bits_and_matches_torch(numel, h, steps, grad_dtype, half, seed):
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(numel, generator=gen)
    grads = [torch.randn(numel, generator=gen).to(grad_dtype) for _ in range(steps)]
    results = {isa: _run_ours(isa, p0, grads, half, h) for isa in kernel.supported_isas()}
    first = results["scalar"]
    for isa, res in results.items():
        for a, b in zip(res, first, strict=True):
            if a is not None:
                assert torch.equal(bits(a), bits(b)), f"{isa} differs from scalar"
    ref = torch.nn.Parameter(p0.clone())
    ref_cls = torch.optim.AdamW if h["adamw"] else torch.optim.Adam
    ref_opt = ref_cls(
        [ref],
        lr=h["lr"],
        betas=(h["beta1"], h["beta2"]),
        eps=h["eps"],
        weight_decay=h["weight_decay"],
        foreach=False,
    )
    for g in grads:
        ref.grad = g.float()
        ref_opt.step()
    p, m, v, out = first
    assert_adam_close(p, ref.detach())
    if numel:
        assert_adam_close(m, ref_opt.state[ref]["exp_avg"])
        assert_adam_close(v, ref_opt.state[ref]["exp_avg_sq"])
    if out is not None:
        assert torch.equal(bits(out), bits(p.to(half)))


@settings(max_examples=25, deadline=None)
@given(
    numels=st.lists(st.one_of(st.integers(0, 40), st.integers(41, 70_000)), min_size=1, max_size=6),
    threads=st.integers(1, 5),
    offset=st.integers(0, 40),
    streamed=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_foreach_equals_one_call_per_tensor_for_any_thread_count(
    numels, threads, offset, streamed, seed
):
    """Splitting the elements of many tensors over threads (and streaming the copy) never changes a bit."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=gen) for n in numels]
    grads = [torch.randn(n, generator=gen).to(BF16) for n in numels]
    h = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw=True)
    ours = [p.clone() for p in params]
    ms, vs = [torch.full_like(p, 0.1) for p in params], [torch.full_like(p, 0.2) for p in params]
    # The 16-bit copies are views into one buffer, at an arbitrary alignment.
    halves = list(torch.empty(offset + sum(numels), dtype=F16)[offset:].split(numels))
    with streamed_stores(streamed):
        foreach_adam_step(ours, grads, ms, vs, h, step=3, out_halves=halves, num_threads=threads)
    for p, g, m, v, out in zip(params, grads, ms, vs, halves, strict=True):
        m1, v1, out1 = torch.full_like(p, 0.1), torch.full_like(p, 0.2), torch.empty_like(out)
        with streamed_stores(False):
            adam_step(p, g, m1, v1, h, step=3, out_half=out1, num_threads=1)
        assert torch.equal(bits(m), bits(m1)) and torch.equal(bits(v), bits(v1))
        assert torch.equal(bits(out), bits(out1))
    for a, b in zip(ours, params, strict=True):
        assert torch.equal(bits(a), bits(b))
