"""Frozen 16-bit ``nn.Linear`` layers computed in fp32 on CPUs without 16-bit matrix hardware.

[Note: frozen 16-bit Linear on the CPU]
On an x86 CPU without AVX-512 BF16/FP16 (oneDNN then refuses 16-bit matmuls:
``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` is False), torch multiplies bf16 and fp16
matrices with its reference loops. The forward of a Linear (``x @ W.T``) runs there at about a
third of fp32's speed, and the input gradient of its backward (``grad @ W``, with ``W`` row-major)
takes a path about 200 times slower than fp32's: measured on a 2-core AVX2 EPYC, 128 tokens
through a 4096 x 11008 weight, 0.57 s forward and 49 s for the input gradient in bf16, against
0.26 s and 0.23 s converting to fp32 and back. A LoRA step over a frozen bf16 base runs the input
gradient through every frozen matrix, so a 7B step took hours. A frozen Linear whose weight and
input are both bf16 (or both fp16) on such a CPU therefore multiplies in fp32 (MKL's SGEMM) and
rounds the result to the input's dtype once: torch's 16-bit kernels also accumulate in fp32 and
round once, so the two differ only in the order of the fp32 additions (the result's last bit,
sometimes). The weight is converted a block of rows at a time (``_BLOCK_ELEMENTS``), so the fp32
copy held at once is 32 MiB, not the whole matrix. Only frozen weights (no gradient to compute
for them) without a trainable bias take this path; everything else, and every CPU with 16-bit
matrix hardware, calls ``F.linear`` as the module would.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

_BLOCK_ELEMENTS = 8 << 20  # fp32 elements of the weight converted at once (32 MiB)
_SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def cpu_lacks_16bit_matmul(dtype: torch.dtype) -> bool:
    """Whether torch multiplies ``dtype`` matrices on this CPU with its reference loops (no oneDNN
    kernel for it: no AVX-512 BF16 / FP16 or AMX)."""
    mkldnn = torch.ops.mkldnn
    probe = {
        torch.bfloat16: getattr(mkldnn, "_is_mkldnn_bf16_supported", None),
        torch.float16: getattr(mkldnn, "_is_mkldnn_fp16_supported", None),
    }.get(dtype)
    return probe is None or not probe()


def _row_blocks(weight: torch.Tensor) -> list[tuple[int, int]]:
    rows, cols = weight.shape
    step = max(1, _BLOCK_ELEMENTS // max(1, cols))
    return [(r, min(rows, r + step)) for r in range(0, rows, step)]


class _Fp32FrozenLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` for a frozen 16-bit weight, multiplied in fp32 a block of
    output rows at a time; the gradient is the input's only."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(weight)
        x32 = x.float()
        out = x.new_empty((*x.shape[:-1], weight.shape[0]))
        for r0, r1 in _row_blocks(weight):
            b = None if bias is None else bias[r0:r1].float()
            out[..., r0:r1] = F.linear(x32, weight[r0:r1].float(), b)
        return out

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        g32 = grad.float()
        (r0, r1), *rest = _row_blocks(weight)
        gx = g32[..., r0:r1] @ weight[r0:r1].float()
        for r0, r1 in rest:
            gx.add_(g32[..., r0:r1] @ weight[r0:r1].float())
        return gx.to(grad.dtype), None, None


def _forward(
    module: nn.Linear, original: Callable, slow: frozenset[torch.dtype], x: torch.Tensor
) -> torch.Tensor:
    """``slow``: the 16-bit dtypes this CPU multiplies with torch's reference loops (probed once)."""
    w, b = module.weight, module.bias
    if (
        x.device.type == "cpu"
        and w.device.type == "cpu"
        and x.dtype == w.dtype
        and w.dtype in slow
        and not w.requires_grad
        and (b is None or (not b.requires_grad and b.dtype == w.dtype))
        and w.dim() == 2
        and w.shape[0] > 0
    ):
        return _Fp32FrozenLinear.apply(x, w, b)
    return original(x)


class FrozenLinears:
    """Installs the fp32 path on every ``nn.Linear`` of a model whose weight is frozen
    ([Note: frozen 16-bit Linear on the CPU]); ``remove`` puts each module's forward back. Which
    layers qualify is decided per call (the weight's dtype and device are known only once the
    partitioner has gathered it)."""

    def __init__(self, model: nn.Module):
        self._modules = [
            m
            for m in model.modules()
            if type(m) is nn.Linear and not m.weight.requires_grad  # subclasses keep their own
        ]
        self._installed: list[nn.Linear] = []

    def install(self) -> None:
        slow = frozenset(d for d in _SIXTEEN_BIT if cpu_lacks_16bit_matmul(d))
        if not slow:
            return
        for m in self._modules:
            if "forward" in vars(m):  # another library's hook owns it (Accelerate's): leave it
                continue
            m.forward = functools.partial(_forward, m, m.forward, slow)  # type: ignore[method-assign]
            self._installed.append(m)

    def remove(self) -> None:
        for m in self._installed:
            vars(m).pop("forward", None)
        self._installed.clear()
