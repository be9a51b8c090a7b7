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

Double quantisation ([Note: NF4 double quantisation] in csrc/adam/kernel.h; bitsandbytes'
``compress_statistics=True``): ``quantize_scales`` quantises a tensor's absmax scales again — their mean
subtracted as ``offset``, then 8-bit blockwise over blocks of 256 scales on bitsandbytes' signed dynamic
code (``DYNAMIC_CODE``), each block with its own fp32 absmax — as ``NestedScales``; ``dequantize_into``
takes them in place of the fp32 absmax and the kernel dequantises them in the same pass. Quantising
mirrors bitsandbytes 0.50.2's CPU ``quantize_blockwise`` step by step: a reciprocal multiply, clamped
to [-1, 1], mapped to one of 65536 bins (((v + 1) · 0.5) · 65535 + 0.5, truncated) and looked up in a
table of the nearest code per bin (fp32 midpoints), so the codes, and hence the dequantised weights,
are bitsandbytes' own (tests/weights/test_nf4_oracle.py). The offset is torch's fp32 ``mean``, as
bitsandbytes takes it.

Threading: none (pure functions); the kernel releases the GIL and uses the CPU Adam kernels' threads.
"""

from __future__ import annotations

import dataclasses
import functools

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


def _dynamic_code() -> torch.Tensor:
    """bitsandbytes' ``create_dynamic_map()`` (signed, 7 exponent bits, 8 bits): for each decade
    10^(e-6), e = 0..6, the midpoints of 2^e + 1 fp32 points from 0.1 to 1, scaled in fp32, with both
    signs; then 0 and 1; sorted. The same fp32 operations in the same order, so the same bits."""
    values: list[float] = []
    for e in range(7):
        bounds = torch.linspace(0.1, 1, 2**e + 1, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        values += ((10 ** (e - 6)) * means).tolist() + (-(10 ** (e - 6)) * means).tolist()
    values += [0.0, 1.0]
    return torch.tensor(sorted(values), dtype=torch.float32)


DYNAMIC_CODE = _dynamic_code()
"""The 256 values the nested scales' 8-bit codes index (bitsandbytes' dynamic map), ascending."""
SCALE_BLOCK = 256
"""Scales per block of the nested quantisation (bitsandbytes' blocksize for compress_statistics)."""
_BINS = 65536


@functools.cache
def _nearest_code_per_bin() -> torch.Tensor:
    """For each of the 65536 bins of [-1, 1], the index of the nearest DYNAMIC_CODE value (the first
    whose fp32 midpoint with the next is not below the bin's value), as bitsandbytes' build_quantize_lut."""
    midpoints = 0.5 * (DYNAMIC_CODE[:-1] + DYNAMIC_CODE[1:])
    bins = -1.0 + (2.0 * torch.arange(_BINS, dtype=torch.float32)) / float(_BINS - 1)
    return torch.searchsorted(midpoints, bins, side="left").to(torch.uint8)


@dataclasses.dataclass(frozen=True)
class NestedScales:
    """A tensor's NF4 scales quantised again: group g's scale is
    DYNAMIC_CODE[codes[g]] · absmax[g // SCALE_BLOCK] + offset (fp32, each step rounded)."""

    codes: torch.Tensor
    """uint8, one per group."""
    absmax: torch.Tensor
    """fp32, one per block of SCALE_BLOCK groups."""
    offset: float
    """The fp32 mean of the scales (a Python float holding an fp32 value exactly)."""

    def values(self) -> torch.Tensor:
        """The dequantised fp32 scales (torch ops; the kernel computes the same per group)."""
        n = self.codes.numel()
        block = self.absmax.repeat_interleave(SCALE_BLOCK)[:n].to(self.codes.device)
        unshifted = DYNAMIC_CODE.to(self.codes.device)[self.codes.long()] * block
        return unshifted + torch.tensor(self.offset, dtype=torch.float32, device=unshifted.device)


def scale_blocks(groups: int) -> int:
    """fp32 absmax values of the nested scales of ``groups`` groups."""
    return -(-groups // SCALE_BLOCK)


def quantize_scales(absmax: torch.Tensor) -> NestedScales:
    """``absmax`` (fp32 NF4 scales) quantised again as bitsandbytes' ``quantize_4bit(...,
    compress_statistics=True)`` does: codes, block absmax and offset equal to its nested state's."""
    if absmax.dtype != torch.float32 or absmax.dim() != 1:
        raise ValueError(
            f"the scales must be a 1-D float32 tensor; got {absmax.dtype} {tuple(absmax.shape)}"
        )
    n = absmax.numel()
    if n == 0:
        return NestedScales(torch.empty(0, dtype=torch.uint8), torch.empty(0), 0.0)
    offset = absmax.mean()
    shifted = absmax - offset
    blocks = scale_blocks(n)
    padded = shifted.new_zeros(blocks * SCALE_BLOCK)
    padded[:n] = shifted
    block_absmax = padded.view(blocks, SCALE_BLOCK).abs().amax(dim=1)
    per_scale = block_absmax.repeat_interleave(SCALE_BLOCK)[:n]
    scaled = torch.clamp(shifted * (1.0 / per_scale), -1, 1)
    scaled = torch.where(per_scale == 0, 0.0, scaled)  # 0 / 0 above: keep the bin in range
    bins = (((scaled + 1.0) * 0.5) * float(_BINS - 1) + 0.5).to(torch.int32)
    codes = _nearest_code_per_bin()[bins.long()]
    # a block of equal scales (all at the offset) gets code 0, as bitsandbytes writes it
    codes = torch.where(per_scale == 0, torch.zeros_like(codes), codes)
    return NestedScales(codes, block_absmax, float(offset))


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
    scales: torch.Tensor | NestedScales,
    out: torch.Tensor,
    group_size: int,
    *,
    isa: int | None = None,
    num_threads: int | None = None,
) -> None:
    """Fills ``out`` (contiguous, fp32 / bf16 / fp16) with the values of ``codes`` and ``scales`` (fp32
    absmax, or NestedScales): by the kernel on the CPU, by the same arithmetic in torch ops on an
    accelerator (the shard was read onto it). ``isa``: an ``infinity._adam`` ISA code (None: the widest
    this CPU runs)."""
    n = out.numel()
    if out.dtype not in _DTYPES or not out.is_contiguous():
        raise ValueError(
            f"NF4 dequantises into a contiguous float32, bfloat16 or float16 tensor; got "
            f"{out.dtype}{'' if out.is_contiguous() else ', not contiguous'}"
        )
    nested = scales if isinstance(scales, NestedScales) else None
    per_group = nested.codes if nested is not None else scales
    assert isinstance(per_group, torch.Tensor)
    want = torch.uint8 if nested is not None else torch.float32
    if codes.dtype != torch.uint8 or per_group.dtype != want:
        raise ValueError(
            f"codes must be uint8 and absmax float32 (nested scales: uint8 codes); got {codes.dtype}, "
            f"{per_group.dtype}"
        )
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1; got {group_size}")
    ngroups = groups(n, group_size)
    if codes.numel() < codes_nbytes(n) or per_group.numel() < ngroups:
        raise ValueError(
            f"{n} values in groups of {group_size} need {codes_nbytes(n)} code bytes and "
            f"{ngroups} scales; got {codes.numel()} and {per_group.numel()}"
        )
    if nested is not None and (
        nested.absmax.dtype != torch.float32 or nested.absmax.numel() < scale_blocks(ngroups)
    ):
        raise ValueError(
            f"{ngroups} nested scales need {scale_blocks(ngroups)} float32 block absmax values; got "
            f"{nested.absmax.numel()} {nested.absmax.dtype}"
        )
    tensors = (codes, per_group) + ((nested.absmax,) if nested is not None else ())
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("codes and absmax must be contiguous")
    if out.device.type != "cpu":
        pairs = torch.stack((codes[: codes_nbytes(n)] >> 4, codes[: codes_nbytes(n)] & 0xF), dim=1)
        q = pairs.reshape(-1)[:n].long()
        per_scale = nested.values() if nested is not None else per_group
        scale = per_scale[:ngroups].repeat_interleave(group_size)[:n]
        out.copy_(CODE.to(out.device)[q] * scale.to(out.device))
        return
    common = dict(
        codes=codes.data_ptr(),
        out=out.data_ptr(),
        dtype=_DTYPES[out.dtype],
        numel=n,
        group_size=group_size,
        isa=_adam.best_isa() if isa is None else isa,
        num_threads=torch.get_num_threads() if num_threads is None else num_threads,
    )
    if nested is None:
        _adam.dequantize_nf4(absmax=per_group.data_ptr(), **common)
        return
    _adam.dequantize_nf4(
        absmax=0,
        scale_codes=nested.codes.data_ptr(),
        scale_code=DYNAMIC_CODE.data_ptr(),
        scale_absmax=nested.absmax.data_ptr(),
        scale_offset=nested.offset,
        scale_block=SCALE_BLOCK,
        **common,
    )


def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor | NestedScales,
    numel: int,
    group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The ``numel`` values of ``codes`` and ``scales`` as a new tensor of ``dtype``."""
    out = torch.empty(numel, dtype=dtype)
    dequantize_into(codes, scales, out, group_size)
    return out
