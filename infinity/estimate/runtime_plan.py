"""RuntimePlan: every sizing decision the runtime acts on for one rank, made once, in one place.

[Note: one sizing model] infinity.engine.build allocates what a RuntimePlan says
— the units, each shard's parameter home, the two stores with their pools and
swap reserves, the optimizer's keys and sub-groups, the tensor cache, the
prefetch budgets — and refuses what the plan refuses (a parameter pool that
cannot hold the largest layer). infinity.estimate itemises the same plan
(itemise.py) for ``infinity estimate`` and the pre-flight check, adding only what
the runtime does not decide (activations, the process baseline, measured
overheads, allocator slack: rules.py). There is no second copy of these rules,
so the estimate and what is allocated cannot disagree.

[Note: frozen units] Only units that train get optimizer state. build_units
cuts trainable and frozen parameters (``requires_grad`` when initialize runs)
into separate units, and the OptimizerPlan, the state store and its swap
reserve cover the trainable units alone: a frozen unit has its parameter
shard (stage 3: in the parameter store; stages 0-2: in the module) and
nothing else — no fp32 master, no moments, no gradient partition. A model with
no trainable unit, and every inference plan (``trains=False``: an engine
built with no optimizer), has no optimizer plan and no state store at all,
so it needs no optimizer.

[Note: placement] Where each unit's state rests — its parameter shard (stage 3)
and each fp32 array the optimizer keeps for it (master, m, v, g) — is the
plan's: ShardPlan.param_home and ShardPlan.state_homes. A section whose device
is "cpu" or "nvme" places all of its state there, as DeepSpeed does
(offload_param.max_in_cpu and offload_optimizer.grads_in_host as they say); a
section whose device is "auto" places each unit's arrays as a Placement says
— the placement planner's choice (placement.py), NVMe where none is given —
and the engine obeys it by construction: the stores register each key at the
home the plan names, and the pools and swap reserves are sized from the keys
at home on NVMe.

Invariants: making a plan touches neither the model nor memory nor files (the
units are cut on the device given: "meta" for an estimate); every figure is
this rank's; sizes are bytes unless named ``*_numel``; a shard is one rank's
part of a unit, padded to 4 KiB (infinity.zero.layout).

Threading: a plan is immutable. Its UnitMap is the runtime's own: the units
change state as they are gathered, but their layouts, which the plan is
computed from, never change.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

from infinity.aio import DIRECT_ALIGNMENT
from infinity.config import InfinityConfig, QuantizedInitializationConfig, ZeroConfig
from infinity.config.zero import NvmePath, OffloadOptimizerConfig, OffloadParamConfig
from infinity.memory import BufferPool, round_up
from infinity.optim.partitioned_adam import split_sub_groups
from infinity.schedule import ScheduleBudget
from infinity.store.store import Home
from infinity.weights.quant import QuantSpec, ShardFormat
from infinity.zero.init import init_store_of
from infinity.zero.quantized_shards import unit_shard_format
from infinity.zero.unit import ParamUnit
from infinity.zero.units import UnitMap, build_units

FP32_NBYTES = 4

CACHED_FLAT_BUFFERS = 4
"""The TensorCache keeps up to this many of the largest unit's flat fp32 size for reuse (gathers for
world size > 1, flat fp32 grads): the few buffers in use at once, not one per unit."""

CACHED_DEQUANT_BUFFERS = 2
"""Inference (no optimizer), and training at world size > 1: the TensorCache keeps up to this many of the
largest unit's size in its dtype for reuse — dequantised shards, gathers for world size > 1 (the units in
use are the partitioner's working set, counted apart); nothing with neither (the partitioner computes from
the pool). Training at world size 1 keeps what its frozen units use at once (frozen_buffers_nbytes)."""

OPTIMIZER_POOL_BUFFERS = 3
"""Sub-groups the optimizer pool holds: the one being read, the one being updated and the one being
written (PartitionedAdam streams read i+1 ‖ update i ‖ write i-1)."""

STATE_KEYS = ("master", "m", "v", "g")
"""The fp32 arrays PartitionedAdam keeps per shard: master weights, Adam's moments, the gradient."""

PARAM = "param"
"""The state class of a unit's parameter shard (stage 3) in a Placement; the others are STATE_KEYS."""

STATE_CLASSES = (PARAM, *STATE_KEYS)

STATE_NBYTES_PER_ELEMENT = FP32_NBYTES * len(STATE_KEYS)
"""The most optimizer-state bytes per element (every array swapped)."""

PARAM_POOL_KEYS = (
    "zero_optimization.offload_param.buffer_count",
    "zero_optimization.offload_param.buffer_size",
)
OPTIMIZER_POOL_KEYS = ("zero_optimization.sub_group_size",)


