"""16-bit ``nn.Linear`` layers computed in fp32 on CPUs without 16-bit matrix hardware.

[Note: 16-bit Linear on the CPU]
On an x86 CPU without AVX-512 BF16/FP16 (oneDNN then refuses 16-bit matmuls:
``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` is False), torch multiplies bf16 and fp16
matrices with its reference loops. The forward of a Linear (``x @ W.T``) runs there at about a
third of fp32's speed, and the input gradient of its backward (``grad @ W``, with ``W`` row-major)
takes a path about 200 times slower than fp32's: measured on a 2-core AVX2 EPYC, 128 tokens
through a 4096 x 11008 weight, 0.57 s forward and 49 s for the input gradient in bf16, against
0.26 s and 0.23 s converting to fp32 and back. A LoRA step over a frozen bf16 base runs the input
gradient through every frozen matrix, so a 7B step took hours; the adapters themselves (a 2048 x 16
pair at 256 tokens) cost 39 ms forward and backward in bf16 against 2 ms in fp32.

A Linear whose weight and input are both bf16 (or both fp16) on such a CPU therefore multiplies in
fp32 (MKL's SGEMM) and rounds each result (output, input gradient, weight and bias gradients) to
the 16-bit dtype once: torch's 16-bit kernels also accumulate in fp32 and round once, so the two
differ only in the order of the fp32 additions (the result's last bit, sometimes). The weight is
converted a block of rows (output features) at a time, each block's fp32 rows and fp32 output (or
output gradient) at most ``_BLOCK_ELEMENTS`` (32 MiB): besides the input's fp32 copy (and the input
gradient's fp32 sum), no temporary grows with the matrix (a frozen 7B base is streamed through
4 GiB) or with a large vocabulary's logits. Trainable weights get their
gradient here too, rounded to the weight's dtype as torch's would be, so the partitioner's gradient
hooks see what they would see from ``F.linear``. Every CPU with 16-bit matrix hardware, every fp32
layer and every ``nn.Linear`` subclass calls ``F.linear`` as the module would.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

_BLOCK_ELEMENTS = 8 << 20  # fp32 elements of a weight block, and of its output block (32 MiB)
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


def linears_multiply_in_fp32(dtype: torch.dtype) -> bool:
    """Whether training in ``dtype`` on this CPU takes the fp32 path (the estimate counts it)."""
    return dtype in _SIXTEEN_BIT and cpu_lacks_16bit_matmul(dtype)


def _row_blocks(weight: torch.Tensor, tokens: int) -> list[tuple[int, int]]:
    """Blocks of output features whose fp32 weight rows, and whose fp32 output (or gradient)
    columns for ``tokens`` tokens, are each at most ``_BLOCK_ELEMENTS``."""
    rows, cols = weight.shape
    step = max(1, _BLOCK_ELEMENTS // max(1, cols, tokens))
    return [(r, min(rows, r + step)) for r in range(0, rows, step)]


class _Fp32Linear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` for 16-bit tensors, multiplied in fp32 a block of weight rows
    (output features) at a time, each result rounded to its tensor's dtype once."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        # Saved as F.linear saves them: the input only when the weight needs its gradient.
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight)
        ctx.has_bias = bias is not None
        x32 = x.float()
        out = x.new_empty((*x.shape[:-1], weight.shape[0]))
        for r0, r1 in _row_blocks(weight, x32.numel() // max(1, weight.shape[1])):
            b = None if bias is None else bias[r0:r1].float()
            out[..., r0:r1] = F.linear(x32, weight[r0:r1].float(), b)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        rows, cols = weight.shape
        g2 = grad.reshape(-1, rows)
        blocks = _row_blocks(weight, g2.shape[0])
        gx = gw = gb = None
        # One product at a time, so that only its own fp32 temporaries are alive at once.
        if need_x:
            gx32 = g2.new_zeros((g2.shape[0], cols), dtype=torch.float32)
            for r0, r1 in blocks:
                gx32.addmm_(g2[:, r0:r1].float(), weight[r0:r1].float())
            gx = gx32.to(grad.dtype).reshape(*grad.shape[:-1], cols)
            del gx32
        if need_w:
            x2 = x.reshape(-1, cols).float()
            gw = torch.empty_like(weight)
            for r0, r1 in blocks:
                gw[r0:r1] = g2[:, r0:r1].float().T @ x2
            del x2
        if need_b and ctx.has_bias:
            gb = g2.float().sum(0).to(grad.dtype)
        return gx, gw, gb


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
        and (b is None or b.dtype == w.dtype)
        and w.dim() == 2
        and w.shape[0] > 0
    ):
        return _Fp32Linear.apply(x, w, b)
    return original(x)


class Fp32Linears:
    """Installs the fp32 path on every ``nn.Linear`` of a model ([Note: 16-bit Linear on the
    CPU]); ``remove`` puts each module's forward back. Installed on the linears whose weight is
    16-bit, or on all of them when ``train_dtype`` is (an fp32 run's linears keep a plain call);
    which calls take the path is decided per call (the weight's dtype and device are known only once
    the partitioner has gathered it)."""

    def __init__(self, model: nn.Module, *, train_dtype: torch.dtype | None = None):
        self._modules = [
            m
            for m in model.modules()
            if type(m) is nn.Linear  # subclasses keep their own forward
            and (m.weight.dtype in _SIXTEEN_BIT or train_dtype in _SIXTEEN_BIT)
        ]
        self._installed: list[nn.Linear] = []

    def install(self) -> None:
        slow = frozenset(d for d in _SIXTEEN_BIT if linears_multiply_in_fp32(d))
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
