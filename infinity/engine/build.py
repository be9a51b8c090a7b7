"""Wiring: from a model and its RuntimePlan to stores, the optimizer and the hooks.

Every size comes from the plan (infinity.estimate.runtime_plan, [Note: one
sizing model]): this module allocates what it says, in order, and decides no
size itself — the estimate and the pre-flight check read the same plan.
Memory is bounded throughout: parameters are moved into their home one unit
at a time (from the module, or from zero.Init's store) through one staging
buffer, and the only large host allocations are the plan's buffer pools.
A plan without an optimizer (nothing trains, or an inference engine: [Note:
frozen units] in runtime_plan.py) gets no optimizer, state store, gradient
path or overlapped step; frozen units get none of them in any plan.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Hashable
from typing import TypeVar

import torch
from torch import nn

from infinity.config import ConfigError, InfinityConfig
from infinity.engine.checkpoint.sources import UnitSource, source_of
from infinity.engine.optimizers import OptimizerChoice
from infinity.engine.overlap import GatedMasters, GatedShardSource, OverlappedStep, StepProgress
from infinity.estimate.placement import describe_placement
from infinity.estimate.runtime_plan import RuntimePlan, StorePlan, plan_runtime
from infinity.memory import BufferPool, trim_heap
from infinity.optim.partitioned_adam import PartitionedAdam, ShardSegment, ShardSpec
from infinity.schedule import PrefetchScheduler, ScheduleConfigError
from infinity.store import Home, TieredStore, nvme_path
from infinity.store.swapspace import drive_nbytes
from infinity.weights.quant import ShardFormat, quantize_into
from infinity.zero import init as zero_init
from infinity.zero.buffers import TensorCache
from infinity.zero.collectives import DataParallelGroup
from infinity.zero.cpu_linear import Fp32Linears
from infinity.zero.grad_hooks import GradHooks
from infinity.zero.grads import GradReducer
from infinity.zero.partitioner import Stage3Partitioner
from infinity.zero.quantized_shards import QuantizedShards
from infinity.zero.resident import ResidentParams
from infinity.zero.shard_source import StoreShardSource  # noqa: F401  (the no-read-ahead source)
from infinity.zero.unit import ParamUnit
from infinity.zero.units import UnitMap

T = TypeVar("T")

log = logging.getLogger("infinity.engine")

FP32 = torch.float32


@dataclasses.dataclass(kw_only=True)
class Runtime:
    """What build_runtime made. A piece the config does not use is absent (None): a passthrough
    optimizer has only ``params`` and ``passthrough``; stages 0-2 have no parameter store,
    partitioner or shard source."""

    plan: RuntimePlan | None = None
    """The plan it was built from (None for a passthrough optimizer, which needs none)."""
    unit_map: UnitMap = dataclasses.field(default_factory=lambda: UnitMap([], {}, {}))
    params: list[nn.Parameter] = dataclasses.field(default_factory=list)
    """Every parameter the optimizer steps, in the units' order (the optimizer's); empty without one."""
    optimizer: PartitionedAdam | None = None
    passthrough: torch.optim.Optimizer | None = None
    """The user's optimizer, stepped as it is (initialize's optimizer= that is not Adam-family)."""
    reducer: GradReducer | None = None
    grad_hooks: GradHooks | None = None
    partitioner: Stage3Partitioner | None = None
    param_store: TieredStore | None = None
    state_store: TieredStore | None = None
    shard_source: PrefetchScheduler | StoreShardSource | None = None
    cache: TensorCache | None = None
    overlap: OverlappedStep = dataclasses.field(default_factory=OverlappedStep)
    resident: ResidentParams | None = (
        None  # stages 0-2: what GatheredParameters asks of whole parameters
    )
    sources: dict[int, UnitSource] = dataclasses.field(default_factory=dict)
    """Frozen units read from files and unchanged when moved home, by unit index ([Note: frozen units in a
    checkpoint] in infinity/engine/checkpoint/sources.py)."""
    cpu_linears: Fp32Linears | None = None
    """Training on the CPU: 16-bit Linear layers multiplied in fp32 ([Note: 16-bit Linear on the
    CPU] in infinity/zero/cpu_linear.py)."""

    def close(self) -> None:
        self.overlap.synchronize()
        if self.cpu_linears is not None:
            self.cpu_linears.remove()
        if self.partitioner is not None:
            self.partitioner.release_all()
            self.partitioner.remove()
        if self.resident is not None:
            self.resident.remove()
        if isinstance(self.shard_source, PrefetchScheduler):
            self.shard_source.close()
        if self.grad_hooks is not None:
            self.grad_hooks.remove()
        if self.optimizer is not None:
            self.optimizer.shutdown()
        for store in (self.param_store, self.state_store):
            if store is not None:
                store.close()
        if self.cache is not None:
            self.cache.clear()


def build_runtime(
    model: nn.Module,
    cfg: InfinityConfig,
    choice: OptimizerChoice | None,
    *,
    group: DataParallelGroup,
    device: torch.device,
    plan: RuntimePlan | None = None,
) -> Runtime:
    """Allocates and wires what ``plan`` says (made here when not given: plan_runtime for this rank).
    ``choice``: the optimizer, None when nothing trains (the plan then has no optimizer either)."""
    stage = cfg.zero_optimization.stage
    params = list(dict.fromkeys(model.parameters()))
    if stage == 3 and not params:
        raise ValueError(
            f"zero_optimization.stage=3 partitions parameters, but {type(model).__name__} has none; "
            "give initialize() a model with parameters"
        )
    if choice is not None and choice.passthrough is not None:
        model.to(device)
        resident = ResidentParams(params, UnitMap([], {}, {}), group, masters=None)
        resident.install()
        return Runtime(params=params, passthrough=choice.passthrough, resident=resident)

    # Floating-point parameters train in the precision the config asks for.
    for p in params:
        if not p.is_floating_point():
            raise ValueError(
                f"parameter of dtype {p.dtype} cannot be trained; only floating-point parameters"
            )
    with torch.no_grad():
        if stage < 3:
            model.to(device)
    plan = plan or plan_runtime(
        model,
        cfg,
        world_size=group.world_size,
        rank=group.rank,
        device=device,
        trains=choice is not None,
    )
    _check_plan(plan, stage, group, device)
    if plan.optimizer is not None and choice is None:
        raise ValueError(
            "the runtime plan has optimizer state but no optimizer was chosen; plan it with "
            "trains=False for an engine without one"
        )
    for warning in plan.warnings:
        log.warning("%s", warning)
    zero = cfg.zero_optimization
    if group.rank == 0 and (zero.offload_param.device, zero.offload_optimizer.device) != (
        "none",
        "none",
    ):
        log.info("where the training state rests:\n%s", "\n".join(describe_placement(plan)))
    if group.rank == 0:
        _say_param_pool_sizing(plan, cfg)
    cache = TensorCache(device, cap_nbytes=plan.tensor_cache_cap_nbytes)
    param_store, state_store = _stores(plan, cfg)
    optimizer = None
    if plan.optimizer is not None and choice is not None:  # both or neither (checked above)
        flat_params = [p for u in plan.trainable_units() for p in u.params]
        optimizer = PartitionedAdam(
            choice.param_groups,
            choice.defaults,
            flat_params,
            _shard_specs(plan, flat_params),
            state_store=_planned(state_store, "the optimizer's state store"),
            param_store=param_store,
            adamw=choice.adamw,
            sub_group_numel=plan.optimizer.sub_group_numel,
            on_updated=_resident_param_writer(plan.units, group, stage, cache)
            if stage < 3
            else None,
        )
    init_store = zero_init.init_store_of(params)
    sources = _move_home(plan, init_store, param_store, optimizer)
    if init_store is not None:
        for p in params:
            init_store.forget(p)
    trim_heap()  # the starting values passed through host memory one unit at a time
    runtime = _wire(model, plan, group, cache, optimizer, param_store, state_store)
    runtime.sources = sources
    return runtime


def _say_param_pool_sizing(plan: RuntimePlan, cfg: InfinityConfig) -> None:
    """One line when the parameter pool's buffers are smaller than the buffer_size the user wrote (or
    the default, under a buffer_count they wrote): the plan caps them at what the run can use."""
    off = cfg.zero_optimization.offload_param
    keys = (
        "zero_optimization.offload_param.buffer_count",
        "zero_optimization.offload_param.buffer_size",
    )
    if (
        plan.param_store is None
        or plan.param_store.nvme_path is None
        or not set(keys) & cfg.user_keys
    ):
        return
    pool = plan.param_store.pool
    written, used = int(off.buffer_size), pool.buffer_nbytes // plan.dtype.itemsize
    if used < written:
        log.info(
            "zero_optimization.offload_param.buffer_size=%s is written; %s elements (%s bytes) per buffer "
            "are used, with buffer_count=%s: the pool never needs more than every parameter shard that "
            "may rest on NVMe at once (%s bytes here)",
            f"{written:,}",
            f"{used:,}",
            f"{pool.buffer_nbytes:,}",
            f"{pool.count:,}",
            f"{pool.count * pool.buffer_nbytes:,}",
        )


def _check_plan(
    plan: RuntimePlan, stage: int, group: DataParallelGroup, device: torch.device
) -> None:
    """A plan made elsewhere (initialize makes it once for the pre-flight check) must be this rank's."""
    made = (plan.stage, plan.world_size, plan.rank, plan.device)
    if made != (stage, group.world_size, group.rank, device):
        raise ValueError(
            f"the runtime plan is for stage {plan.stage}, rank {plan.rank} of {plan.world_size} on {plan.device}; "
            f"this engine is stage {stage}, rank {group.rank} of {group.world_size} on {device}"
        )