@dataclasses.dataclass(frozen=True)
class PoolPlan:
    """A BufferPool allocated once: ``count`` buffers of ``buffer_nbytes`` in one slab."""

    name: str
    """The pool's name in messages and stats ("params", "optimizer"; "pool" for a store's unused one)."""
    count: int
    buffer_nbytes: int
    """Bytes per buffer as asked; the pool rounds each up to 4 KiB (``capacity_nbytes``)."""
    pin: bool | None
    """None pins where CUDA is present (offload_*.pin_memory true); False never pins."""
    keys: tuple[str, ...] = ()
    """The config keys that size it: what to lower when it is too big, or raise when too small."""
    need_nbytes: int = 0
    """The least capacity the run needs of it: what it must hold at once (0: nothing)."""

    @property
    def capacity_nbytes(self) -> int:
        return BufferPool.capacity_for(self.count, self.buffer_nbytes)


UNUSED_POOL = PoolPlan("pool", 1, DIRECT_ALIGNMENT, None)
"""The pool of a store whose keys all live in host memory (a TieredStore always has one): one page."""


@dataclasses.dataclass(frozen=True)
class StorePlan:
    """A TieredStore: its pool and, when keys rest on NVMe, where it swaps and what it reserves there."""

    name: str
    pool: PoolPlan
    nvme_path: NvmePath = None
    """The offload section's nvme_path, one folder or one per drive (this rank swaps in rank<N>/ below
    each, striped over them); None: host memory only."""
    reserve_nbytes: int = 0
    """Bytes of the keys at home on NVMe, reserved (fallocate) before any is written."""
    integrity: bool = True
    """Whether its swap files are checksummed (offload_*.integrity; infinity.store.integrity)."""


@dataclasses.dataclass(frozen=True)
class SwapReserve:
    """Swap-file bytes one store needs at one nvme_path, checked against the free space there before
    anything is written — for every offload section on NVMe, even when nothing lands there."""

    what: str
    """"parameters" or "optimizer state" (in the refusal)."""
    nvme_path: str | tuple[str, ...]
    """One folder, or one per drive: the store stripes ``nbytes`` over them (whole stripes each)."""
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Placement:
    """Homes for the state of the sections whose device is "auto", by (unit index, state class): the
    placement planner's choice ([Note: placement]). A class it does not name rests on NVMe."""

    homes: Mapping[tuple[int, str], Home] = dataclasses.field(default_factory=dict)

    def home(self, index: int, cls: str) -> Home:
        return self.homes.get((index, cls), "nvme")

    @classmethod
    def everywhere(cls, units: Sequence[ParamUnit], home: Home) -> Placement:
        """Every class of every unit at ``home``."""
        return cls({(u.index, c): home for u in units for c in STATE_CLASSES})


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """One unit's shard on this rank, and where each part of its state rests."""

    index: int
    """The unit's index in the UnitMap."""
    param_home: Home | None
    """Stage 3: where the parameter shard rests in the parameter store; None at stages 0-2, which keep
    parameters whole in the module."""
    state_homes: tuple[tuple[str, Home], ...] = ()
    """(key, home) for each of the optimizer's state_keys, in that order."""
    numel: int = 0
    """Elements of the shard (every array of it has this many)."""

    def state_home(self, key: str) -> Home:
        return dict(self.state_homes)[key]

    def nvme_keys(self) -> tuple[str, ...]:
        return tuple(k for k, h in self.state_homes if h == "nvme")


@dataclasses.dataclass(frozen=True)
class OptimizerPlan:
    """PartitionedAdam's state: which fp32 arrays each shard has and how the step streams them (where each
    array rests is ShardPlan.state_homes)."""

    state_keys: tuple[str, ...]
    """Per shard: m, v, g, and a master unless the shard is a stage-3 fp32 parameter (its own master)."""
    sub_group_numel: int
    """zero_optimization.sub_group_size: the most elements the step streams at once."""
    sub_groups: tuple[tuple[int, ...], ...]
    """The step's sub-groups, as unit indices (split_sub_groups, which the optimizer itself uses)."""
    sub_group_swap_nbytes: tuple[int, ...]
    """Per sub-group, the bytes of its arrays at home on NVMe (each padded to 4 KiB): what the step reads
    into the optimizer pool at once. The pool's buffers hold the largest."""
    largest_unit_swap_nbytes: int
    """The most bytes of one unit's arrays at home on NVMe (a sub-group never splits a unit)."""
    pool_buffer_numel: int
    """Elements per optimizer-pool buffer when every shard swaps the same arrays (an offload_optimizer
    device of nvme): a sub-group, no more than every shard, no less than the largest (DeepSpeed's sizing)."""


@dataclasses.dataclass(frozen=True)
class SchedulePlan:
    """The stage-3 prefetch scheduler's budgets and what the partitioner holds under them."""

    budget: ScheduleBudget
    """DeepSpeed's element budgets as this rank's bytes: ``int(numel / world_size) × itemsize`` (the
    scheduler holds this rank's shards; DeepSpeed counts gathered elements)."""
    working_set_nbytes: int
    """The most shard bytes the partitioner holds at once (partitioner_working_set)."""
    pool_working_set_nbytes: int
    """The part of it at home on NVMe, which the parameter pool must hold at once."""
    largest_unit_nbytes: int
    largest_unit: str
    """The largest partitioned unit's module name (repr), for the scheduler's refusals."""


