"""Wiring: from a model and a resolved config to units, stores, the optimizer and the hooks.

Memory is bounded throughout: parameters are moved into their home one unit
at a time (from the module, or from zero.Init's store), and the only large
host allocations are the buffer pools sized by the config.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch
from torch import nn

from infinity.config import ConfigError, InfinityConfig
from infinity.engine.optimizers import OptimizerChoice
from infinity.engine.overlap import GatedShardSource, OverlappedStep
from infinity.memory import BufferPool, trim_heap
from infinity.optim.partitioned_adam import PartitionedAdam, ShardSegment, ShardSpec
from infinity.schedule import PrefetchScheduler, ScheduleConfigError
from infinity.store import TieredStore, nvme_path
from infinity.zero import init as zero_init
from infinity.zero.buffers import TensorCache
from infinity.zero.collectives import DataParallelGroup
from infinity.zero.grad_hooks import GradHooks
from infinity.zero.grads import GradReducer
from infinity.zero.partitioner import Stage3Partitioner
from infinity.zero.shard_source import StoreShardSource  # noqa: F401  (the no-read-ahead source)
from infinity.zero.unit import ParamUnit
from infinity.zero.units import UnitMap, build_units

log = logging.getLogger("infinity.engine")

FP32 = torch.float32
CACHED_FLAT_BUFFERS = 4  # of the largest unit's fp32 size, kept for reuse by TensorCache


@dataclasses.dataclass
class Runtime:
    unit_map: UnitMap
    params: list[nn.Parameter]
    optimizer: PartitionedAdam | None
    passthrough: torch.optim.Optimizer | None
    reducer: GradReducer | None
    grad_hooks: GradHooks | None
    partitioner: Stage3Partitioner | None
    param_store: TieredStore | None
    state_store: TieredStore | None
    shard_source: PrefetchScheduler | StoreShardSource | None
    cache: TensorCache
    overlap: OverlappedStep = dataclasses.field(default_factory=OverlappedStep)

    def close(self) -> None:
        self.overlap.synchronize()
        if self.partitioner is not None:
            self.partitioner.release_all()
            self.partitioner.remove()
        if isinstance(self.shard_source, PrefetchScheduler):
            self.shard_source.close()
        if self.grad_hooks is not None:
            self.grad_hooks.remove()
        if self.optimizer is not None:
            self.optimizer.shutdown()
        for store in (self.param_store, self.state_store):
            if store is not None:
                store.close()
        self.cache.clear()


def train_dtype(cfg: InfinityConfig) -> torch.dtype:
    if cfg.bf16.enabled:
        return torch.bfloat16
    if cfg.fp16.enabled:
        return torch.float16
    return FP32


def build_runtime(
    model: nn.Module,
    cfg: InfinityConfig,
    choice: OptimizerChoice,
    *,
    group: DataParallelGroup,
    device: torch.device,
) -> Runtime:
    zero = cfg.zero_optimization
    stage = zero.stage
    dtype = train_dtype(cfg)
    params = list(dict.fromkeys(model.parameters()))
    if stage == 3 and not params:
        raise ValueError(
            f"zero_optimization.stage=3 partitions parameters, but {type(model).__name__} has none; "
            "give initialize() a model with parameters"
        )
    init_store = zero_init.init_store_of(params)

    if choice.passthrough is not None:
        model.to(device)
        return Runtime(UnitMap([], {}, {}), params, None, choice.passthrough, None, None, None, None, None, None,
                       TensorCache(device, cap_nbytes=0))

    # Floating-point parameters train in the precision the config asks for.
    for p in params:
        if not p.is_floating_point():
            raise ValueError(f"parameter of dtype {p.dtype} cannot be trained; only floating-point parameters")
    layout_world = 1 if stage == 0 else group.world_size
    threshold = int(zero.stage3_param_persistence_threshold) if stage == 3 else 0
    with torch.no_grad():
        if stage < 3:
            model.to(device)
        unit_map = build_units(model, world_size=layout_world, persistence_threshold=threshold,
                               device=device, dtype=dtype,
                               shape_of=init_store.shape if init_store is not None else None)
    units = unit_map.units
    # Reused full-size buffers (gathers for world size > 1, flat fp32 grads):
    # at most a few of the largest unit's flat fp32 size stay cached.
    largest_numel = max((u.layout.padded_numel for u in units), default=0)
    cache = TensorCache(device, cap_nbytes=CACHED_FLAT_BUFFERS * 4 * largest_numel)
    flat_params = [p for u in units for p in u.params]
    index_of = {id(p): i for i, p in enumerate(flat_params)}
    shard_rank = 0 if stage == 0 else group.rank

    homes: dict[int, str] = _param_homes(units, cfg, dtype) if stage == 3 else {}
    needs = []
    swapped_per_element = state_bytes_per_element(stage, dtype, zero.offload_optimizer.grads_in_host)
    if stage == 3 and zero.offload_param.device == "nvme":
        needs.append((nvme_path.rank_dir(zero.offload_param.nvme_path, group.rank, o_direct=cfg.aio.o_direct),
                      sum(u.layout.shard_nbytes for u in units if homes[u.index] == "nvme"), "parameters"))
    if zero.offload_optimizer.device == "nvme":
        needs.append((nvme_path.rank_dir(zero.offload_optimizer.nvme_path, group.rank, o_direct=cfg.aio.o_direct),
                      sum(u.layout.shard_numel for u in units) * swapped_per_element,
                      "optimizer state"))
    nvme_path.check_space(needs)

    param_store = None
    if stage == 3:
        param_store = _param_store(units, homes, cfg, dtype, group)
        for unit in units:
            param_store.register(unit.key, (unit.layout.shard_numel,), dtype, home=homes[unit.index])

    state_store = _state_store(units, cfg, group, swapped_per_element)
    shards = []
    for unit in units:
        segs = tuple(
            ShardSegment(index_of[id(unit.params[s.slot])], s.slot, s.shard_lo, s.shard_hi)
            for s in unit.layout.segments(shard_rank)
        )
        shards.append(ShardSpec(unit.index, unit.layout.shard_numel, dtype, segs,
                                param_key=unit.key if stage == 3 else None))

    on_updated = None
    if stage < 3:
        on_updated = _resident_param_writer(units, group, stage, cache)
    optimizer = PartitionedAdam(
        choice.param_groups,
        choice.defaults,
        flat_params,
        shards,
        state_store=state_store,
        param_store=param_store,
        state_home="nvme" if zero.offload_optimizer.device == "nvme" else "cpu",
        grad_home="cpu" if zero.offload_optimizer.grads_in_host else None,
        adamw=choice.adamw,
        sub_group_numel=int(zero.sub_group_size),
        on_updated=on_updated,
    )

    # Move the starting values home, one unit at a time.
    with torch.no_grad():
        for unit in units:
            full = _full_values(unit, init_store)
            lo, hi = unit.layout.shard_range(shard_rank)
            shard = full[lo:hi]
            if stage == 3:
                param_store.write(unit.key, shard.to(dtype)).result()
                optimizer.init_state(unit.index, None if dtype == FP32 else shard)
            else:
                optimizer.init_state(unit.index, shard)
                for p in unit.params:
                    p.data = p.data.to(device=device, dtype=dtype)
            del full, shard
    if init_store is not None:
        for p in params:
            init_store.forget(p)
    trim_heap()  # the starting values passed through host memory one unit at a time

    reducer = GradReducer(units, group, optimizer, stage=stage, cache=cache)
    grad_hooks = GradHooks(unit_map, reducer, partitioned=stage == 3)
    partitioner = None
    shard_source = None
    overlap = OverlappedStep()
    if stage == 3:
        shard_source = _prefetch_scheduler(model, unit_map, param_store, homes, cfg, dtype, group, overlap)
        overlap.on_unit_done = shard_source.poke
        gated = GatedShardSource(shard_source, overlap, {u.key: u.index for u in units})
        partitioner = Stage3Partitioner(model, unit_map, shards=gated, group=group,
                                        grad_hooks=grad_hooks, cache=cache)
        partitioner.install()
    if grad_hooks is not None:
        grad_hooks.install()
    return Runtime(unit_map, flat_params, optimizer, None, reducer, grad_hooks, partitioner,
                   param_store, state_store, shard_source, cache, overlap)


def _prefetch_scheduler(model, unit_map: UnitMap, store: TieredStore, homes: dict[int, str], cfg: InfinityConfig,
                        dtype: torch.dtype, group: DataParallelGroup, overlap: OverlappedStep) -> PrefetchScheduler:
    """The stage-3 shard source: reads ahead of the recorded trace within DeepSpeed's budgets."""
    zero = cfg.zero_optimization
    units = unit_map.units
    partitioned = [u for u in units if not u.persistent]
    largest = max(partitioned, key=lambda u: u.layout.shard_nbytes, default=None)
    index_of_key = {u.key: u.index for u in units}
    # DeepSpeed's budgets count gathered elements; the scheduler holds this rank's shards.
    w = group.world_size
    try:
        return PrefetchScheduler.for_engine(
            store,
            prefetch_bucket_size=zero.stage3_prefetch_bucket_size / w,
            max_live_parameters=zero.stage3_max_live_parameters / w,
            max_reuse_distance=zero.stage3_max_reuse_distance / w,
            itemsize=torch.empty((), dtype=dtype).element_size(),
            largest_unit_nbytes=largest.layout.shard_nbytes if largest else 0,
            largest_unit=repr(largest.module_name) if largest else "the largest unit",
            working_set_nbytes=_working_set(model, unit_map, lambda u: True),
            pool_working_set_nbytes=_working_set(model, unit_map, lambda u: homes[u.index] == "nvme"),
            tier="device",
            ready=lambda key: overlap.is_done(index_of_key[key]),
        )
    except ScheduleConfigError as e:
        raise ConfigError(str(e)) from None