def _stores(
    plan: RuntimePlan, cfg: InfinityConfig
) -> tuple[TieredStore | None, TieredStore | None]:
    """The parameter store (stage 3), its shards registered at their homes, and the optimizer's store
    (None without an optimizer plan) — after checking that every swap file fits and that the parameter
    pool holds the largest layer."""
    # Checked before any folder is made: a refused nvme_path is left as it was.
    needs = []
    for (
        r
    ) in plan.swap_reserves:  # striped over the drives listed: each preallocates its whole stripes
        dirs = nvme_path.planned_rank_dirs(r.nvme_path, plan.rank)
        share = drive_nbytes(r.nbytes, ndrives=len(dirs), unit=cfg.aio.block_size)
        needs += [(d.parent, share, r.what) for d in dirs]
    nvme_path.check_space(needs)
    param_store = None
    if plan.param_store is not None:
        if plan.param_pool_refusal is not None:
            raise ConfigError(plan.param_pool_refusal.message())
        param_store = _open_store(plan.param_store, plan.rank, cfg)
        for unit in plan.units:
            home: Home = _planned(plan.shards[unit.index].param_home, f"unit {unit.index}'s home")
            fmt = plan.format_of(unit)  # packed: [Note: quantised shards] in weights/quant.py
            if fmt is not None:
                param_store.register(unit.key, (fmt.nbytes,), torch.uint8, home=home)
            else:
                param_store.register(
                    unit.key, (unit.layout.shard_numel,), unit.layout.dtype, home=home
                )
    state_store = (
        _open_store(plan.state_store, plan.rank, cfg) if plan.state_store is not None else None
    )
    return param_store, state_store


