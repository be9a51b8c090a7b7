"""What the estimator adds to a RuntimePlan: how memory behaves around what the runtime allocates.

The runtime's own sizing decisions (pools, homes, keys, reserves, caches,
budgets) are not here: they are the RuntimePlan (runtime_plan.py), which the
engine allocates and itemise.py itemises. What is here the runtime does not
decide: how the allocator and the OS account for a buffer (huge pages, swap
files rounded to blocks, file-system metadata), the transient tensors that
autograd and gradient reduction make and free step after step, what zero.Init
leaves on the heap, and overheads measured on this machine. Each says where it
comes from: "measured" (with what), or the code or system whose behaviour it
models. tests/estimate/test_reality.py trains in subprocesses and compares the
whole estimate with the peak RSS and swap-file bytes the OS reports.

Conventions: sizes in bytes unless named ``*_numel``; "shard" is one rank's
part of a unit (infinity.zero.layout), padded to a multiple of 4 KiB.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from infinity.aio import DIRECT_ALIGNMENT, HUGE_PAGE_SIZE
from infinity.estimate.runtime_plan import FP32_NBYTES, itemsize
from infinity.memory import round_up
from infinity.zero.init import init_store_of
from infinity.zero.layout import make_layout
from infinity.zero.unit import ParamUnit

INIT_POOL_NBYTES = 64 << 20
"""infinity/zero/init.py _INIT_POOL_NBYTES: zero.Init's pool when parameters wait on NVMe."""

GROW_STEP_MAX = 1 << 30
"""infinity/store/swapspace.py GROW_STEP_MAX: swap files grow geometrically, by at most 1 GiB."""


INIT_OVERHEAD_NBYTES = 16 << 20
"""Measured, not mirrored: what initialize allocates besides its stores — the aio engines'
threads and rings, store records, hooks and heap left over from moving the model home (4-5 MiB
for a 0.1M-parameter GPT, up to 17 MiB for 57M on CPU, torch 2.13)."""


def first_step_overhead_nbytes(dtype: torch.dtype) -> int:
    """Measured, not mirrored: what the first forward/backward/step allocates once — kernel
    workspaces, autograd's thread, thread-local arenas. A 0.1M-parameter GPT measured 16 MiB in
    fp32 and 30 MiB in bf16 (CPU, torch 2.13); larger models a few MiB more (weight packing)."""
    return (32 << 20) if dtype == torch.float32 else (48 << 20)


SLACK_PERCENT = 10
"""Measured, not mirrored: glibc's heap keeps some of what torch frees (grads, flat buffers,
activations are freed and made again every step), so peak RSS exceeds the live tensors by a
share of them — up to ~7% here, and it moves by ±3% of the training phase from run to run."""


def grad_accumulator_nbytes(units: Sequence[ParamUnit], stage: int) -> int:
    """infinity/zero/grads.py GradReducer (``deferred``), stages 0-1: every unit's whole gradient
    accumulates in a flat fp32 buffer (padded, from the TensorCache) until the window's end,
    when reduce_window reduces and returns them; from stage 2 grads go straight to the partitions."""
    return sum(u.layout.padded_numel for u in units) * FP32_NBYTES if stage <= 1 else 0


def grad_in_flight_nbytes(grad_numels: Sequence[int], dtype: torch.dtype) -> int:
    """infinity/zero/grad_hooks.py + grads.py add, every stage: one parameter's grad at a time
    (``p.grad`` is taken in its post-accumulate hook), added into fp32 (a 16-bit grad is upcast)."""
    b = itemsize(dtype)
    return max(grad_numels, default=0) * (b + (FP32_NBYTES if b < FP32_NBYTES else 0))


def mapped_nbytes(nbytes: int, *, huge_pages: bool) -> int:
    """csrc/aio/aligned_buffer.cc AlignedBuffer: what an aligned_empty buffer maps (and prefaults).

    2 MiB pages (hugetlb, else THP) for buffers of at least 2 MiB when asked,
    4 KiB pages otherwise; either way the whole mapping is touched at once.
    """
    if nbytes <= 0:
        return 0
    if huge_pages and nbytes >= HUGE_PAGE_SIZE:
        return round_up(nbytes, HUGE_PAGE_SIZE)
    return round_up(nbytes, DIRECT_ALIGNMENT)


def swap_nbytes(total: int, block_size: int, ndrives: int = 1) -> int:
    """infinity/store/swapspace.py SwapSpace.reserve/_grow_to: the bytes ``posix_fallocate`` reserves
    for ``total`` bytes of keys over ``ndrives`` drives (all together; each holds an equal share) —
    4 KiB, then whole stripes of one block_size piece per drive."""
    if total <= 0:
        return 0
    return round_up(round_up(total, DIRECT_ALIGNMENT), block_size * ndrives)


LOCK_FILE_NBYTES = DIRECT_ALIGNMENT
"""infinity/store/swapdir.py: each store's directory holds an ``infinity.lock`` (one block)."""

EXTENT_SPAN_NBYTES = 64 << 20
"""File-system metadata, not mirrored: ext4 keeps a large file's extents (at most 128 MiB each) in
index blocks once they outgrow the inode; one 4 KiB block per 64 MiB of swap is a generous bound."""


