"""The flat functional CPU Adam step: the entry point for buffers streamed from NVMe.

``adam_step`` updates one parameter's contiguous fp32 master weights and
moments in place, in one pass, reading a fp32/bf16/fp16 gradient and
optionally writing a bf16/fp16 copy of the new weights. ``foreach_adam_step``
does the same for many tensors in one call (one thread dispatch; what
``CPUAdam`` uses). ``has_overflow`` is the fp16 loss-scaling check.

The hyper-parameters travel as one :class:`AdamHyper` (lr, betas, eps, weight
decay, AdamW or Adam, bias correction), the C++ core's ``Hyper`` bound with
pybind11: checked when made, read-only, the same value on both sides of the
boundary; the step number is passed beside it (it differs per tensor).

The math is torch.optim.Adam/AdamW's (foreach=False); see
[Note: Adam numerics] in csrc/adam/kernel_impl.h. The kernels run in C++
with the GIL released, on ``num_threads`` threads (default:
``torch.get_num_threads()``).

Checks here are cheap (a few attribute reads per tensor) so that calling
``adam_step`` on every 1M-element piece of a stream costs microseconds.
These functions write through data pointers: they do not bump autograd
version counters (``CPUAdam`` does, for its parameters).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple, cast

import torch

from infinity import _adam
from infinity._adam import AdamHyper
from infinity.optim import kernel

_F32 = torch.float32
_GRAD_CODES = {
    torch.float32: _adam.FLOAT32,
    torch.bfloat16: _adam.BFLOAT16,
    torch.float16: _adam.FLOAT16,
}
_HALF_CODES = {torch.bfloat16: _adam.BFLOAT16, torch.float16: _adam.FLOAT16}


def _explain(name: str, t: object, allowed: Iterable[torch.dtype], numel: int | None) -> Exception:
    """The error for a tensor that failed the fast check: what is wrong and how to fix it."""
    if not isinstance(t, torch.Tensor):
        return TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        return ValueError(
            f"{name} is on {t.device}, but the CPU Adam kernel reads and writes host memory: "
            f"pass a CPU tensor (e.g. {name}.cpu(), or a pinned host buffer)"
        )
    if t.layout is not torch.strided:
        return ValueError(
            f"{name} has layout {t.layout}; the CPU Adam kernel needs a dense (strided) tensor"
        )
    names = " or ".join(str(d) for d in allowed)
    if t.dtype not in allowed:
        return TypeError(f"{name} has dtype {t.dtype}; the CPU Adam kernel needs {names}")
    if not t.is_contiguous():
        return ValueError(
            f"{name} is not contiguous (shape {tuple(t.shape)}, stride {t.stride()}); the kernel walks "
            f"flat memory: pass {name}.contiguous() or a flat view of a contiguous buffer"
        )
    return ValueError(
        f"{name} has {t.numel()} elements but param has {numel}; param, grad, exp_avg, "
        f"exp_avg_sq and out_half must all hold the same number of elements"
    )


def _threads(num_threads: int | None) -> int:
    if num_threads is None:
        return torch.get_num_threads()
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(
            f"num_threads must be a positive int or None (torch's count), got {num_threads!r}"
        )
    return num_threads


def _check_one(
    suffix: str, p: object, g: object, m: object, v: object, h: object
) -> tuple[int, int, int]:
    """Checks one parameter's tensors; returns (numel, grad code, half code or -1) or raises the error."""
    if not (
        isinstance(p, torch.Tensor)
        and p.is_cpu
        and p.dtype is _F32
        and p.layout is torch.strided
        and p.is_contiguous()
    ):
        raise _explain("param" + suffix, p, (_F32,), None)
    n = p.numel()
    for name, t in (("exp_avg", m), ("exp_avg_sq", v)):
        if not (
            isinstance(t, torch.Tensor)
            and t.is_cpu
            and t.dtype is _F32
            and t.layout is torch.strided
            and t.is_contiguous()
            and t.numel() == n
        ):
            raise _explain(name + suffix, t, (_F32,), n)
    g_code = _GRAD_CODES.get(g.dtype) if isinstance(g, torch.Tensor) else None
    if not (
        isinstance(g, torch.Tensor)
        and g_code is not None
        and g.is_cpu
        and g.layout is torch.strided
        and g.is_contiguous()
        and g.numel() == n
    ):
        raise _explain("grad" + suffix, g, tuple(_GRAD_CODES), n)
    if h is None:
        return n, g_code, -1
    h_code = _HALF_CODES.get(h.dtype) if isinstance(h, torch.Tensor) else None
    if not (
        isinstance(h, torch.Tensor)
        and h_code is not None
        and h.is_cpu
        and h.layout is torch.strided
        and h.is_contiguous()
        and h.numel() == n
    ):
        raise _explain("out_half" + suffix, h, tuple(_HALF_CODES), n)
    return n, g_code, h_code