def _working_set(model: nn.Module, unit_map: UnitMap, counts) -> int:
    """The most shard bytes the partitioner holds at once: the heaviest root-to-leaf chain of
    modules' units (each frame holds its module's units while its children run), plus the largest
    unit again for a unit kept across backward (a tied weight is held from its first use in
    backward to its last)."""

    def nbytes(units) -> int:
        return sum(u.layout.shard_nbytes for u in units if not u.persistent and counts(u))

    def chain(m: nn.Module) -> int:
        return nbytes(unit_map.uses.get(m, ())) + max((chain(c) for c in m.children()), default=0)

    largest = max((u.layout.shard_nbytes for u in unit_map.units if not u.persistent and counts(u)), default=0)
    return chain(model) + largest


def _full_values(unit: ParamUnit, init_store) -> torch.Tensor:
    """The unit's whole flat buffer in fp32 (padded with zeros), from the module or zero.Init."""
    full = torch.zeros(unit.layout.padded_numel, dtype=FP32)
    for p, s in zip(unit.params, unit.layout.slots, strict=True):
        value = init_store.full(p) if init_store is not None and p in init_store else p.data
        full[s.offset : s.offset + s.numel].copy_(value.reshape(-1))
    return full


def _param_homes(units: list[ParamUnit], cfg: InfinityConfig, dtype: torch.dtype) -> dict[int, str]:
    offload = cfg.zero_optimization.offload_param
    homes = {}
    in_cpu = 0
    kept = 0
    for unit in units:
        if unit.persistent or offload.device != "nvme":
            homes[unit.index] = "cpu"
            continue
        # DeepSpeed's max_in_cpu: the first max_in_cpu parameter elements stay in host memory.
        if in_cpu + unit.layout.shard_numel <= offload.max_in_cpu:
            homes[unit.index] = "cpu"
            in_cpu += unit.layout.shard_numel
            kept += 1
        else:
            homes[unit.index] = "nvme"
    if offload.device == "nvme" and kept:
        total = sum(u.layout.shard_numel for u in units if not u.persistent)
        log.warning(
            "offload_param.max_in_cpu=%d keeps %d of %d parameter elements in host memory instead of on NVMe "
            "(DeepSpeed's meaning of the key); set it to 0 to keep them all on NVMe",
            offload.max_in_cpu, in_cpu, total,
        )
    return homes