def swap_dir_overhead_nbytes(swap_nbytes: int) -> int:
    """Disk a store's swap directory uses beyond its files' sizes: the lock file and extent blocks."""
    if swap_nbytes <= 0:
        return 0
    return LOCK_FILE_NBYTES + DIRECT_ALIGNMENT * -(-swap_nbytes // EXTENT_SPAN_NBYTES)


TRIM_THRESHOLD_NBYTES = 256 << 20
"""infinity/memory/trim.py FreedMemory: zero.Init trims the heap each time it has freed this many
bytes of parameters as built."""


def zero_init_heap_nbytes(param_nbytes: Sequence[int]) -> int:
    """infinity/zero/init.py + memory/trim.py: what building under zero.Init leaves on the heap
    until initialize trims it. Each parameter's full values and its shard are freed as it is
    partitioned and kept by the heap (2 × the model) until FreedMemory trims at its threshold; the
    parameter being initialised (its full values, the initialiser's temporaries, its shard) adds
    at most 2 × the largest one. Measured (CPU, glibc; peak RSS of the build less the zero.Init
    pool, beyond the threshold's 256 MiB): transformers' Llama with a 32000-row embedding, bf16 and
    fp32, hidden 2048 and 4096: 0.98-1.55 × the largest parameter; infinity.models.GPT at 25M and
    108M parameters (small largest parameters) is held by the reality tests' zero.Init cases."""
    return min(2 * sum(param_nbytes), TRIM_THRESHOLD_NBYTES) + 2 * max(param_nbytes, default=0)


def swap_growth_nbytes(sizes: Sequence[int], block_size: int, ndrives: int = 1) -> int:
    """infinity/store/swapspace.py SwapSpace.alloc without a reserve (zero.Init's store): the
    files grow to max(need, capacity + min(capacity, 1 GiB)) at each allocation that does not fit,
    in whole stripes over ``ndrives`` drives (all drives together; each holds an equal share)."""
    capacity = used = 0
    for n in sizes:
        n = round_up(max(n, 1), DIRECT_ALIGNMENT)
        if used + n > capacity:
            need = used + n
            step = capacity + min(capacity, GROW_STEP_MAX)
            capacity = round_up(max(need, step), block_size * ndrives)
        used += n
    return capacity


def flat_buffers_nbytes(
    units: Sequence[ParamUnit],
    stage: int,
    world_size: int,
    dtype: torch.dtype,
    *,
    cap_nbytes: int,
    caching: bool,
) -> int:
    """Peak bytes of the TensorCache's flat buffers (zero/buffers.py) beyond those counted as
    their own items (stages 0-1's gradient accumulators, stage 3's gathered units):

    - stage 1 (grads.py _reduce_into_shard at the window's end) and stages 2-3 with world
      size > 1 (grads.py add/finish): an fp32 shard buffer, and for 2-3 the micro-batch's
      flat fp32 grads of the unit being reduced;
    - stages 1-2 with world size > 1 (build.py _resident_param_writer): a full buffer of the
      parameter dtype to all-gather updated shards into;
    - stage 3 with world size > 1 (partitioner.py _ungather): released gathers, kept for reuse.
    In use: one of each at a time. Cached: buffers put back, reused by (numel, dtype), at most
    the cap (RuntimePlan.tensor_cache_cap_nbytes) — on CUDA none (TensorCache.put keeps nothing
    there: ``caching`` False).
    """
    b = itemsize(dtype)
    largest_flat = max((u.layout.padded_numel for u in units), default=0)
    largest_shard = max((u.layout.shard_numel for u in units), default=0)
    in_use = 0
    cacheable = 0
    if stage == 1 or (stage >= 2 and world_size > 1):
        in_use += FP32_NBYTES * largest_shard
        cacheable += FP32_NBYTES * sum({u.layout.shard_numel for u in units})
    if stage >= 2 and world_size > 1:
        in_use += FP32_NBYTES * largest_flat
        cacheable += FP32_NBYTES * sum({u.layout.padded_numel for u in units})
    if world_size > 1 and stage in (1, 2):
        in_use = max(in_use, b * largest_flat)
        cacheable += b * sum({u.layout.padded_numel for u in units})
    if world_size > 1 and stage == 3:
        cacheable += sum(u.full_nbytes for u in units if not u.persistent)
    if not caching:
        return in_use
    return in_use + min(cap_nbytes, cacheable)


def zero_init_param_nbytes(model: nn.Module) -> list[int]:
    """Each parameter's full bytes as built (fp32), from zero.Init's store where it holds them."""
    params = list(dict.fromkeys(model.parameters()))
    store = init_store_of(params)
    out = []
    for p in params:
        shape = store.shape(p) if store is not None and p in store else p.shape
        out.append(math.prod(shape) * p.element_size())
    return out


def zero_init_shard_sizes(model: nn.Module, world_size: int) -> list[int]:
    """infinity/zero/init.py InitStore.partition: each parameter's own padded shard, in its dtype
    as built (fp32), in construction order."""
    params = list(dict.fromkeys(model.parameters()))
    store = init_store_of(params)
    out = []
    for p in params:
        shape = store.shape(p) if store is not None and p in store else p.shape
        if math.prod(shape) == 0:
            continue
        out.append(make_layout(["p"], [shape], p.dtype, world_size).shard_nbytes)
    return out