def _open_store(sp: StorePlan, rank: int, cfg: InfinityConfig) -> TieredStore:
    paths = None
    if sp.nvme_path is not None:
        paths = nvme_path.rank_dirs(sp.nvme_path, rank, o_direct=cfg.aio.o_direct)
    pool = BufferPool(sp.pool.count, sp.pool.buffer_nbytes, pin=sp.pool.pin, name=sp.pool.name)
    store = TieredStore(paths, pool=pool, aio=cfg.aio, name=sp.name, integrity=sp.integrity)
    if paths is not None:
        store.reserve(sp.reserve_nbytes)
    return store


def _shard_specs(plan: RuntimePlan, flat_params: list[nn.Parameter]) -> list[ShardSpec]:
    """This rank's shard of every trainable unit, as the optimizer sees it, with the plan's state keys."""
    index_of = {id(p): i for i, p in enumerate(flat_params)}
    shards = []
    for unit in plan.trainable_units():
        segs = tuple(
            ShardSegment(index_of[id(unit.params[s.slot])], s.slot, s.shard_lo, s.shard_hi)
            for s in unit.layout.segments(plan.shard_rank)
        )
        sp = plan.shards[unit.index]
        shards.append(
            ShardSpec(
                unit.index,
                unit.layout.shard_numel,
                plan.dtype,
                segs,
                param_key=unit.key if plan.stage == 3 else None,
                state_keys=tuple(k for k, _ in sp.state_homes),
                state_homes=tuple(h for _, h in sp.state_homes),
            )
        )
    return shards