@dataclasses.dataclass(frozen=True)
class LayerTooLarge:
    """The parameter pool cannot hold the largest layer's shard on NVMe: initialize refuses the config."""

    layer: str
    shard_numel: int
    shard_nbytes: int
    buffer_count: int
    buffer_size: int
    """offload_param.buffer_size, in elements."""
    capacity_nbytes: int

    @property
    def min_buffer_size(self) -> int:
        """The buffer_size (elements) that holds the layer with the configured buffer_count."""
        return math.ceil(self.shard_numel / self.buffer_count)

    def message(self) -> str:
        return (
            f"the parameter buffer pool (offload_param.buffer_count={self.buffer_count} x buffer_size="
            f"{self.buffer_size} elements = {self.capacity_nbytes} bytes) cannot hold layer {self.layer!r}, "
            f"whose shard is {self.shard_nbytes} bytes ({self.shard_numel} elements); "
            f"raise zero_optimization.offload_param.buffer_count or buffer_size to at least "
            f"{self.min_buffer_size} elements"
        )


@dataclasses.dataclass(frozen=True)
class PlacementChoice:
    """Why the homes of a plan's "auto" sections are what they are: the placement planner's record."""

    budget_nbytes: int
    """The host memory it planned within (per rank, beyond what the process held)."""
    budget_source: str
    """Where the budget came from: host_memory_budget, or the available memory less a margin."""
    need_nbytes: int
    """The host memory the chosen plan needs (per rank, beyond what the process held)."""
    changes: tuple[tuple[str, int, int], ...] = ()
    """(config key, the config's value, the value planned): sizes the planner chose for keys the config
    leaves unset under "auto" (pools, sub-groups)."""


@dataclasses.dataclass(frozen=True)
class RuntimePlan:
    """What one rank allocates and how, for a model under a config (see [Note: one sizing model])."""

    stage: int
    dtype: torch.dtype
    """The precision parameters train in (train_dtype)."""
    world_size: int
    rank: int
    device: torch.device
    """The compute device; the units were cut on it."""
    unit_map: UnitMap
    """The units (infinity.zero.units.build_units), cut as the runtime partitions the model."""
    shards: tuple[ShardPlan, ...]
    """Per unit, by index."""
    param_store: StorePlan | None
    """Stage 3: the parameter store; None at stages 0-2."""
    state_store: StorePlan | None
    """The optimizer's store; None when nothing trains (see [Note: frozen units])."""
    optimizer: OptimizerPlan | None
    """The optimizer state of the trainable units; None when nothing trains (see [Note: frozen units])."""
    swap_reserves: tuple[SwapReserve, ...]
    """The free-space check: parameters first, then optimizer state."""
    tensor_cache_cap_nbytes: int
    """The TensorCache keeps at most this much: CACHED_FLAT_BUFFERS × the largest unit's flat fp32 size."""
    staging_numel: int
    """Starting values move home through one fp32 buffer of this many elements (the largest unit's)."""
    schedule: SchedulePlan | None
    """Stage 3: the prefetch scheduler's; None at stages 0-2."""
    param_pool_refusal: LayerTooLarge | None
    """The pool check initialize refuses on (None: the pool holds every layer)."""
    warnings: tuple[str, ...] = ()
    """What the runtime tells the user about this plan as it allocates it."""
    formats: tuple[ShardFormat | None, ...] | None = None
    """Stage 3 with quantised weights at rest, each unit's shard format, by index ([Note: quantised
    shards] in infinity/weights/quant.py): every unit's for inference, the frozen units' for training
    ([Note: a quantised frozen base]); None (the tuple, or a unit's entry): shards rest in their dtype."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step (what the state moves per step depends on it: traffic.py)."""
    chosen: PlacementChoice | None = None
    """Set when the placement planner chose the "auto" sections' homes (placement.py)."""
    layer_major_block: int | None = None
    """The micro-batches engine.train_batch runs layer-major at once, when initialize planned for it
    (the config's zero_optimization.layer_major; [Note: layer-major blocks] in blocks.py); None:
    train_batch chooses at its first call."""
    zero: ZeroConfig | None = None
    """The zero_optimization section the plan was made from (with the sizes the planner chose)."""

    @property
    def units(self) -> list[ParamUnit]:
        return self.unit_map.units

    @property
    def shard_rank(self) -> int:
        """The rank whose part of each unit this rank owns (stage 0 keeps whole units: rank 0's)."""
        return 0 if self.stage == 0 else self.rank

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    @property
    def shard_numel(self) -> int:
        """Elements of every shard of this rank."""
        return sum(u.layout.shard_numel for u in self.units)

    def trainable_units(self) -> list[ParamUnit]:
        """The units that get optimizer state (none without an optimizer plan: [Note: frozen units])."""
        return [u for u in self.units if u.trainable] if self.optimizer is not None else []

    @property
    def trainable_shard_numel(self) -> int:
        """Elements of this rank's shards that have optimizer state."""
        return sum(u.layout.shard_numel for u in self.trainable_units())

    def format_of(self, unit: ParamUnit) -> ShardFormat | None:
        """The unit's shard format at rest; None when it rests in its dtype."""
        return self.formats[unit.index] if self.formats is not None else None

    def at_rest_nbytes(self, unit: ParamUnit) -> int:
        """Bytes of the unit's shard as it rests in the parameter store (packed when quantised)."""
        fmt = self.format_of(unit)
        return fmt.nbytes if fmt is not None else unit.layout.shard_nbytes

    def nvme_units(self) -> list[ParamUnit]:
        """The units whose parameter shard rests on NVMe."""
        return [u for u in self.units if self.shards[u.index].param_home == "nvme"]

    def state_nbytes(self, cls: str, home: Home | None = None) -> int:
        """Bytes of state class ``cls`` (PARAM or an optimizer key) over every shard, at ``home`` (any: None);
        parameter shards as they rest (packed when quantised: at_rest_nbytes)."""
        out = 0
        for sp, u in zip(self.shards, self.units, strict=True):
            if cls == PARAM:
                if sp.param_home is not None and home in (None, sp.param_home):
                    out += self.at_rest_nbytes(u)
            elif (
                self.optimizer is not None
                and cls in self.optimizer.state_keys
                and sp.state_homes
                and home in (None, sp.state_home(cls))
            ):
                out += FP32_NBYTES * sp.numel
        return out

    @property
    def resident_param_nbytes(self) -> int:
        """Stages 0-2: every parameter whole in the module (unpadded), in the training dtype."""
        if self.stage == 3:
            return 0
        return sum(s.numel for u in self.units for s in u.layout.slots) * self.itemsize

    def sub_group_param_nbytes(self, sub_group_numel: int | None = None) -> list[int]:
        """Parameter-pool bytes each optimizer sub-group's NVMe shards take (the step fetches a whole
        sub-group before it updates any of it); ``sub_group_numel``: were sub_group_size that instead."""
        if self.optimizer is None:
            return []
        groups = self.optimizer.sub_groups
        if sub_group_numel is not None:
            groups = _unit_sub_groups(self.trainable_units(), sub_group_numel)
        return _sub_group_nvme_nbytes(self.units, [s.param_home for s in self.shards], groups)


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def train_dtype(cfg: InfinityConfig) -> torch.dtype:
    """The precision parameters train in: bf16 or fp16 when enabled, else fp32."""
    if cfg.bf16.enabled:
        return torch.bfloat16
    if cfg.fp16.enabled:
        return torch.float16
    return torch.float32