class _Pointers(NamedTuple):
    """The tensors of a step as the kernel takes them: its keyword arguments, one entry per tensor."""

    params: list[int]
    grads: list[int]
    exp_avgs: list[int]
    exp_avg_sqs: list[int]
    out_halfs: list[int]
    """0 where no 16-bit copy is written."""
    numels: list[int]
    grad_dtypes: list[int]
    half_dtypes: list[int]
    """-1 where no 16-bit copy is written."""


def _gather(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    out_halves: Sequence[torch.Tensor | None] | None,
    single: bool,
) -> _Pointers:
    """Checks every tensor and returns the kernel's argument lists (pointers, sizes, dtype codes).

    The common case (everything right) takes one combined test per parameter:
    CPUAdam calls this for every tensor on every step. Only a failure takes
    the slow path that finds and names what is wrong.
    """
    count = len(params)
    for what, seq in (("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs)):
        if len(seq) != count:
            raise ValueError(
                f"{what} has {len(seq)} tensors but params has {count}; pass one per param"
            )
    if out_halves is not None and len(out_halves) != count:
        raise ValueError(
            f"out_halves has {len(out_halves)} entries but params has {count}; pass one per param (None to skip one)"
        )
    halves = out_halves if out_halves is not None else (None,) * count
    numels, g_codes, h_codes = [], [], []
    f32, codes = _F32, _GRAD_CODES
    for i in range(count):
        p, g, m, v, h = params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], halves[i]
        try:
            n = p.numel()
            ok = (
                p.dtype is f32
                and m.dtype is f32
                and v.dtype is f32
                and p.is_cpu
                and m.is_cpu
                and v.is_cpu
                and g.is_cpu
                and p.is_contiguous()
                and m.is_contiguous()
                and v.is_contiguous()
                and g.is_contiguous()
                and m.numel() == n
                and v.numel() == n
                and g.numel() == n
                and (
                    h is None
                    or (
                        h.dtype in _HALF_CODES and h.is_cpu and h.is_contiguous() and h.numel() == n
                    )
                )
            )
            g_code = codes.get(g.dtype)
        except (AttributeError, TypeError, RuntimeError):
            ok, g_code = False, None
        if ok and g_code is not None:
            h_code = -1 if h is None else _HALF_CODES[h.dtype]
        else:  # the precise check raises the error that names what is wrong
            n, g_code, h_code = _check_one("" if single else f"[{i}]", p, g, m, v, h)
        numels.append(n)
        g_codes.append(g_code)
        h_codes.append(h_code)
    return _Pointers(
        params=[t.data_ptr() for t in params],
        grads=[t.data_ptr() for t in grads],
        exp_avgs=[t.data_ptr() for t in exp_avgs],
        exp_avg_sqs=[t.data_ptr() for t in exp_avg_sqs],
        out_halfs=[0 if t is None else t.data_ptr() for t in halves],
        numels=numels,
        grad_dtypes=g_codes,
        half_dtypes=h_codes,
    )


def adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    hyper: AdamHyper,
    *,
    step: int | float,
    out_half: torch.Tensor | None = None,
    num_threads: int | None = None,
) -> None:
    """One AdamW (or Adam: ``hyper.adamw`` False, L2 decay) step, in place, on flat CPU buffers.

    ``param``, ``exp_avg``, ``exp_avg_sq``: contiguous fp32. ``grad``: contiguous
    fp32, bf16 or fp16. ``out_half``: None, or a contiguous bf16/fp16 tensor
    that receives ``param.to(out_half.dtype)`` of the updated weights, written
    in the same pass. All hold the same number of elements (their shapes may
    differ). ``step`` is the number of this update, 1 for the first (torch's
    ``state["step"]`` after its increment).

    Raises TypeError/ValueError naming the argument for a tensor that is not a
    CPU tensor, not contiguous, of the wrong dtype or size, or a ``hyper`` that
    is not an AdamHyper; ValueError for a step below 1 or buffers that overlap
    in memory.
    """
    ptrs = _gather(
        (param,),
        (grad,),
        (exp_avg,),
        (exp_avg_sq,),
        None if out_half is None else (out_half,),
        True,
    )
    _run(ptrs, hyper, step, num_threads)


def _run(ptrs: _Pointers, hyper: AdamHyper, step: int | float, num_threads: int | None) -> None:
    """The kernel call shared by adam_step and foreach_adam_step (``ptrs`` from _gather)."""
    if type(hyper) is not AdamHyper:
        raise TypeError(
            f"hyper must be an infinity.optim.AdamHyper, got {type(hyper).__name__}; make one with "
            f"AdamHyper(lr=..., beta1=..., beta2=..., eps=..., weight_decay=..., adamw=...)"
        )
    _adam.adam_step(
        **ptrs._asdict(),
        hyper=hyper,
        step=float(step),
        isa=kernel.isa_code,
        num_threads=_threads(num_threads),
    )


