"""The allocation rules: what the runtime allocates for one setting, per rank — kept in this one place.

Every function here mirrors a named piece of runtime code; its docstring says
which. When that code changes, change the rule here. Two tests guard the
mirror: tests/estimate/test_rules.py builds real runtimes and compares these
numbers with their pools, home tensors, caches and swap files byte for byte,
and tests/estimate/test_reality.py trains in subprocesses and compares the
whole estimate with the peak RSS and swap-file bytes the OS reports.

Conventions: sizes in bytes unless named ``*_numel``; "shard" is one rank's
part of a unit (infinity.zero.layout), padded to a multiple of 4 KiB.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from infinity.aio import DIRECT_ALIGNMENT, HUGE_PAGE_SIZE
from infinity.config import InfinityConfig, ZeroConfig
from infinity.memory import round_up
from infinity.zero.init import init_store_of
from infinity.zero.layout import make_layout
from infinity.zero.unit import ParamUnit
from infinity.zero.units import UnitMap, build_units

FP32_NBYTES = 4

CACHED_FLAT_BUFFERS = 4
"""infinity/engine/build.py CACHED_FLAT_BUFFERS: the TensorCache keeps up to this many
of the largest unit's flat fp32 size."""

OPTIMIZER_POOL_BUFFERS = 3
"""infinity/engine/build.py _state_store: ``count = 3`` sub-groups in the optimizer pool
(the one being read, the one being updated, the one being written)."""

STATE_NBYTES_PER_ELEMENT = 16
"""The most optimizer-state bytes per element: fp32 master, m, v, g (see state_nbytes_per_element)."""

EMPTY_POOL_NBYTES = DIRECT_ALIGNMENT
"""infinity/engine/build.py: a store without NVMe still gets ``BufferPool(1, 4096)``."""

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


def param_dtype(cfg: InfinityConfig) -> torch.dtype:
    """infinity/engine/build.py train_dtype: the precision parameters train in."""
    if cfg.bf16.enabled:
        return torch.bfloat16
    if cfg.fp16.enabled:
        return torch.float16
    return torch.float32


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def unit_map_for(model: nn.Module, cfg: InfinityConfig, world_size: int) -> UnitMap:
    """infinity/engine/build.py build_runtime: the units the engine cuts the model into.

    Calls the engine's own infinity.zero.units.build_units (layout world 1 at
    stage 0, the persistence threshold only at stage 3, zero.Init's true shapes)
    with the meta device, so nothing is allocated and the model is not touched.
    """
    zero = cfg.zero_optimization
    store = init_store_of(list(model.parameters()))
    return build_units(
        model,
        world_size=1 if zero.stage == 0 else world_size,
        persistence_threshold=int(zero.stage3_param_persistence_threshold) if zero.stage == 3 else 0,
        device=torch.device("meta"),
        dtype=param_dtype(cfg),
        shape_of=store.shape if store is not None else None,
    )


def units_for(model: nn.Module, cfg: InfinityConfig, world_size: int) -> list[ParamUnit]:
    return unit_map_for(model, cfg, world_size).units


def partitioner_working_set(
    model: nn.Module, unit_map: UnitMap, counts: Callable[[ParamUnit], bool], *, full: bool = False
) -> int:
    """infinity/engine/build.py _working_set: the most (non-persistent) unit bytes the stage-3
    partitioner holds at once — the heaviest root-to-leaf chain of modules' units (a frame holds its
    module's units while its children run) plus the largest unit again (a tied weight held across
    backward). ``full``: gathered units (world size > 1) instead of this rank's shards."""

    def size(u: ParamUnit) -> int:
        return u.full_nbytes if full else u.layout.shard_nbytes

    def chain(m: nn.Module) -> int:
        own = sum(size(u) for u in unit_map.uses.get(m, ()) if not u.persistent and counts(u))
        return own + max((chain(c) for c in m.children()), default=0)

    largest = max((size(u) for u in unit_map.units if not u.persistent and counts(u)), default=0)
    return chain(model) + largest