def weights_dtype(model: nn.Module, cfg: InfinityConfig) -> torch.dtype:
    """The precision an inference plan keeps the weights in: bf16 or fp16 when the config enables one,
    else the model's as loaded (its floating-point parameters' most common dtype; each unit keeps its
    own, see cut_units)."""
    if cfg.bf16.enabled or cfg.fp16.enabled:
        return train_dtype(cfg)
    counts: dict[torch.dtype, int] = {}
    for p in dict.fromkeys(model.parameters()):
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + 1
    return max(counts, key=lambda d: counts[d]) if counts else torch.float32


def cut_units(
    model: nn.Module,
    cfg: InfinityConfig,
    *,
    world_size: int,
    device: torch.device,
    trains: bool = True,
) -> UnitMap:
    """The units: whole at stage 0 (layout world 1), the persistence threshold only at stage 3,
    zero.Init's true shapes where it holds the parameters. ``trains=False`` (inference) keeps each
    parameter's dtype as loaded unless the config enables bf16 or fp16."""
    zero = cfg.zero_optimization
    store = init_store_of(list(dict.fromkeys(model.parameters())))
    as_loaded = not trains and not (cfg.bf16.enabled or cfg.fp16.enabled)
    return build_units(
        model,
        world_size=1 if zero.stage == 0 else world_size,
        persistence_threshold=int(zero.stage3_param_persistence_threshold)
        if zero.stage == 3
        else 0,
        device=device,
        dtype=None if as_loaded else train_dtype(cfg),
        shape_of=store.shape if store is not None else None,
    )