def foreach_adam_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    hyper: AdamHyper,
    *,
    step: int | float,
    out_halves: Sequence[torch.Tensor | None] | None = None,
    num_threads: int | None = None,
) -> None:
    """``adam_step`` over many tensors with the same hyper-parameters and step, in one call.

    The elements of all tensors are split evenly over the threads, so many
    small tensors cost one dispatch. Errors name the offending tensor by its
    index, e.g. ``grad[3]``.
    """
    ptrs = _gather(params, grads, exp_avgs, exp_avg_sqs, out_halves, False)
    _run(ptrs, hyper, step, num_threads)


def has_overflow(
    tensors: torch.Tensor | Iterable[torch.Tensor], *, num_threads: int | None = None
) -> bool:
    """True when any element of ``tensors`` (contiguous CPU fp32/bf16/fp16) is inf or NaN.

    One read-only pass, no temporaries, stopping early once found: the check
    behind dynamic fp16 loss scaling (DeepSpeed's ``CheckOverflow``).
    """
    if isinstance(tensors, torch.Tensor):
        tensors = (tensors,)
    ptrs, numels, codes = [], [], []
    for i, t in enumerate(tensors):
        code = _GRAD_CODES.get(t.dtype) if isinstance(t, torch.Tensor) else None
        if not (code is not None and t.is_cpu and t.layout is torch.strided and t.is_contiguous()):
            raise _explain(f"tensors[{i}]", t, tuple(_GRAD_CODES), None)
        ptrs.append(t.data_ptr())
        numels.append(t.numel())
        codes.append(code)
    return _adam.has_overflow(
        ptrs, numels, codes, isa=kernel.isa_code, num_threads=_threads(num_threads)
    )


def sum_squares(
    tensors: torch.Tensor | Iterable[torch.Tensor], *, num_threads: int | None = None
) -> float:
    """The sum of the squares of every element of ``tensors`` (contiguous CPU fp32), in double.

    The engine's gradient norm. Every square is exact in double and the sums
    run in a fixed order, so the result has the same bits on every ISA and
    thread count: the clipping coefficient, rounded to fp32, does not depend on
    the machine (torch's fp32 norms change with its reduction's vector width).
    """
    if isinstance(tensors, torch.Tensor):
        tensors = (tensors,)
    ptrs, numels = [], []
    for i, t in enumerate(tensors):
        ok = (
            isinstance(t, torch.Tensor)
            and t.dtype == _F32
            and t.is_cpu
            and t.layout is torch.strided
        )
        if not (ok and t.is_contiguous()):
            raise _explain(f"tensors[{i}]", t, (_F32,), None)
        ptrs.append(t.data_ptr())
        numels.append(t.numel())
    return _adam.sum_squares(ptrs, numels, isa=kernel.isa_code, num_threads=_threads(num_threads))


def stream_bound_step(
    param: torch.Tensor | Sequence[torch.Tensor],
    grad: torch.Tensor | Sequence[torch.Tensor],
    exp_avg: torch.Tensor | Sequence[torch.Tensor],
    exp_avg_sq: torch.Tensor | Sequence[torch.Tensor],
    *,
    num_threads: int | None = None,
) -> None:
    """The memory-bandwidth bound of an fp32 Adam step, measured on the same buffers.

    Reads the four fp32 arrays and writes three in place (param += grad,
    exp_avg += grad, exp_avg_sq += grad) with the kernels' loads, stores,
    threads and partitioning but no Adam math: no step over these buffers can
    be faster. Takes one tensor per argument, or sequences of them (a
    foreach step's buffers, so that the bound sees the same memory layout).
    bench/adam.py reports the Adam step's speed as a fraction of it.
    """
    single = isinstance(param, torch.Tensor)
    # Wrapped as given: _gather checks every element and names any that is not a tensor.
    seqs = [
        cast("Sequence[torch.Tensor]", (t,) if single else t)
        for t in (param, grad, exp_avg, exp_avg_sq)
    ]
    ptrs = _gather(seqs[0], seqs[1], seqs[2], seqs[3], None, single)
    for i, code in enumerate(ptrs.grad_dtypes):
        if code != _adam.FLOAT32:
            raise _explain("grad" if single else f"grad[{i}]", seqs[1][i], (_F32,), ptrs.numels[i])
    _adam.stream_bound(
        params=ptrs.params,
        grads=ptrs.grads,
        exp_avgs=ptrs.exp_avgs,
        exp_avg_sqs=ptrs.exp_avg_sqs,
        numels=ptrs.numels,
        isa=kernel.isa_code,
        num_threads=_threads(num_threads),
    )