def schedule_budget_nbytes(numel: float, world_size: int, dtype: torch.dtype) -> int:
    """infinity/engine/build.py _prefetch_scheduler + schedule/budget.py from_deepspeed: a DeepSpeed
    budget (elements, gathered) as this rank's bytes — ``numel / world_size × itemsize``."""
    return int(numel / world_size) * itemsize(dtype)


def resident_param_nbytes(numels: Sequence[int], dtype: torch.dtype, stage: int) -> int:
    """infinity/engine/build.py build_runtime, stages 0-2: ``p.data = p.data.to(device, dtype)`` —
    every parameter stays whole in the module (unpadded); stage 3 keeps none there."""
    return 0 if stage == 3 else sum(numels) * itemsize(dtype)


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


def init_transient_nbytes(units: Sequence[ParamUnit], dtype: torch.dtype) -> int:
    """infinity/engine/build.py _full_values and the loop after it: one unit's flat fp32 values
    (padded) and its shard converted to the parameter dtype, at a time."""
    largest = max((u.layout.padded_numel for u in units), default=0)
    return largest * (FP32_NBYTES + itemsize(dtype))


def optimizer_swap_nbytes(shard_numel: int, stage: int, dtype: torch.dtype, block_size: int,
                          grads_in_host: bool = False) -> int:
    """infinity/engine/build.py _state_store: ``store.reserve(total shard elements × per element)``."""
    return swap_nbytes(shard_numel * state_nbytes_per_element(stage, dtype, grads_in_host), block_size)


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


def pool_capacity(count: int, size: int) -> int:
    """infinity/memory/pool.py BufferPool.capacity: ``count × round_up(size, 4 KiB)`` bytes (for the
    parameter pool, build.py _param_store passes size = offload_param.buffer_size × itemsize)."""
    return count * round_up(size, DIRECT_ALIGNMENT)


def pool_nbytes(count: int, size: int) -> int:
    """infinity/memory/pool.py BufferPool: its capacity in one slab, allocated with huge pages
    (see mapped_nbytes)."""
    return mapped_nbytes(pool_capacity(count, size), huge_pages=True)


def swap_nbytes(total: int, block_size: int) -> int:
    """infinity/store/swapspace.py SwapSpace.reserve/_grow_to (one drive): the bytes
    ``posix_fallocate`` reserves for ``total`` bytes of keys — 4 KiB, then block_size granular."""
    if total <= 0:
        return 0
    return round_up(round_up(total, DIRECT_ALIGNMENT), block_size)


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
    """infinity/zero/init.py + memory/trim.py, measured on infinity.models.GPT (25M and 108M
    parameters, CPU, glibc): what building under zero.Init leaves on the heap until initialize
    trims it. Each parameter's full values and its shard are freed as it is partitioned and kept
    by the heap (2 × the model) until FreedMemory trims at its threshold; the parameters being
    initialised (full values, a clone, a shard) add up to 8 × the largest one."""
    return min(2 * sum(param_nbytes), TRIM_THRESHOLD_NBYTES) + 8 * max(param_nbytes, default=0)


def swap_growth_nbytes(sizes: Sequence[int], block_size: int) -> int:
    """infinity/store/swapspace.py SwapSpace.alloc without a reserve (zero.Init's store): the
    files grow to max(need, capacity + min(capacity, 1 GiB)) at each allocation that does not fit."""
    capacity = used = 0
    for n in sizes:
        n = round_up(max(n, 1), DIRECT_ALIGNMENT)
        if used + n > capacity:
            need = used + n
            step = capacity + min(capacity, GROW_STEP_MAX)
            capacity = round_up(max(need, step), block_size)
        used += n
    return capacity


def state_keys(stage: int, dtype: torch.dtype) -> tuple[str, ...]:
    """infinity/optim/partitioned_adam.py PartitionedAdam._keys: fp32 m, v, g per shard, plus an
    fp32 master unless the shard is a stage-3 fp32 parameter (which is its own master)."""
    if stage == 3 and dtype == torch.float32:
        return ("m", "v", "g")
    return ("master", "m", "v", "g")