def plan_runtime(
    model: nn.Module,
    cfg: InfinityConfig,
    *,
    world_size: int,
    rank: int = 0,
    device: torch.device | str = "meta",
    unit_map: UnitMap | None = None,
    trains: bool = True,
    placement: Placement | None = None,
) -> RuntimePlan:
    """The plan for ``model`` under ``cfg`` on ``rank`` of ``world_size``. ``unit_map``: the units if
    already cut for this config (a plan for the same model with other sizes reuses them). ``placement``:
    the homes of the "auto" sections' state (see [Note: placement]; by default all on NVMe, the
    placement planner's starting point — infinity.estimate.placement.place_in_budget chooses).
    ``trains=False``: no parameter trains (an inference engine): no optimizer plan, weights in the
    precision weights_dtype says (see [Note: frozen units])."""
    zero = cfg.zero_optimization
    dtype = train_dtype(cfg) if trains else weights_dtype(model, cfg)
    device = torch.device(device)
    if unit_map is None:
        unit_map = cut_units(model, cfg, world_size=world_size, device=device, trains=trains)
    units = unit_map.units
    placement = placement or Placement()
    homes = param_homes(units, zero, placement) if zero.stage == 3 else (None,) * len(units)
    keys = STATE_KEYS[1:] if zero.stage == 3 and dtype == torch.float32 else STATE_KEYS
    trainable = [u for u in units if u.trainable] if trains else []
    trains_unit = {u.index for u in trainable}
    shards = tuple(
        ShardPlan(
            u.index,
            homes[u.index],
            state_homes(u, keys, zero, placement) if u.index in trains_unit else (),
            u.layout.shard_numel,
        )
        for u in units
    )
    optimizer = _optimizer(trainable, shards, keys, zero) if trainable else None
    formats = _formats(cfg, units, rank, trains)
    schedule = (
        _schedule(model, unit_map, homes, zero, world_size, dtype, formats)
        if zero.stage == 3
        else None
    )
    param_store, refusal = None, None
    if zero.stage == 3:
        param_store, refusal = _param_store(
            units, homes, zero.offload_param, dtype, optimizer, schedule, formats
        )
    state_store = (
        _state_store(trainable, zero.offload_optimizer, optimizer)
        if optimizer is not None
        else None
    )
    largest_flat = max((u.layout.padded_numel for u in units), default=0)
    largest_quantised = max(
        (u.layout.padded_numel for u in units if formats and formats[u.index] is not None),
        default=0,
    )
    return RuntimePlan(
        stage=zero.stage,
        dtype=dtype,
        world_size=world_size,
        rank=rank,
        device=device,
        unit_map=unit_map,
        shards=shards,
        param_store=param_store,
        state_store=state_store,
        optimizer=optimizer,
        swap_reserves=_swap_reserves(zero, param_store, state_store),
        tensor_cache_cap_nbytes=(
            CACHED_FLAT_BUFFERS * FP32_NBYTES * largest_flat
            + (
                frozen_buffers_nbytes(
                    model, unit_map, forward=lambda u: bool(formats and formats[u.index])
                )
                if zero.stage == 3 and world_size == 1
                else CACHED_DEQUANT_BUFFERS * itemsize(dtype) * largest_quantised
            )
            if trains
            else CACHED_DEQUANT_BUFFERS * itemsize(dtype) * largest_flat
            if formats is not None or world_size > 1
            else 0
        ),
        staging_numel=largest_flat,
        schedule=schedule,
        param_pool_refusal=refusal,
        warnings=_max_in_cpu_warning(units, homes, zero.offload_param),
        formats=formats,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        zero=zero,
    )


def quant_spec(cfg: InfinityConfig, *, trains: bool) -> QuantSpec | None:
    """The format quantised weights rest in (stage 3), or None: for inference, every matrix with
    ``weight_quantization.quantized_initialization``; for training, the frozen ones with it or with
    ``zero_optimization.zero_quantized_nontrainable_weights`` (its default format then: 8 bits, groups
    of 64, min/max), see [Note: a quantised frozen base]."""
    zero = cfg.zero_optimization
    quant = cfg.weight_quantization.quantized_initialization
    if zero.stage != 3 or (
        quant is None and not (trains and zero.zero_quantized_nontrainable_weights)
    ):
        return None
    if quant is None:
        quant = QuantizedInitializationConfig()
    return QuantSpec(
        quant.num_bits, quant.group_size, quant.symmetric, quant.quant_type, quant.double_quant
    )


def _formats(
    cfg: InfinityConfig, units: Sequence[ParamUnit], rank: int, trains: bool
) -> tuple[ShardFormat | None, ...] | None:
    """Each unit's shard format at rest (see RuntimePlan.formats): trainable units stay in their dtype."""
    spec = quant_spec(cfg, trains=trains)
    if spec is None:
        return None
    formats = tuple(
        None if trains and u.trainable else unit_shard_format(u.layout, rank, spec) for u in units
    )
    return formats if any(f is not None for f in formats) else None


def param_homes(
    units: Sequence[ParamUnit], zero: ZeroConfig, placement: Placement | None = None
) -> tuple[Home, ...]:
    """Stage-3 shards at rest, by unit index: persistent units, and every unit unless offload_param is
    nvme or auto, in host memory; with auto, where ``placement`` says; with nvme, units stay in host
    memory greedily while their shards fit in ``max_in_cpu`` elements (DeepSpeed's meaning of the key),
    the rest on NVMe."""
    offload = zero.offload_param
    placement = placement or Placement()
    homes: list[Home] = []
    in_cpu = 0
    for unit in units:
        if offload.device == "auto" and not unit.persistent:
            homes.append(placement.home(unit.index, PARAM))
        elif unit.persistent or offload.device != "nvme":
            homes.append("cpu")
        elif in_cpu + unit.layout.shard_numel <= offload.max_in_cpu:
            homes.append("cpu")
            in_cpu += unit.layout.shard_numel
        else:
            homes.append("nvme")
    return tuple(homes)