def _param_store(units, homes, cfg: InfinityConfig, dtype, group: DataParallelGroup) -> TieredStore:
    offload = cfg.zero_optimization.offload_param
    itemsize = torch.empty((), dtype=dtype).element_size()
    nvme_units = [u for u in units if homes[u.index] == "nvme"]
    if not nvme_units:
        return TieredStore(None, pool=BufferPool(1, 4096), aio=cfg.aio, name="params")
    buffer_nbytes = int(offload.buffer_size) * itemsize
    capacity = int(offload.buffer_count) * buffer_nbytes
    largest = max(nvme_units, key=lambda u: u.layout.shard_nbytes)
    if largest.layout.shard_nbytes > capacity:
        raise ConfigError(
            f"the parameter buffer pool (offload_param.buffer_count={offload.buffer_count} x buffer_size="
            f"{offload.buffer_size} elements = {capacity} bytes) cannot hold layer {largest.module_name!r}, "
            f"whose shard is {largest.layout.shard_nbytes} bytes ({largest.layout.shard_numel} elements); "
            f"raise zero_optimization.offload_param.buffer_count or buffer_size to at least "
            f"{math.ceil(largest.layout.shard_numel / offload.buffer_count)} elements"
        )
    path = nvme_path.rank_dir(offload.nvme_path, group.rank, o_direct=cfg.aio.o_direct)
    pool = BufferPool(int(offload.buffer_count), buffer_nbytes, pin=_pin(offload.pin_memory), name="params")
    store = TieredStore(path, pool=pool, aio=cfg.aio, name="params", integrity=offload.integrity)
    store.reserve(sum(u.layout.shard_nbytes for u in nvme_units))
    return store