def state_nbytes_per_element(stage: int, dtype: torch.dtype, grads_in_host: bool = False) -> int:
    """infinity/engine/build.py state_bytes_per_element: 12 or 16 (less the grad's 4 when
    offload_optimizer.grads_in_host) — the optimizer pool's buffer size per element and the swap
    space reserved per element."""
    swapped = [k for k in state_keys(stage, dtype) if not (grads_in_host and k == "g")]
    return FP32_NBYTES * len(swapped)


def param_homes(units: Sequence[ParamUnit], zero: ZeroConfig) -> dict[int, str]:
    """infinity/engine/build.py _param_homes: stage-3 shards at rest in "cpu" or "nvme".

    Persistent units and every unit unless offload_param is nvme stay in host
    memory; with nvme, units are kept in host memory greedily while their
    shards fit in ``max_in_cpu`` elements (DeepSpeed's meaning of the key).
    """
    offload = zero.offload_param
    homes = {}
    in_cpu = 0
    for unit in units:
        if unit.persistent or offload.device != "nvme":
            homes[unit.index] = "cpu"
        elif in_cpu + unit.layout.shard_numel <= offload.max_in_cpu:
            homes[unit.index] = "cpu"
            in_cpu += unit.layout.shard_numel
        else:
            homes[unit.index] = "nvme"
    return homes


def optimizer_pool_numel(units: Sequence[ParamUnit], zero: ZeroConfig) -> int:
    """infinity/engine/build.py _state_store: elements per optimizer-pool buffer,
    ``max(min(sub_group_size, all shards), largest shard)``."""
    total = sum(u.layout.shard_numel for u in units)
    largest = max((u.layout.shard_numel for u in units), default=0)
    return max(min(int(zero.sub_group_size), total), largest)


def sub_groups(units: Sequence[ParamUnit], sub_group_numel: int) -> list[list[ParamUnit]]:
    """infinity/optim/partitioned_adam.py _split: consecutive shards, at most
    ``sub_group_numel`` elements a group (a larger shard is a group of its own)."""
    groups: list[list[ParamUnit]] = []
    size = 0
    for u in units:
        if not groups or size + u.layout.shard_numel > sub_group_numel:
            groups.append([])
            size = 0
        groups[-1].append(u)
        size += u.layout.shard_numel
    return groups


def _group_nvme_nbytes(units: Sequence[ParamUnit], homes: dict[int, str], sub_group_numel: int) -> list[int]:
    return [
        sum(round_up(u.layout.shard_nbytes, DIRECT_ALIGNMENT) for u in g if homes.get(u.index) == "nvme")
        for g in sub_groups(units, sub_group_numel)
    ]


def step_param_pool_need(units: Sequence[ParamUnit], homes: dict[int, str], sub_group_numel: int) -> int:
    """infinity/optim/partitioned_adam.py step/_fetch: the parameter-pool bytes one sub-group's
    NVMe shards take. The read-issuing thread fetches a whole sub-group before the step uses any of
    it, so a sub-group the pool cannot hold at once waits for room forever (until its timeout)."""
    return max(_group_nvme_nbytes(units, homes, sub_group_numel), default=0)


def step_param_pool_overlap(units: Sequence[ParamUnit], homes: dict[int, str], sub_group_numel: int) -> int:
    """partitioned_adam.py step: with room for two consecutive sub-groups, the read of i+1 runs
    while i is updated (less, and the step's reads and updates take turns)."""
    per = _group_nvme_nbytes(units, homes, sub_group_numel)
    return max([a + b for a, b in zip(per, per[1:], strict=False)] + per, default=0)


def tensor_cache_cap(units: Sequence[ParamUnit]) -> int:
    """infinity/engine/build.py: ``TensorCache(cap_nbytes=CACHED_FLAT_BUFFERS × 4 × largest padded numel)``."""
    largest = max((u.layout.padded_numel for u in units), default=0)
    return CACHED_FLAT_BUFFERS * FP32_NBYTES * largest


def flat_buffers_nbytes(
    units: Sequence[ParamUnit], stage: int, world_size: int, dtype: torch.dtype, *, caching: bool
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
    the cap (CACHED_FLAT_BUFFERS × the largest unit's fp32 size) — on CUDA none
    (TensorCache.put keeps nothing there: ``caching`` False).
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
    return in_use + min(tensor_cache_cap(units), cacheable)


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