def partitioner_working_set(
    model: nn.Module,
    unit_map: UnitMap,
    counts: Callable[[ParamUnit], bool] = lambda u: True,
    *,
    full: bool = False,
    size_of: Callable[[ParamUnit], int] | None = None,
) -> int:
    """The most (non-persistent, ``counts``) unit bytes the stage-3 partitioner holds at once: the
    heaviest root-to-leaf chain of modules' units (a frame holds its module's units while its children
    run) plus the largest unit again (a tied weight is held from its first use in backward to its last).
    ``full``: gathered units (world size > 1) instead of this rank's shards; ``size_of``: a unit's
    bytes otherwise (the parameter pool holds a quantised shard at its packed size).

    A model that checkpoints its layers (``checkpoints_layers``) holds more in backward: the
    recomputation of a layer hands every unit of it to backward until the unit's grads are reduced
    ([Note: recomputation under stage 3]), so a layer of a ModuleList counts its whole subtree, and
    one more largest unit is kept free: the layer's units, of several sizes, are released in another
    order than they were taken, and the pool's best fit can leave the free bytes in runs each smaller
    than the next unit while the thread that waits is the one holding the rest. Of this rank's
    shards (not ``full``), a recomputed layer's frozen units count as a forward holds them (its
    chain): they are released at their module's post-hook, their memory a buffer of their own that
    autograd keeps ([Note: frozen units in backward]; frozen_buffers_nbytes counts it)."""
    checkpointing = checkpoints_layers(model)

    def size(u: ParamUnit) -> int:
        if size_of is not None:
            return size_of(u)
        return u.full_nbytes if full else u.layout.shard_nbytes

    def own(m: nn.Module, which: Callable[[ParamUnit], bool] = counts) -> int:
        return sum(size(u) for u in unit_map.uses.get(m, ()) if not u.persistent and which(u))

    def subtree(m: nn.Module, which: Callable[[ParamUnit], bool] = counts) -> int:
        return own(m, which) + sum(subtree(c, which) for c in m.children())

    def recomputed(m: nn.Module) -> int:
        if full:
            return subtree(m)
        trains = subtree(m, lambda u: counts(u) and u.trainable)
        return trains + chain(m, lambda u: counts(u) and not u.trainable)

    def chain(m: nn.Module, which: Callable[[ParamUnit], bool] = counts) -> int:
        if checkpointing and isinstance(m, nn.ModuleList):
            return own(m, which) + max((recomputed(c) for c in m.children()), default=0)
        return own(m, which) + max((chain(c, which) for c in m.children()), default=0)

    largest = max((size(u) for u in unit_map.units if not u.persistent and counts(u)), default=0)
    return chain(model) + largest * (2 if checkpointing else 1)


def frozen_buffers_nbytes(
    model: nn.Module,
    unit_map: UnitMap,
    counts: Callable[[ParamUnit], bool] = lambda u: True,
    *,
    forward: Callable[[ParamUnit], bool] = lambda u: False,
) -> int:
    """World size 1: the most bytes the TensorCache's buffers of frozen (``counts``) units take at
    once. Such a unit gathered in backward rests in a buffer of its own that autograd keeps while a
    saved tensor views it ([Note: frozen units in backward]); a ``forward`` one's forward gathers use
    one too (a unit at rest quantised, dequantised into it). A buffer is reused by a unit of its size once nothing views it, and
    a new one is made only when every buffer of that size is in use, so each size takes its size
    times the most units of that size in use at once: a checkpointed layer's frozen units (its
    recomputation's saved tensors view all of them), else one unit (the backward node unpacking it),
    and in forward a root-to-leaf chain of modules' units (a frame holds its units while its children
    run)."""

    def frozen(us: Iterable[ParamUnit]) -> list[ParamUnit]:
        return [u for u in us if not u.persistent and not u.trainable and counts(u)]

    def own(m: nn.Module) -> list[ParamUnit]:
        return frozen(unit_map.uses.get(m, ()))

    def subtree(m: nn.Module) -> list[ParamUnit]:
        return own(m) + [u for c in m.children() for u in subtree(c)]

    groups: list[list[ParamUnit]] = [[u] for u in frozen(unit_map.units)]
    if checkpoints_layers(model):
        groups += [subtree(c) for m in model.modules() if isinstance(m, nn.ModuleList) for c in m]

    def chains(m: nn.Module, above: list[ParamUnit]) -> Iterator[list[ParamUnit]]:
        held = above + [u for u in own(m) if forward(u)]
        children = list(m.children())
        if not children:
            yield held
        for c in children:
            yield from chains(c, held)

    groups += chains(model, [])
    most: dict[int, int] = {}
    for g in groups:
        sizes = collections.Counter(u.layout.shard_nbytes for u in dict.fromkeys(g))
        for n, k in sizes.items():
            most[n] = max(most.get(n, 0), k)
    return sum(n * k for n, k in most.items())


