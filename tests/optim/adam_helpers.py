"""Helpers shared by the CPU Adam tests."""

import contextlib
from collections.abc import Iterator

import torch

from infinity import _adam


def assert_adam_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Within 1e-6 relative: of each element, or of the tensor's largest magnitude for elements near zero.

    The kernel's sqrt is IEEE; torch's comes from MKL and is an ulp off now and
    then, so a step's update can differ from torch's by an ulp, and in training
    that feeds back through the gradients. Elements that pass near zero would
    fail a purely elementwise relative test on such noise.
    """
    finite = expected[expected.isfinite()]
    scale = finite.abs().max().item() if finite.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6 * scale, equal_nan=True)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a float tensor, for exact comparisons that see NaN payloads and -0."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


@contextlib.contextmanager
def streamed_stores(on: bool = True) -> Iterator[None]:
    """Force (or forbid) the kernels' non-temporal stores (the step's 16-bit copy, the NF4
    output), whatever the size."""
    previous = _adam.stream_min_bytes()
    _adam.set_stream_min_bytes(0 if on else 2**63)
    try:
        yield
    finally:
        _adam.set_stream_min_bytes(previous)