def _move_home(
    plan: RuntimePlan,
    init_store,
    param_store: TieredStore | None,
    optimizer: PartitionedAdam | None,
) -> dict[int, UnitSource]:
    """Moves the starting values home, one unit at a time, through one staging buffer; only trainable
    units get optimizer state ([Note: frozen units] in runtime_plan.py). Returns the frozen units whose
    every parameter zero.Init's store had read from a file ([Note: frozen units in a checkpoint])."""
    staging = torch.empty(plan.staging_numel, dtype=FP32)
    trained = {u.index for u in plan.trainable_units()}
    sources: dict[int, UnitSource] = {}
    with torch.no_grad():
        for unit in plan.units:
            dtype = unit.layout.dtype
            state = optimizer is not None and unit.index in trained
            full = _full_values(unit, init_store, staging)
            lo, hi = unit.layout.shard_range(plan.shard_rank)
            shard = full[lo:hi]
            fmt = plan.format_of(unit) if plan.stage == 3 else None
            if plan.stage == 3:
                if fmt is not None:  # a frozen unit (training) or any unit (inference), quantised
                    values = torch.zeros(fmt.nbytes, dtype=torch.uint8)
                    quantize_into(fmt, shard.to(dtype), values, name=unit.module_name)
                else:
                    values = shard.to(dtype)
                _planned(param_store, "the parameter store").write(unit.key, values).result()
                if optimizer is not None and state:
                    optimizer.init_state(unit.index, None if dtype == FP32 else shard)
                files = (
                    [init_store.source(p) for p in unit.params] if init_store is not None else []
                )
                if unit.index not in trained and files and all(f is not None for f in files):
                    # a quantised unit's CRC32C is its packed shard's ([Note: a quantised base in a
                    # checkpoint] in engine/checkpoint/quantised.py)
                    sources[unit.index] = source_of(files, values)
            else:
                if optimizer is not None and state:
                    optimizer.init_state(unit.index, shard)
                for p in unit.params:
                    p.data = p.data.to(device=plan.device, dtype=dtype)
            del full, shard
    return sources


def _wire(
    model: nn.Module,
    plan: RuntimePlan,
    group: DataParallelGroup,
    cache: TensorCache,
    optimizer: PartitionedAdam | None,
    param_store: TieredStore | None,
    state_store: TieredStore | None,
) -> Runtime:
    """The gradient path (with an optimizer), and at stage 3 the shard source and the partitioner's hooks."""
    unit_map, units, stage = plan.unit_map, plan.units, plan.stage
    if optimizer is None:
        return _wire_frozen(model, plan, group, cache, param_store)
    reducer = GradReducer(units, group, optimizer, stage=stage, cache=cache)
    partitioner = None
    shard_source = None
    resident = None
    if stage == 3:
        # [engine/overlap.py: Note: why StepProgress is its own object]
        progress = StepProgress()
        shard_source = _prefetch_scheduler(plan, param_store, progress)
        overlap = OverlappedStep(progress, on_unit_done=shard_source.poke)
        gated = GatedShardSource(shard_source, progress, {u.key: u.index for u in units})
        # fp32 stage-3 shards are their own masters (PartitionedAdam): nothing more to tell the optimizer.
        masters = None if plan.dtype == FP32 else GatedMasters(optimizer, overlap)
        partitioner = Stage3Partitioner(
            model,
            unit_map,
            shards=_dequantised(plan, gated, cache),
            group=group,
            cache=cache,
            masters=masters,
        )
        partitioner.install()
    else:
        overlap = OverlappedStep()
        # Every parameter (frozen ones too: GatheredParameters may change them); only trainable units
        # have a master for the change to reach.
        resident = ResidentParams(
            list(dict.fromkeys(model.parameters())), unit_map, group, masters=optimizer
        )
        resident.install()
    grad_hooks = GradHooks(
        unit_map,
        reducer,
        partitioned=stage == 3,
        on_unit_done=partitioner.release_backward if partitioner is not None else None,
    )
    grad_hooks.install()
    cpu_linears = None
    if plan.device.type == "cpu":
        cpu_linears = Fp32Linears(model, train_dtype=plan.dtype)
        cpu_linears.install()
    return Runtime(
        cpu_linears=cpu_linears,
        plan=plan,
        unit_map=unit_map,
        params=optimizer.params,
        optimizer=optimizer,
        reducer=reducer,
        grad_hooks=grad_hooks,
        partitioner=partitioner,
        param_store=param_store,
        state_store=state_store,
        shard_source=shard_source,
        cache=cache,
        overlap=overlap,
        resident=resident,
    )