def checkpoints_layers(model: nn.Module) -> bool:
    """Whether the model recomputes its layers in backward, as transformers models and
    infinity.models.GPT say once ``gradient_checkpointing_enable()`` is called (a module's
    ``gradient_checkpointing`` attribute set True). A model that calls a checkpoint function by other
    means is not seen here; the estimate traces it (estimate/traced.py)."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def _unit_sub_groups(units: Sequence[ParamUnit], limit: int) -> tuple[tuple[int, ...], ...]:
    """split_sub_groups over ``units`` (the trainable ones, in order), as unit indices."""
    groups = split_sub_groups([u.layout.shard_numel for u in units], limit)
    return tuple(tuple(units[i].index for i in g) for g in groups)


def state_homes(
    unit: ParamUnit, keys: Sequence[str], zero: ZeroConfig, placement: Placement | None = None
) -> tuple[tuple[str, Home], ...]:
    """Where each of a unit's optimizer arrays rests: with offload_optimizer auto, where ``placement``
    says; with nvme, on NVMe (g in host memory with grads_in_host); else in host memory."""
    off = zero.offload_optimizer
    if off.device == "auto":
        placement = placement or Placement()
        return tuple((k, placement.home(unit.index, k)) for k in keys)
    home: Home = "nvme" if off.device == "nvme" else "cpu"
    return tuple((k, "cpu" if k == "g" and off.grads_in_host else home) for k in keys)


def _optimizer(
    units: Sequence[ParamUnit], shards: Sequence[ShardPlan], keys: tuple[str, ...], zero: ZeroConfig
) -> OptimizerPlan:
    """The optimizer state of ``units`` (the trainable ones: [Note: frozen units])."""
    numels = [u.layout.shard_numel for u in units]
    sub = int(zero.sub_group_size)
    groups = _unit_sub_groups(units, sub)
    unit_swap = {
        sp.index: len(sp.nvme_keys()) * round_up(FP32_NBYTES * sp.numel, DIRECT_ALIGNMENT)
        for sp in shards
    }
    return OptimizerPlan(
        state_keys=keys,
        sub_group_numel=sub,
        sub_groups=groups,
        sub_group_swap_nbytes=tuple(sum(unit_swap[i] for i in g) for g in groups),
        largest_unit_swap_nbytes=max((unit_swap[u.index] for u in units), default=0),
        pool_buffer_numel=max(min(sub, sum(numels)), max(numels, default=0)),
    )


def _schedule(
    model: nn.Module,
    unit_map: UnitMap,
    homes: Sequence[Home | None],
    zero: ZeroConfig,
    world_size: int,
    dtype: torch.dtype,
    formats: Sequence[ShardFormat | None] | None,
) -> SchedulePlan:
    b = itemsize(dtype)

    def at_rest(u: ParamUnit) -> int:
        fmt = formats[u.index] if formats is not None else None
        return fmt.nbytes if fmt is not None else u.layout.shard_nbytes

    def per_rank_nbytes(numel: float) -> int:
        return int(numel / world_size) * b

    partitioned = [u for u in unit_map.units if not u.persistent]
    largest = max(partitioned, key=lambda u: u.layout.shard_nbytes, default=None)
    return SchedulePlan(
        budget=ScheduleBudget(
            per_rank_nbytes(zero.stage3_prefetch_bucket_size),
            per_rank_nbytes(zero.stage3_max_live_parameters),
            per_rank_nbytes(zero.stage3_max_reuse_distance),
            itemsize=b,
        ),
        working_set_nbytes=partitioner_working_set(model, unit_map),
        pool_working_set_nbytes=partitioner_working_set(
            model, unit_map, lambda u: homes[u.index] == "nvme", size_of=at_rest
        ),
        largest_unit_nbytes=largest.layout.shard_nbytes if largest else 0,
        largest_unit=repr(largest.module_name) if largest else "the largest unit",
    )


def _param_store(
    units: Sequence[ParamUnit],
    homes: Sequence[Home | None],
    off: OffloadParamConfig,
    dtype: torch.dtype,
    optimizer: OptimizerPlan | None,
    schedule: SchedulePlan | None,
    formats: Sequence[ShardFormat | None] | None = None,
) -> tuple[StorePlan, LayerTooLarge | None]:
    """The parameter store: a pool of offload_param's buffers when any shard rests on NVMe. The pool must
    hold the largest such shard (else initialize refuses), the partitioner's NVMe working set and a
    whole sub-group of the step's (need_nbytes)."""
    nvme = [u for u in units if homes[u.index] == "nvme"]
    if not nvme:
        return StorePlan("params", UNUSED_POOL), None
    largest = max(nvme, key=lambda u: u.layout.shard_nbytes)
    sub_groups = optimizer.sub_groups if optimizer is not None else ()
    need = max(
        [
            largest.layout.shard_nbytes,
            *_sub_group_nvme_nbytes(units, homes, sub_groups),
            round_up(schedule.pool_working_set_nbytes, DIRECT_ALIGNMENT) if schedule else 0,
        ]
    )
    b = itemsize(dtype)
    pool = PoolPlan(
        "params",
        int(off.buffer_count),
        _param_buffer_nbytes(units, off, b, need),
        _pin(off.pin_memory),
        PARAM_POOL_KEYS,
        need,
    )
    refusal = None
    if largest.layout.shard_nbytes > pool.capacity_nbytes:
        refusal = LayerTooLarge(
            largest.module_name,
            largest.layout.shard_numel,
            largest.layout.shard_nbytes,
            int(off.buffer_count),
            int(off.buffer_size),
            pool.capacity_nbytes,
        )

    def at_rest(u: ParamUnit) -> int:
        fmt = formats[u.index] if formats else None
        return fmt.nbytes if fmt is not None else u.layout.shard_nbytes

    store = StorePlan("params", pool, off.nvme_path, sum(at_rest(u) for u in nvme), off.integrity)
    return store, refusal


