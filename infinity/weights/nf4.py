"""NF4: QLoRA's 4-bit NormalFloat code, as bitsandbytes stores it — quantising into it and the C++ kernel
that dequantises it.

The format ([Note: NF4 code book] in csrc/adam/kernel.h): a stretch of n values is cut into groups of
``group_size`` consecutive values (the last one may be shorter); each group keeps its absolute maximum
as an fp32 ``absmax``, and each value the index of the nearest of the 16 code-book values to
value / absmax, packed two per byte with the first of a pair in the high nibble. Dequantised value =
code[q] · absmax in fp32 (one multiply), rounded once to the output dtype. These are the bytes and
scales ``bitsandbytes.functional.quantize_4bit(x, blocksize=group_size, quant_type="nf4")`` makes, and
the values its ``dequantize_4bit`` gives (tests/weights/test_nf4.py holds both to it).

``quantize`` runs once per weight (at initialize) and is torch ops, mirroring bitsandbytes' own rounding
step by step (a reciprocal multiply for whole groups, a division for the shorter last one, ties to the
lower code); ``dequantize_into`` runs after every read of a frozen unit and is the C++ kernel in
``infinity._adam`` (AVX-512, AVX2 or scalar, chosen at run time; the same bits on each).

Threading: none (pure functions); the kernel releases the GIL and uses the CPU Adam kernels' threads.
"""

from __future__ import annotations

# torch first: its libgomp must be loaded before _adam's ([Note: threads] in csrc/adam/parallel.h).
import torch  # noqa: I001

from infinity import _adam

CODE = torch.tensor(
    [
        float.fromhex(h)
        for h in (
            "-0x1p+0", "-0x1.647362p-1", "-0x1.0cd66p-1", "-0x1.94654p-2",
            "-0x1.23449ap-2", "-0x1.7a6a7ep-3", "-0x1.74f0e2p-4", "0x0p+0",
            "0x1.45f5fep-4", "0x1.4995c6p-3", "0x1.f809bap-3", "0x1.5a0674p-2",
            "0x1.c3497p-2", "0x1.200f56p-1", "0x1.722766p-1", "0x1p+0",
        )
    ],
    dtype=torch.float32,
)  # fmt: skip
"""The 16 NF4 values, fp32, in code order (the kernel's kNf4Code)."""

_MIDPOINTS = (CODE[:-1] + CODE[1:]) / 2
_DTYPES = {
    torch.float32: _adam.FLOAT32,
    torch.bfloat16: _adam.BFLOAT16,
    torch.float16: _adam.FLOAT16,
}
_TINY = 1e-38  # bitsandbytes' floor under absmax: an all-zero group quantises to code 7 (0.0)


def codes_nbytes(numel: int) -> int:
    """Bytes of packed codes for ``numel`` values."""
    return (numel + 1) // 2


def groups(numel: int, group_size: int) -> int:
    """Scales (groups) for ``numel`` values."""
    return -(-numel // group_size)


def quantize(values: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` (any float dtype, flattened) as (packed codes: uint8 of codes_nbytes(n), absmax: fp32 of
    groups(n, group_size)), byte for byte what bitsandbytes' quantize_4bit makes."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1; got {group_size}")
    x = values.detach().reshape(-1).float()
    n = x.numel()
    full = n - n % group_size
    whole = x[:full].view(-1, group_size)
    absmax = whole.abs().amax(dim=1)
    scaled = torch.clamp(whole * (1.0 / absmax.clamp(min=_TINY))[:, None], -1, 1).reshape(-1)
    if full < n:
        last = x[full:].abs().amax().clamp(min=_TINY)
        absmax = torch.cat([absmax, last[None]])
        scaled = torch.cat([scaled, torch.clamp(x[full:] / last, -1, 1)])
    if not torch.isfinite(absmax).all():
        raise ValueError("NF4 quantisation needs finite values; this weight holds inf or NaN")
    if n % 2:
        scaled = torch.cat([scaled, scaled.new_zeros(1)])
    q = torch.bucketize(scaled, _MIDPOINTS).to(torch.uint8)
    return (q[0::2] << 4) | q[1::2], absmax


def dequantize_into(
    codes: torch.Tensor,
    absmax: torch.Tensor,
    out: torch.Tensor,
    group_size: int,
    *,
    isa: int | None = None,
    num_threads: int | None = None,
) -> None:
    """Fills ``out`` (contiguous, fp32 / bf16 / fp16) with the values of ``codes`` and ``absmax``: by the
    kernel on the CPU, by the same arithmetic in torch ops on an accelerator (the shard was read onto
    it). ``isa``: an ``infinity._adam`` ISA code (None: the widest this CPU runs)."""
    n = out.numel()
    if out.dtype not in _DTYPES or not out.is_contiguous():
        raise ValueError(
            f"NF4 dequantises into a contiguous float32, bfloat16 or float16 tensor; got "
            f"{out.dtype}{'' if out.is_contiguous() else ', not contiguous'}"
        )
    if codes.dtype != torch.uint8 or absmax.dtype != torch.float32:
        raise ValueError(
            f"codes must be uint8 and absmax float32; got {codes.dtype}, {absmax.dtype}"
        )
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1; got {group_size}")
    if codes.numel() < codes_nbytes(n) or absmax.numel() < groups(n, group_size):
        raise ValueError(
            f"{n} values in groups of {group_size} need {codes_nbytes(n)} code bytes and "
            f"{groups(n, group_size)} scales; got {codes.numel()} and {absmax.numel()}"
        )
    if not (codes.is_contiguous() and absmax.is_contiguous()):
        raise ValueError("codes and absmax must be contiguous")
    if out.device.type != "cpu":
        pairs = torch.stack((codes[: codes_nbytes(n)] >> 4, codes[: codes_nbytes(n)] & 0xF), dim=1)
        q = pairs.reshape(-1)[:n].long()
        scale = absmax[: groups(n, group_size)].repeat_interleave(group_size)[:n]
        out.copy_(CODE.to(out.device)[q] * scale.to(out.device))
        return
    _adam.dequantize_nf4(
        codes=codes.data_ptr(),
        absmax=absmax.data_ptr(),
        out=out.data_ptr(),
        dtype=_DTYPES[out.dtype],
        numel=n,
        group_size=group_size,
        isa=_adam.best_isa() if isa is None else isa,
        num_threads=torch.get_num_threads() if num_threads is None else num_threads,
    )


def dequantize(
    codes: torch.Tensor,
    absmax: torch.Tensor,
    numel: int,
    group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The ``numel`` values of ``codes`` and ``absmax`` as a new tensor of ``dtype``."""
    out = torch.empty(numel, dtype=dtype)
    dequantize_into(codes, absmax, out, group_size)
    return out