def _wire_frozen(
    model: nn.Module,
    plan: RuntimePlan,
    group: DataParallelGroup,
    cache: TensorCache,
    param_store: TieredStore | None,
) -> Runtime:
    """Nothing trains: the partitioner over a prefetch scheduler at stage 3 (no step to wait for), the
    module's own parameters at stages 0-2; no gradient path."""
    if plan.stage == 3:
        shard_source = _prefetch_scheduler(plan, param_store, None)
        partitioner = Stage3Partitioner(
            model,
            plan.unit_map,
            shards=_dequantised(plan, shard_source, cache),
            group=group,
            cache=cache,
            masters=None,
        )
        partitioner.install()
        return Runtime(
            plan=plan,
            unit_map=plan.unit_map,
            partitioner=partitioner,
            param_store=param_store,
            shard_source=shard_source,
            cache=cache,
        )
    resident = ResidentParams(
        list(dict.fromkeys(model.parameters())), plan.unit_map, group, masters=None
    )
    resident.install()
    return Runtime(plan=plan, unit_map=plan.unit_map, cache=cache, resident=resident)


def _planned(value: T | None, what: str) -> T:
    """``value``, which the plan has at this stage (stage 3: a parameter store, a home for each shard
    and a prefetch schedule; with an optimizer: its state store)."""
    if value is None:
        raise ValueError(
            f"the runtime plan has no {what}, which this stage needs; plan_runtime makes one"
        )
    return value


def _dequantised(plan: RuntimePlan, source, cache: TensorCache):
    """``source``, or, where units rest quantised, a QuantizedShards over it that serves those units
    dequantised (the others pass through as they are)."""
    if plan.formats is None:
        return source
    formats: dict[Hashable, ShardFormat] = {
        u.key: f for u in plan.units if (f := plan.format_of(u)) is not None
    }
    return QuantizedShards(source, formats, cache)


def _prefetch_scheduler(
    plan: RuntimePlan, store: TieredStore | None, progress: StepProgress | None
) -> PrefetchScheduler:
    """The stage-3 shard source: reads ahead of the recorded trace within the plan's budgets (and, with an
    overlapped optimizer step, ``progress``, only what that step has updated)."""
    sched = _planned(plan.schedule, "the prefetch schedule")
    store = _planned(store, "the parameter store")
    index_of_key = {u.key: u.index for u in plan.units}
    try:
        return PrefetchScheduler.for_budget(
            store,
            sched.budget,
            largest_unit_nbytes=sched.largest_unit_nbytes,
            largest_unit=sched.largest_unit,
            working_set_nbytes=sched.working_set_nbytes,
            pool_working_set_nbytes=sched.pool_working_set_nbytes,
            tier="device",
            ready=None if progress is None else lambda key: progress.is_done(index_of_key[key]),
        )
    except ScheduleConfigError as e:
        raise ConfigError(str(e)) from None


def _full_values(unit: ParamUnit, init_store, staging: torch.Tensor) -> torch.Tensor:
    """The unit's whole flat buffer in fp32 (padded with zeros), from the module or zero.Init, in ``staging``."""
    full = staging[: unit.layout.padded_numel].zero_()
    for p, s in zip(unit.params, unit.layout.slots, strict=True):
        value = init_store.full(p) if init_store is not None and p in init_store else p.data
        full[s.offset : s.offset + s.numel].copy_(value.reshape(-1))
    return full


def _resident_param_writer(
    units: list[ParamUnit], group: DataParallelGroup, stage: int, cache: TensorCache
):
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