def state_bytes_per_element(stage: int, dtype: torch.dtype, grads_in_host: bool = False) -> int:
    """Swapped optimizer state per element: fp32 m, v and (unless ``grads_in_host``) the accumulated
    grad, plus an fp32 master unless the stage-3 fp32 parameter shard is its own master (see
    PartitionedAdam)."""
    return (12 if stage == 3 and dtype == FP32 else 16) - (4 if grads_in_host else 0)


def _state_store(units, cfg: InfinityConfig, group: DataParallelGroup, per_element: int) -> TieredStore:
    zero = cfg.zero_optimization
    off = zero.offload_optimizer
    if off.device != "nvme":
        return TieredStore(None, pool=BufferPool(1, 4096), aio=cfg.aio, name="optimizer")
    # A sub-group's arrays (m, v, g and maybe master: 12-16 bytes per element) for the
    # update in progress, the next one being read and the last being written.
    largest = max((u.layout.shard_numel for u in units), default=0)
    sub = max(min(int(zero.sub_group_size), sum(u.layout.shard_numel for u in units)), largest)
    buffer_nbytes = -(-sub * per_element // 4096) * 4096
    count = 3
    path = nvme_path.rank_dir(off.nvme_path, group.rank, o_direct=cfg.aio.o_direct)
    pool = BufferPool(count, buffer_nbytes, pin=_pin(off.pin_memory), name="optimizer")
    store = TieredStore(path, pool=pool, aio=cfg.aio, name="optimizer", integrity=off.integrity)
    store.reserve(sum(u.layout.shard_numel for u in units) * per_element)
    return store


def _pin(pin_memory: bool) -> bool | None:
    """pin_memory: true pins the pool when CUDA is present (None = where it can); false never pins."""
    return None if pin_memory else False


def _resident_param_writer(units: list[ParamUnit], group: DataParallelGroup, stage: int, cache: TensorCache):
    """Stages 0-2: after a shard is updated, its new values go into the module's parameters
    (all-gathered from every rank's shard for stages 1 and 2)."""

    def write(index: int, values: torch.Tensor) -> None:
        unit = units[index]
        if stage == 0 or group.world_size == 1:
            full = values
        else:
            full = cache.get(unit.layout.padded_numel, values.dtype)
            group.all_gather(full, values.contiguous())
        for p, s in zip(unit.params, unit.layout.slots, strict=True):
            p.data.view(-1).copy_(full[s.offset : s.offset + s.numel])
        if full is not values:
            cache.put(full)

    return write
