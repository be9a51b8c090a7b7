"""Weight-only group quantisation of a shard at rest: its format, and quantising into it and back.

[Note: quantised shards]
With ``weight_quantization.quantized_initialization`` (inference only), a
unit's shard rests in the parameter store as bytes laid out by its
ShardFormat: the shard's elements in *pieces*, one per stretch of one
parameter (a Segment of zero's unit layout) plus the padding. A piece of a matrix
parameter (2-D and up: the weights of Linear, Embedding, Conv1D) is
quantised; everything else (biases, norms, padding) stays in the unit's
dtype, as DeepSpeed leaves them. A quantised piece of n elements is cut into
groups of ``group_size`` consecutive elements (along the last dimension when
the row length is a multiple of the group size: DeepSpeed's group_dim 1) and
stored as
- codes: ``num_bits`` per element, unsigned (8: one byte; 4: two per byte,
  the even element in the low nibble), the last group padded with zeros;
- scales: one fp16 per group;
- offsets: one fp16 per group (asymmetric: the group's minimum); none when
  symmetric (codes are then centred on 2^(bits-1)).
Each part starts at a 16-byte boundary. Dequantised x = (q - zero) · scale +
offset in fp32, rounded once to the unit's dtype; quantising computes q from
the fp16-rounded scale and offset, so dequantising is exact given the codes.
Per 64-element group of a bf16 weight: 128 B as loaded, 68 B at 8 bits (1.9×
fewer), 36 B at 4 bits asymmetric (3.6×).

``quant_type`` "nf4" (QLoRA's NormalFloat, infinity/weights/nf4.py) lays a
quantised piece out as bitsandbytes does: codes, 4 bits per element with the
even element in the *high* nibble, then one fp32 absmax per group (no
offsets); a piece is its own stretch of values, so its last group may be
shorter, as bitsandbytes' is. 34 B per 64-element group (3.8× fewer than
bf16). With ``double_quant`` (QLoRA's double quantisation, [Note: NF4 double
quantisation] in csrc/adam/kernel.h) the fp32 absmax part is replaced by the
piece's scales quantised again (nf4.quantize_scales): one uint8 code per group,
then one fp32 part holding the offset (the scales' mean) followed by one fp32
absmax per block of 256 groups: ~33 B per 64-element group (0.5 + 1/64 +
4/(64·256) bytes per weight, 3.9× fewer than bf16). It is dequantised by the
C++ kernel (nf4.dequantize_into, the nested scales in the same pass), the
integer formats by torch ops.

The unit's shard and its pieces come from zero (``infinity.zero.quantized_shards``
builds a unit's ShardFormat from its layout and serves dequantised shards to
the partitioner); this module knows only stretches of elements and the
shapes of the parameters they belong to.

Threading: none (pure functions and immutable records).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import torch

from infinity.aio import DIRECT_ALIGNMENT
from infinity.memory import round_up
from infinity.weights import nf4

PART_ALIGN = 16
SCALE_DTYPE = torch.float16
NF4_CHUNK_NUMEL = 1 << 22
"""NF4 quantises a piece this many elements at a time (groups are independent): its torch
temporaries (fp32 values, scaled values, int64 bucket indices: ~20 bytes an element) stay ~80 MiB
however large the piece (a 7B model's embedding is 131M elements: 2.6 GB at once)."""


def _up(n: int) -> int:
    return round_up(n, PART_ALIGN)


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """How matrices are quantised: the config's quantized_initialization."""

    num_bits: int
    group_size: int
    symmetric: bool
    quant_type: str = "int"
    """"int": the integer codes above; "nf4": QLoRA's NormalFloat (4 bits, fp32 absmax scales)."""
    double_quant: bool = False
    """NF4 only: the absmax scales quantised again (8-bit codes, an fp32 absmax per 256 of them)."""

    def __post_init__(self) -> None:
        if self.num_bits not in (4, 8):
            raise ValueError(f"num_bits must be 4 or 8; got {self.num_bits}")
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2; got {self.group_size}")
        if self.quant_type not in ("int", "nf4"):
            raise ValueError(f'quant_type must be "int" or "nf4"; got {self.quant_type!r}')
        if self.quant_type == "nf4" and self.num_bits != 4:
            raise ValueError(f"NF4 stores 4 bits per weight; got num_bits={self.num_bits}")
        if self.double_quant and self.quant_type != "nf4":
            raise ValueError(
                f"double quantisation applies to NF4 scales; got quant_type={self.quant_type!r}"
            )

    @property
    def name(self) -> str:
        """The format in a word or two, for messages and tables: int8, int4, NF4, NF4+DQ."""
        if self.quant_type == "nf4":
            return "NF4+DQ" if self.double_quant else "NF4"
        return f"int{self.num_bits}"

    @property
    def scale_nbytes(self) -> int:
        """Bytes of one group's scale: fp16, NF4's fp32 absmax, or its uint8 code (double quant)."""
        if self.quant_type == "nf4":
            return 1 if self.double_quant else 4
        return 2

    def meta_nbytes(self, groups: int) -> int:
        """Bytes of a quantised piece's scales and what follows them (offsets, nested scales), each
        part at a PART_ALIGN boundary."""
        scales = _up(groups * self.scale_nbytes)
        if self.double_quant:
            return scales + _up(4 * (1 + nf4.scale_blocks(groups)))
        return scales + (_up(groups * 2) if self.has_offsets else 0)

    @property
    def has_offsets(self) -> bool:
        return self.quant_type == "int" and not self.symmetric

    @property
    def levels(self) -> int:
        return (1 << self.num_bits) - 1


@dataclasses.dataclass(frozen=True)
class Piece:
    """Elements [lo, hi) of the shard, raw (the unit's dtype) or quantised, at byte ``offset``."""

    lo: int
    hi: int
    quantized: bool
    offset: int
    groups: int = 0
    """Quantised pieces: groups of group_size elements (the last one padded)."""

    @property
    def numel(self) -> int:
        return self.hi - self.lo


@dataclasses.dataclass(frozen=True)
class ShardFormat:
    """One unit's shard at rest (see [Note: quantised shards])."""

    spec: QuantSpec
    dtype: torch.dtype
    """The unit's dtype: what raw pieces are stored in and what dequantising gives."""
    numel: int
    """Elements of the shard (padding included)."""
    pieces: tuple[Piece, ...]
    nbytes: int

    def _codes_nbytes(self, p: Piece) -> int:
        return -(-p.groups * self.spec.group_size * self.spec.num_bits // 8)

    def _parts(self, p: Piece) -> tuple[int, int, int]:
        """Byte offsets of a quantised piece's codes, scales and offsets (double quant: the fp32
        offset and block absmax of the nested scales)."""
        codes = p.offset
        scales = codes + _up(self._codes_nbytes(p))
        offsets = scales + _up(p.groups * self.spec.scale_nbytes)
        return codes, scales, offsets


def shard_format(
    stretches: Iterable[tuple[int, int, tuple[int, ...]]],
    numel: int,
    dtype: torch.dtype,
    spec: QuantSpec,
) -> ShardFormat:
    """The at-rest format of a shard of ``numel`` elements of ``dtype`` whose ``stretches`` (element
    ranges [lo, hi) in flat order, each with the shape of the parameter it is part of) hold parameters;
    elements between and after them (padding) stay raw."""
    itemsize = dtype.itemsize
    pieces: list[Piece] = []
    offset = 0
    pos = 0

    def add(lo: int, hi: int, quantized: bool) -> None:
        nonlocal offset
        if hi <= lo:
            return
        if quantized:
            groups = math.ceil((hi - lo) / spec.group_size)
            codes = _up(-(-groups * spec.group_size * spec.num_bits // 8))
            meta = spec.meta_nbytes(groups)
            pieces.append(Piece(lo, hi, True, offset, groups))
            offset += codes + meta
        else:
            pieces.append(Piece(lo, hi, False, offset))
            offset += _up((hi - lo) * itemsize)

    for lo, hi, shape in stretches:
        add(pos, lo, False)
        add(lo, hi, len(shape) >= 2)
        pos = hi
    add(pos, numel, False)
    return ShardFormat(
        spec, dtype, numel, tuple(pieces), round_up(max(offset, 1), DIRECT_ALIGNMENT)
    )


def quantize_into(
    fmt: ShardFormat, values: torch.Tensor, out: torch.Tensor, *, name: str = "the unit"
) -> None:
    """Writes ``values`` (the shard, ``fmt.numel`` elements) into ``out`` (``fmt.nbytes`` uint8)."""
    if values.numel() < fmt.numel or out.numel() < fmt.nbytes or out.dtype != torch.uint8:
        raise ValueError(
            f"{name}: quantize_into needs {fmt.numel} values and {fmt.nbytes} bytes; got "
            f"{values.numel()} values and {out.numel()} {out.dtype}"
        )
    spec = fmt.spec
    flat = values.reshape(-1)
    for p in fmt.pieces:
        src = flat[p.lo : p.hi]
        if not p.quantized:
            out[p.offset : p.offset + p.numel * src.element_size()].copy_(
                src.to(fmt.dtype).view(torch.uint8)
            )
            continue
        g = spec.group_size
        c, so, oo = fmt._parts(p)
        if spec.quant_type == "nf4":
            absmax = torch.empty(p.groups, dtype=torch.float32)
            step = _nf4_chunk(g)
            for lo in range(0, p.numel, step):
                try:
                    codes, part = nf4.quantize(src[lo : lo + step], g)
                except ValueError as e:
                    raise ValueError(f"{name}: {e}") from None
                out[c + lo // 2 : c + lo // 2 + codes.numel()].copy_(codes)
                absmax[lo // g : lo // g + part.numel()].copy_(part)
            if not spec.double_quant:
                out[so : so + 4 * p.groups].copy_(absmax.view(torch.uint8))
                continue
            nested = nf4.quantize_scales(absmax)
            out[so : so + p.groups].copy_(nested.codes)
            tail = torch.cat([torch.tensor([nested.offset], dtype=torch.float32), nested.absmax])
            out[oo : oo + 4 * tail.numel()].copy_(tail.view(torch.uint8))
            continue
        x = torch.zeros(p.groups * g, dtype=torch.float32)
        x[: p.numel] = src.float()
        x = x.view(p.groups, g)
        if p.numel % g:  # the padded tail of the last group must not widen its range
            x[-1, p.numel % g :] = x[-1, 0]
        if spec.symmetric:
            half = (spec.levels + 1) // 2  # codes 1..levels, centred on `half`
            scale = (x.abs().amax(dim=1) / (half - 1)).to(SCALE_DTYPE)
            s = torch.where(scale == 0, torch.ones_like(scale), scale).float()
            q = torch.clamp(torch.round(x / s[:, None]) + half, 1, spec.levels)
            base = None
        else:
            lo_v, hi_v = x.amin(dim=1), x.amax(dim=1)
            base = lo_v.to(SCALE_DTYPE)
            scale = ((hi_v - base.float()) / spec.levels).to(SCALE_DTYPE)
            s = torch.where(scale == 0, torch.ones_like(scale), scale).float()
            q = torch.clamp(torch.round((x - base.float()[:, None]) / s[:, None]), 0, spec.levels)
        if not (torch.isfinite(scale).all() and (base is None or torch.isfinite(base).all())):
            raise ValueError(
                f"{name}: a weight group's range does not fit fp16 scales (|w| up to "
                f"{float(x.abs().max()):.3g}); quantise a model with weights below 65504, "
                "or leave weight_quantization out"
            )
        codes = q.to(torch.uint8).reshape(-1)
        if spec.num_bits == 4:
            codes = codes[0::2] | (codes[1::2] << 4)
        out[c : c + codes.numel()].copy_(codes)
        out[so : so + 2 * p.groups].copy_(scale.view(torch.uint8))
        if base is not None:
            out[oo : oo + 2 * p.groups].copy_(base.view(torch.uint8))


def _nf4_chunk(group_size: int) -> int:
    """Elements per NF4 quantisation step: whole groups, an even count (two codes a byte)."""
    groups = max(1, NF4_CHUNK_NUMEL // group_size)
    return group_size * (groups + groups % 2 if group_size % 2 else groups)


def dequantize_into(fmt: ShardFormat, packed: torch.Tensor, out: torch.Tensor) -> None:
    """Fills ``out`` (``fmt.numel`` elements of ``fmt.dtype``) from the packed shard."""
    spec = fmt.spec
    flat = out.reshape(-1)
    for p in fmt.pieces:
        if not p.quantized:
            n = p.numel * flat.element_size()
            flat[p.lo : p.hi].view(torch.uint8).copy_(packed[p.offset : p.offset + n])
            continue
        g = spec.group_size
        c, so, oo = fmt._parts(p)
        codes = packed[c : c + fmt._codes_nbytes(p)]
        if spec.quant_type == "nf4":
            scales = _nf4_scales(spec, p.groups, so, oo, packed)
            nf4.dequantize_into(codes, scales, flat[p.lo : p.hi], g)
            continue
        if spec.num_bits == 4:
            q = torch.stack((codes & 0xF, codes >> 4), dim=1).reshape(p.groups, g)
        else:
            q = codes.view(p.groups, g)
        scale = packed[so : so + 2 * p.groups].view(SCALE_DTYPE).float()
        x = q.float()
        if spec.symmetric:
            x.sub_((spec.levels + 1) // 2).mul_(scale[:, None])
        else:
            base = packed[oo : oo + 2 * p.groups].view(SCALE_DTYPE).float()
            torch.addcmul(base[:, None], x, scale[:, None], out=x)
        flat[p.lo : p.hi].copy_(x.reshape(-1)[: p.numel])


def _nf4_scales(
    spec: QuantSpec, groups: int, so: int, oo: int, packed: torch.Tensor
) -> torch.Tensor | nf4.NestedScales:
    """A packed NF4 piece's scales (its parts at ``so`` and ``oo``) as views of ``packed``: the fp32
    absmax, or the nested scales."""
    if not spec.double_quant:
        return packed[so : so + 4 * groups].view(torch.float32)
    tail = packed[oo : oo + 4 * (1 + nf4.scale_blocks(groups))].view(torch.float32)
    return nf4.NestedScales(packed[so : so + groups], tail[1:], float(tail[0]))