def _param_buffer_nbytes(
    units: Sequence[ParamUnit], off: OffloadParamConfig, b: int, need: int
) -> int:
    """offload_param.buffer_size in bytes, capped so that the pool holds no more than every shard that may
    rest on NVMe (all but the persistent units) at once: the pool is a byte slab that serves any mix of
    shards, so room past that is never used, and the defaults (5 × 1e8 elements: 2 GB in fp32) would
    otherwise be allocated and touched for any model. Never below ``need``, what the run holds at once
    (the partitioner's working set can count the largest unit twice). The cap does not depend on which
    units a placement puts on NVMe unless that need is larger, so the placement planner's host need stays
    additive ([Note: the placement planner])."""
    asked = int(off.buffer_size) * b
    everything = sum(
        round_up(u.layout.shard_nbytes, DIRECT_ALIGNMENT) for u in units if not u.persistent
    )
    return min(
        asked, round_up(-(-max(everything, need) // int(off.buffer_count)), DIRECT_ALIGNMENT)
    )


def _sub_group_nvme_nbytes(
    units: Sequence[ParamUnit], homes: Sequence[Home | None], sub_groups: Sequence[Sequence[int]]
) -> list[int]:
    return [
        sum(
            round_up(units[i].layout.shard_nbytes, DIRECT_ALIGNMENT)
            for i in g
            if homes[i] == "nvme"
        )
        for g in sub_groups
    ]


def _state_store(
    units: Sequence[ParamUnit], off: OffloadOptimizerConfig, optimizer: OptimizerPlan
) -> StorePlan:
    """The optimizer store of ``units`` (the trainable ones): with arrays on NVMe, a pool of three
    sub-groups' swapped arrays (read ‖ update ‖ write) and a reserve for every one of them."""
    reserve = sum(optimizer.sub_group_swap_nbytes)
    if off.device != "nvme" and reserve == 0:
        return StorePlan("optimizer", UNUSED_POOL)
    # Sized for every array on NVMe, whatever an "auto" placement spills: what a placement needs in host
    # memory is then its fixed part plus what it keeps there (see [Note: the placement planner]).
    per = FP32_NBYTES * len(optimizer.state_keys)
    if off.device == "nvme":  # exactly what spills: every shard swaps the same arrays
        per = sum(optimizer.sub_group_swap_nbytes) // max(
            1, sum(u.layout.shard_numel for u in units)
        )
    buffer = round_up(optimizer.pool_buffer_numel * per, DIRECT_ALIGNMENT)
    largest = max((u.layout.shard_numel for u in units), default=0)
    pool = PoolPlan(
        "optimizer",
        OPTIMIZER_POOL_BUFFERS,
        buffer,
        _pin(off.pin_memory),
        OPTIMIZER_POOL_KEYS,
        OPTIMIZER_POOL_BUFFERS * round_up(largest * per, DIRECT_ALIGNMENT),
    )
    return StorePlan("optimizer", pool, off.nvme_path, reserve, off.integrity)


def _swap_reserves(
    zero: ZeroConfig, param_store: StorePlan | None, state_store: StorePlan | None
) -> tuple[SwapReserve, ...]:
    """Every offload section on NVMe, and every "auto" one that places something there (load_config
    requires an nvme_path for both devices)."""
    out = []
    for what, section, store in (
        ("parameters", zero.offload_param, param_store),
        ("optimizer state", zero.offload_optimizer, state_store),
    ):
        if store is not None and (section.device == "nvme" or store.reserve_nbytes):
            assert section.nvme_path is not None
            out.append(SwapReserve(what, section.nvme_path, store.reserve_nbytes))
    return tuple(out)


def _pin(pin_memory: bool) -> bool | None:
    """pin_memory: true pins the pool when CUDA is present (None = where it can); false never pins."""
    return None if pin_memory else False


def _max_in_cpu_warning(
    units: Sequence[ParamUnit], homes: Sequence[Home | None], offload: OffloadParamConfig
) -> tuple[str, ...]:
    kept = [u for u in units if not u.persistent and homes[u.index] == "cpu"]
    if offload.device != "nvme" or not kept:
        return ()
    total = sum(u.layout.shard_numel for u in units if not u.persistent)
    return (
        f"offload_param.max_in_cpu={offload.max_in_cpu} keeps {sum(u.layout.shard_numel for u in kept)} of "
        f"{total} parameter elements in host memory instead of on NVMe (DeepSpeed's meaning of the key); "
        "set it to 0 to keep them all on NVMe",
    )
