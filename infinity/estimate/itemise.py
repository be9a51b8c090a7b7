"""itemise: a Breakdown of one setting — every allocation of a rank, read from its RuntimePlan.

Items are read from the setting's RuntimePlan — the very plan the engine
allocates (runtime_plan.py, [Note: one sizing model]) — plus what only the
estimator reports: the model as built, transients and activations, the
baseline, measured overheads and allocator slack (rules.py). Problems are the
configs the runtime would refuse or stall on whatever the machine (a
parameter pool too small for the optimizer step, a live budget below the
partitioner's working set).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from infinity.config import InfinityConfig
from infinity.estimate import rules
from infinity.estimate.activations import THREAD_LOGITS, Activations
from infinity.estimate.breakdown import Breakdown, Item, Phase, Problem
from infinity.estimate.model import ModelSpec
from infinity.estimate.runtime_plan import (
    FP32_NBYTES,
    PoolPlan,
    RuntimePlan,
    frozen_buffers_nbytes,
    partitioner_working_set,
    plan_runtime,
)
from infinity.estimate.setting import ZeroSetting
from infinity.estimate.traffic import worst_case_traffic
from infinity.memory import BufferPool, format_nbytes, round_up
from infinity.store.nvme_path import paths_of
from infinity.weights.quant import NF4_CHUNK_NUMEL
from infinity.zero.unit import ParamUnit

_ZINIT_CPU = "zero.Init store (fp32 shards)"
NF4_CHUNK_TEMP_NBYTES = 20
"""Bytes per element of nf4.quantize's temporaries at once: the values in fp32, their scaled copy
and its clamp, the int64 bucket indices."""


def _sum(units: Sequence[ParamUnit], attr: str, pred=lambda u: True) -> int:
    return sum(getattr(u.layout, attr) for u in units if pred(u))


def _pool_nbytes(pool: PoolPlan) -> int:
    """Host memory a pool maps: its capacity in one slab, with huge pages."""
    return rules.mapped_nbytes(pool.capacity_nbytes, huge_pages=True)


def itemise(
    spec: ModelSpec,
    cfg: InfinityConfig,
    *,
    world_size: int,
    device_type: str,
    baseline_nbytes: int,
    activations: Activations | None,
    checkpointing: bool,
    zero_init: bool,
    constructed: bool = False,
    block: int | None = None,
    changes: Sequence[tuple[str, int, int]] = (),
    runtime: RuntimePlan | None = None,
) -> Breakdown:
    """Itemises what ``cfg`` (one setting) allocates per rank (see the module docstring).
    ``changes``: the sizing keys tune.py changed (recorded in the breakdown). ``runtime``: the setting's
    RuntimePlan when one is made already (initialize's); else plan_runtime's for rank 0.
    ``block``: trained by engine.train_batch in blocks of that many micro-batches ([Note: layer-major
    blocks] in blocks.py: a block's activations at once; each array on NVMe moved once per block).
    ``constructed``: the model is built already (RunContext.constructed)."""
    gas = cfg.gradient_accumulation_steps
    block = None if block is None else min(block, gas)
    runtime = runtime or plan_runtime(spec.module, cfg, world_size=world_size)
    p = Itemiser(spec, cfg, runtime, device_type)
    p.add(
        Item(
            "process baseline",
            "host",
            baseline_nbytes,
            "run",
            "torch and infinity imported, torch._dynamo loaded by the first optimizer"
            + (", the CUDA context" if p.cuda else ""),
        )
    )
    p.model_as_built(zero_init and p.stage == 3, constructed=constructed)
    p.optimizer_state()
    if p.stage == 3:
        p.parameter_store()
    else:
        p.resident_parameters()
    p.flat_buffers_and_init()
    if activations is not None:
        p.activations(activations, checkpointing, block=block, gas=gas)
    p.overheads()
    zero = cfg.zero_optimization
    return Breakdown(
        setting=ZeroSetting(
            zero.stage,
            zero.offload_param.device,
            zero.offload_optimizer.device,
            tuned=bool(changes),
        ),
        dtype=p.dname,
        items=tuple(p.items),
        problems=tuple(p.problems),
        device_type=device_type,
        nvme_by_path=tuple(p.nvme_paths.items()),
        nvme_traffic_nbytes=worst_case_traffic(
            runtime, blocks=None if block is None else -(-gas // block)
        ).nbytes,
        layer_major_block=block,
        changes=tuple(changes),
        runtime=runtime,
    )


class Itemiser:
    """The items of one Breakdown, built section by section (one method per part of the runtime).

    Public for the inference estimate (infinity.inference.estimate), which itemises the weights' part
    the same way and adds what generation allocates: ``add`` an Item; ``model_as_built``,
    ``parameter_store``, ``overheads`` and the others each add one part of the runtime; ``items``,
    ``problems`` and ``nvme_paths`` are what a Breakdown is made of."""

    def __init__(
        self, spec: ModelSpec, cfg: InfinityConfig, runtime: RuntimePlan, device_type: str
    ):
        self.spec = spec
        self.cfg = cfg
        self.rt = runtime
        self.stage = runtime.stage
        self.dtype = runtime.dtype
        self.b = runtime.itemsize
        self.dname = str(self.dtype).removeprefix("torch.")
        self.unit_map = runtime.unit_map
        self.units = runtime.units
        numels = {
            id(p): s.numel
            for u in self.units
            for p, s in zip(u.params, u.layout.slots, strict=True)
        }
        self.grad_numels = [numels[id(p)] for u in runtime.trainable_units() for p in u.params]
        self.zero = runtime.zero or cfg.zero_optimization  # with the sizes the plan was made with
        self.cuda = device_type == "cuda"
        self.world = runtime.world_size
        self.block = cfg.aio.block_size
        self.items: list[Item] = []
        self.problems: list[Problem] = []
        self.nvme_paths: dict[str, int] = {}

    def add(self, item: Item) -> None:
        self.items.append(item)

    def _swap(
        self,
        label: str,
        nbytes: int,
        nvme_path,
        detail: str,
        key: str | None = None,
        phase: Phase = "run",
        present: bool = False,
    ) -> None:
        """A store's swap files (``nbytes`` over every drive of ``nvme_path``), plus each drive's
        directory: its lock file and extent blocks. ``present``: they exist already (the disk's free
        space is read after them): shown, not added."""
        n = len(paths_of(nvme_path))
        meta = (
            rules.swap_dir_overhead_nbytes(nbytes // n) * n
            if present
            else self._by_path(nvme_path, nbytes)
        )
        self.add(
            Item(
                label,
                "nvme",
                nbytes,
                phase,
                detail + (f", striped over {n} folders" if n > 1 else ""),
                key,
                counted=not present,
            )
        )
        self.add(
            Item(
                label.split(" swap")[0] + " swap directory",
                "nvme",
                meta,
                phase,
                "lock file and file-system extent blocks" + (" (one per folder)" if n > 1 else ""),
                counted=not present,
            )
        )

    def _by_path(self, nvme_path, nbytes: int) -> int:
        """Adds each folder's share of ``nbytes`` (the store stripes over them: equal shares) and of its
        swap directory to ``nvme_paths``; returns the directories' bytes, all folders together."""
        paths = paths_of(nvme_path)
        share = nbytes // len(paths)
        meta = rules.swap_dir_overhead_nbytes(share)
        for p in paths:
            self.nvme_paths[str(p)] = self.nvme_paths.get(str(p), 0) + share + meta
        return meta * len(paths)

    def _drives(self, nvme_path) -> int:
        return len(paths_of(nvme_path))

    def model_as_built(self, zinit: bool, *, constructed: bool = False) -> None:
        """The parameters as the user built them: in the module, or in zero.Init's store.
        ``constructed``: built already, so what zero.Init's construction left behind is shown, not
        added: its heap in what the process holds, its swap files on the disk (free space is read
        after them)."""
        if not zinit:
            built = self.spec.built_nbytes or self.spec.num_params * FP32_NBYTES
            same = self.stage < 3 and self.dtype == torch.float32 and not self.cuda
            self.add(
                Item(
                    "model as built (fp32)",
                    "host",
                    built,
                    "init",
                    "the module's parameters before initialize moves them"
                    + (" (the same memory the module trains with on a CPU device)" if same else ""),
                    heap=True,
                )
            )
            return
        sizes = rules.zero_init_shard_sizes(self.spec.module, self.world)
        self.add(
            Item(
                "zero.Init construction heap",
                "host",
                rules.zero_init_heap_nbytes(rules.zero_init_param_nbytes(self.spec.module)),
                "init",
                "parameters freed as they were partitioned, kept by the heap until initialize trims it "
                "(memory/trim.py)"
                + (
                    "; the model is built: what it kept is in what the process holds"
                    if constructed
                    else ""
                ),
                counted=not constructed,
            )
        )
        off = self.zero.offload_param
        if off.device in ("nvme", "auto"):
            self.add(
                Item(
                    "zero.Init pool",
                    "host",
                    rules.mapped_nbytes(
                        BufferPool.capacity_for(1, rules.INIT_POOL_NBYTES), huge_pages=True
                    ),
                    "init",
                    "infinity/zero/init.py: the init store's pool (closed once initialize has every "
                    "parameter)",
                )
            )
            self._swap(
                "zero.Init swap files",
                rules.swap_growth_nbytes(sizes, self.block, self._drives(off.nvme_path)),
                off.nvme_path,
                "each parameter's fp32 shard as built, files grown on demand; removed after initialize"
                + ("; the model is built: on the disk already" if constructed else ""),
                "offload_param.nvme_path",
                phase="init",
                present=constructed,
            )
        else:
            self.add(
                Item(
                    _ZINIT_CPU,
                    "host",
                    sum(sizes),
                    "init",
                    "infinity/zero/init.py: each parameter's shard as built, freed once initialize has it",
                    heap=True,
                )
            )

    def optimizer_state(self) -> None:
        """RuntimePlan's optimizer arrays per trainable shard at their homes (ShardPlan.state_homes); the
        state store's pool and reserve. Nothing without an optimizer plan ([Note: frozen units] in
        runtime_plan.py)."""
        store, rt = self.rt.state_store, self.rt
        if rt.optimizer is None or store is None:
            return
        of = " of trainable units" if rt.shard_numel > rt.trainable_shard_numel else ""
        off = self.zero.offload_optimizer
        key = "zero_optimization.offload_optimizer.device"
        auto = off.device == "auto"
        for name, wanted in (
            ("fp32 master weights", ("master",)),
            ("Adam moments m, v", ("m", "v")),
            ("gradient partitions (fp32)", ("g",)),
        ):
            classes = tuple(c for c in wanted if c in rt.optimizer.state_keys)
            if not classes:
                continue
            accum = "; accumulated across micro-batches" if "g" in classes else ""
            host = sum(rt.state_nbytes(c, "cpu") for c in classes)
            nvme = sum(rt.state_nbytes(c, "nvme") for c in classes)
            why = key
            if classes == ("g",) and off.grads_in_host and not auto:
                why = "zero_optimization.offload_optimizer.grads_in_host"
            elif auto:
                why = "host_memory_budget"
            if host or not nvme:
                self.add(
                    Item(
                        name,
                        "host",
                        host,
                        "run",
                        f"fp32, this rank's shards{of} (host tensors)"
                        + (", as the placement planner chose" if auto else "")
                        + accum,
                        why,
                    )
                )
            if nvme:
                self.add(
                    Item(
                        name,
                        "nvme",
                        nvme,
                        "run",
                        f"fp32, this rank's shards{of} (swap files)"
                        + (", as the placement planner chose" if auto else "")
                        + accum,
                        why,
                    )
                )
        if not store.reserve_nbytes:
            self.add(
                Item("optimizer pool", "host", _pool_nbytes(store.pool), "run", "unused (no NVMe)")
            )
            return
        n = self._drives(store.nvme_path)
        reserved = rules.swap_nbytes(store.reserve_nbytes, self.block, n)
        if reserved - store.reserve_nbytes:
            self.add(
                Item(
                    "optimizer swap reserve",
                    "nvme",
                    reserved - store.reserve_nbytes,
                    "run",
                    "rounding of the reserve to 4 KiB and aio.block_size"
                    + (f" × {n} folders (whole stripes)" if n > 1 else ""),
                )
            )
        meta = self._by_path(store.nvme_path, reserved)
        self.add(
            Item(
                "optimizer swap directory",
                "nvme",
                meta,
                "run",
                "lock file and file-system extent blocks" + (" (one per folder)" if n > 1 else ""),
            )
        )
        self.add(
            Item(
                "optimizer pool",
                "host",
                _pool_nbytes(store.pool),
                "run",
                f"{store.pool.count} sub-groups × {format_nbytes(store.pool.buffer_nbytes)} of arrays on NVMe "
                "(read ‖ update ‖ write), pinned, huge pages",
                ", ".join(store.pool.keys),
            )
        )

    def parameter_store(self) -> None:
        """Stage 3: RuntimePlan's parameter homes, store and pool, the budgets, what is gathered."""
        units, b, off = self.units, self.b, self.zero.offload_param
        store = self.rt.param_store
        assert store is not None  # stage 3 has a parameter store
        homes = {s.index: s.param_home for s in self.rt.shards}
        nv = self.rt.nvme_units()
        # at rest: a quantised unit's packed bytes, as engine/build.py registers it in either home
        at_rest = self.rt.at_rest_nbytes
        in_host = sum(at_rest(u) for u in units if homes[u.index] == "cpu")
        n_persist = sum(at_rest(u) for u in units if u.persistent)
        why = []
        if n_persist:
            why.append(
                f"{format_nbytes(n_persist)} persistent (< stage3_param_persistence_threshold)"
            )
        if off.device == "nvme" and in_host > n_persist:
            why.append(f"{format_nbytes(in_host - n_persist)} kept by offload_param.max_in_cpu")
        if off.device == "auto" and in_host > n_persist:
            why.append(f"{format_nbytes(in_host - n_persist)} kept by the placement planner")
        self.add(
            Item(
                f"parameter shards in host memory ({self._at_rest_name()})",
                "host",
                in_host,
                "run",
                "; ".join(why) or "offload_param.device " + off.device,
                {
                    "nvme": "zero_optimization.offload_param.max_in_cpu",
                    "auto": "host_memory_budget",
                }.get(off.device, "zero_optimization.offload_param.device"),
            )
        )
        if nv:
            self.add(
                Item(
                    "parameter pool",
                    "host",
                    _pool_nbytes(store.pool),
                    "run",
                    f"buffer_count {off.buffer_count} × buffer_size {off.buffer_size:,} × {b} B"
                    + (
                        f" (each capped at {format_nbytes(store.pool.buffer_nbytes)}: the pool then holds every "
                        "shard that may rest on NVMe)"
                        if store.pool.buffer_nbytes < off.buffer_size * b
                        else ""
                    )
                    + ", pinned, huge pages",
                    ", ".join(store.pool.keys),
                )
            )
            self._swap(
                f"parameter swap files ({self._at_rest_name()})",
                rules.swap_nbytes(store.reserve_nbytes, self.block, self._drives(store.nvme_path)),
                store.nvme_path,
                "this rank's shards",
                "zero_optimization.offload_param.nvme_path",
            )
            _check_param_pool(self.problems, self.rt, self.zero, b)
            where = "inside the parameter pool (host)"
        else:
            self.add(
                Item(
                    "parameter pool",
                    "host",
                    _pool_nbytes(store.pool),
                    "run",
                    "unused (no parameter on NVMe)",
                )
            )
            where = "on the device" if self.cuda else "in host memory"
        self._scheduler(bool(nv), where)
        if self.grad_numels:
            self.add(self._grad_in_flight())
        self._dequantised_frozen_units()

    def _dequantised_frozen_units(self) -> None:
        """Training with frozen units at world size 1 (elsewhere _scheduler counts the gathered
        units): each frozen unit gathered in backward rests in a TensorCache buffer of its own while
        autograd's saved tensors view it, and a quantised one is dequantised into one in forward too
        ([Note: frozen units in backward]; [Note: a quantised frozen base])."""
        rt = self.rt
        if rt.optimizer is None or self.world > 1:
            return
        frozen = [u for u in self.units if not u.trainable and not u.persistent]
        if not frozen:
            return
        quantised = {u.index for u in frozen if rt.format_of(u) is not None}
        nbytes = frozen_buffers_nbytes(
            self.spec.module, self.unit_map, forward=lambda u: u.index in quantised
        )
        what = (
            "dequantised when gathered (infinity/weights/quant.py), in forward while in use "
            if quantised
            else "copied out of the parameter pool when gathered in backward, "
        )
        self.add(
            Item(
                f"{'dequantised ' if quantised else ''}frozen units ({self.dname})",
                "device",
                nbytes,
                "train",
                f"{what}and in backward while a saved tensor views them (at once: a checkpointed "
                "layer's, or one unit), each in a TensorCache buffer reused by a unit of its size "
                "(zero/partitioner.py [Note: frozen units in backward])",
                heap=True,
            )
        )

    def _at_rest_name(self) -> str:
        """How parameter shards rest: their dtype, or the quantised format (weight_quantization)."""
        fmt = next((f for f in self.rt.formats or () if f is not None), None)
        if fmt is None:
            return self.dname
        q = fmt.spec
        code = q.name.lower()
        where = "trainable units and " if self.rt.optimizer is not None else ""
        return f"{code}, groups of {q.group_size}, {where}{self.dname} elsewhere"

    def _scheduler(self, nv: bool, where: str) -> None:
        """RuntimePlan.schedule: DeepSpeed's budgets per rank, the partitioner's working set
        (schedule/budget.py check_serves refuses a live budget or a pool below it), what is gathered."""
        units, b, zero, sched = self.units, self.b, self.zero, self.rt.schedule
        store = self.rt.param_store
        assert sched is not None and store is not None  # stage 3 has both
        total = _sum(units, "shard_nbytes", lambda u: not u.persistent)
        budgets = {
            "stage3_prefetch_bucket_size": sched.budget.prefetch_bucket_nbytes,
            "stage3_max_live_parameters": sched.budget.max_live_nbytes,
        }
        for label, key, numel in (
            ("prefetch budget", "stage3_prefetch_bucket_size", zero.stage3_prefetch_bucket_size),
            (
                "live-parameter budget",
                "stage3_max_live_parameters",
                zero.stage3_max_live_parameters,
            ),
        ):
            self.add(
                Item(
                    label,
                    "host" if nv else "device",
                    min(budgets[key], total),
                    "train",
                    f"{key} {numel:,} elements / {self.world} rank(s) × {b} B, the prefetch scheduler's; "
                    f"{where}, not added",
                    f"zero_optimization.{key}",
                    counted=False,
                )
            )
        working = sched.working_set_nbytes
        _check_scheduler(
            self.problems,
            zero,
            self.world,
            b,
            sched.budget.max_live_nbytes,
            max(working, sched.largest_unit_nbytes),
            store.pool.capacity_nbytes if nv else None,
            sched.pool_working_set_nbytes,
        )
        if self.cuda or self.world > 1:
            self.add(
                Item(
                    f"persistent parameters, gathered ({self.dname})",
                    "device",
                    sum(u.full_nbytes for u in units if u.persistent),
                    "train",
                    "gathered once, kept for the whole run",
                    "zero_optimization.stage3_param_persistence_threshold",
                    heap=True,
                )
            )
            if self.world > 1:
                held = partitioner_working_set(self.spec.module, self.unit_map, full=True)
                detail = "the units the partitioner holds at once, gathered from every rank"
            else:  # the scheduler keeps up to its live budget on the device (resource "device")
                held = max(working, min(sched.budget.max_live_nbytes, total))
                detail = "what the prefetch scheduler keeps on the device: its live budget, at least the working set"
            self.add(
                Item(
                    f"gathered parameters ({self.dname})",
                    "device",
                    held,
                    "train",
                    detail,
                    "zero_optimization.stage3_max_live_parameters",
                    heap=True,
                )
            )

    def resident_parameters(self) -> None:
        """Stages 0-2: parameters stay in the module; stages 0-1 keep whole grads in p.grad."""
        phase: Phase = (
            "run" if self.cuda else "train"
        )  # on a CPU device they are the model as built
        self.add(
            Item(
                f"parameters in the module ({self.dname})",
                "device",
                self.rt.resident_param_nbytes,
                phase,
                "stages 0-2 keep every parameter resident",
                heap=True,
            )
        )
        if self.stage <= 1:
            self.add(
                Item(
                    "gradient accumulators (fp32)",
                    "device",
                    rules.grad_accumulator_nbytes(self.rt.trainable_units(), self.stage),
                    "train",
                    "stages 0-1: every unit's whole grads, accumulated in fp32 until the window's end",
                    "zero_optimization.stage",
                    heap=True,
                )
            )
        self.add(self._grad_in_flight())

    def _grad_in_flight(self) -> Item:
        return Item(
            "gradient in flight (largest parameter)",
            "device",
            rules.grad_in_flight_nbytes(self.grad_numels, self.dtype),
            "train",
            "grad_hooks.py: each grad is taken as autograd makes it and added into its fp32 partition",
            heap=True,
        )

    def flat_buffers_and_init(self) -> None:
        """The TensorCache's flat buffers; the staging of starting values while moving the model home."""
        flat = rules.flat_buffers_nbytes(
            self.units,
            self.stage,
            self.world,
            self.dtype,
            cap_nbytes=self.rt.tensor_cache_cap_nbytes,
            caching=not self.cuda,
        )
        if flat:
            self.add(
                Item(
                    "flat buffers (TensorCache)",
                    "device",
                    flat,
                    "train",
                    "fp32 flat grads / gathers in use"
                    if self.cuda
                    else "fp32 flat grads / gathers, reused; cached up to 4 × the largest unit",
                    heap=True,
                )
            )
        # The staging buffer, and at most one unit's values converted to the parameter dtype; NF4
        # quantises them a chunk at a time (its temporaries: fp32 values, scaled values, int64 codes).
        nf4_chunk = any(f is not None and f.spec.quant_type == "nf4" for f in self.rt.formats or ())
        self.add(
            Item(
                "initialisation transient",
                "host",
                self.rt.staging_numel * (FP32_NBYTES + self.b)
                + (
                    min(NF4_CHUNK_NUMEL, self.rt.staging_numel) * NF4_CHUNK_TEMP_NBYTES
                    if nf4_chunk
                    else 0
                ),
                "init",
                "build.py _full_values: one unit's flat fp32 values and its converted shard"
                + (
                    f"; NF4 quantises {NF4_CHUNK_NUMEL:,} elements at a time (weights/quant.py)"
                    if nf4_chunk
                    else ""
                ),
                heap=True,
            )
        )

    def activations(
        self, a: Activations, checkpointing: bool, *, block: int | None = None, gas: int = 1
    ) -> None:
        """``block``: engine.train_batch runs the window's ``gas`` micro-batches in blocks of this
        many, layer-major (None: the micro-batch loop); a block's micro-batches are alive at once:
        their saved activations, their backward working sets (one autograd call walks their graphs
        together) and their threads' heaps ([Note: layer-major blocks] in blocks.py)."""
        k = block or 1
        saved, other = (
            (a.saved_checkpointed, a.saved) if checkpointing else (a.saved, a.saved_checkpointed)
        )
        saved, other = saved * k, other * k
        alive = (
            f"{k} micro-batches at once (engine.train_batch, blocks of {k} of {gas}), "
            if block is not None
            else ""
        )
        self.add(
            Item(
                "activations saved for backward",
                "device",
                saved,
                "train",
                alive
                + f"micro-batch {a.micro_batch} × seq {a.seq}, "
                + ("every block checkpointed" if checkpointing else "no checkpointing")
                + f" ({'without' if checkpointing else 'with'} checkpointing: {format_nbytes(other)})",
                "train_micro_batch_size_per_gpu",
                heap=True,
            )
        )
        self.add(
            Item(
                "backward working memory",
                "device",
                a.working * k,
                "train",
                "gradients of the logits and of one block's activations"
                + (f", for {k} micro-batches at once" if k > 1 else ""),
                heap=True,
            )
        )
        if block is not None:
            self.add(
                Item(
                    "layer-major block's micro-batches",
                    "device",
                    a.block(k, checkpointing=checkpointing)
                    - (a.saved_checkpointed if checkpointing else a.saved) * k
                    - a.working * k,
                    "train",
                    f"per micro-batch of the block: {THREAD_LOGITS} × its fp32 logits "
                    f"({format_nbytes(a.thread)}, freed at the backward's head) and 6% of its "
                    "activations, the fit's range (measured)",
                    "zero_optimization.layer_major.block",
                    heap=True,
                )
            )

    def overheads(self) -> None:
        """Measured, not mirrored (rules.py says where each figure comes from)."""
        self.add(
            Item(
                "runtime overhead (initialize)",
                "host",
                rules.INIT_OVERHEAD_NBYTES,
                "init",
                "aio engines, store records, hooks (measured)",
            )
        )
        self.add(
            Item(
                "runtime overhead (first step)",
                "host",
                rules.first_step_overhead_nbytes(self.dtype),
                "train",
                "kernel workspaces, autograd, thread arenas (measured)",
            )
        )
        for resource in ("host", "device"):
            for ph in ("init", "train"):
                base = sum(
                    i.nbytes
                    for i in self.items
                    if i.heap and i.resource == resource and i.phase in (ph, "run")
                )
                slack = -(-base * rules.SLACK_PERCENT // 100)
                if slack:
                    self.add(
                        Item(
                            "allocator slack",
                            resource,
                            slack,
                            ph,
                            f"{rules.SLACK_PERCENT}% of the tensors torch allocates and frees in this "
                            "phase: freed memory the heap keeps (measured)",
                        )
                    )


def _raise_pool(off, b: int, need_nbytes: int) -> str:
    """The fix for a parameter pool below ``need_nbytes``: either of its two keys, with the value that works."""
    size = math.ceil(need_nbytes / b / off.buffer_count)
    count = math.ceil(need_nbytes / BufferPool.capacity_for(1, off.buffer_size * b))
    return (
        f"raise zero_optimization.offload_param.buffer_size to at least {size:,} "
        f"or zero_optimization.offload_param.buffer_count to at least {count:,}"
    )


def _check_param_pool(problems: list[Problem], rt: RuntimePlan, zero, b: int) -> None:
    """The parameter pool must hold the largest NVMe shard (RuntimePlan.param_pool_refusal: initialize
    refuses otherwise) and a whole sub-group of NVMe shards (the step's read of it waits for pool space
    until its timeout)."""
    off = zero.offload_param
    assert rt.param_store is not None  # stage 3 has a parameter store
    capacity = rt.param_store.pool.capacity_nbytes
    refusal = rt.param_pool_refusal
    if refusal is not None:
        problems.append(
            Problem(
                f"the parameter pool ({off.buffer_count} × {off.buffer_size:,} elements) cannot hold layer "
                f"{refusal.layer!r}, whose shard is {refusal.shard_numel:,} elements; initialize refuses it",
                _raise_pool(off, b, refusal.shard_nbytes),
                engine_refuses=True,
            )
        )
        return
    need = max(rt.sub_group_param_nbytes(), default=0)
    if need > capacity:
        sub = max(u.layout.shard_numel for u in rt.nvme_units())
        problems.append(
            Problem(
                f"the optimizer step holds {format_nbytes(need)} of parameter shards at once (a sub-group of "
                f"sub_group_size {int(zero.sub_group_size):,}), more than the parameter pool's "
                f"{format_nbytes(capacity)}: it would wait for pool space until it times out",
                f"{_raise_pool(off, b, need)}, or lower zero_optimization.sub_group_size "
                f"(to {sub:,}, the largest shard, it needs {format_nbytes(max(rt.sub_group_param_nbytes(sub)))})",
            )
        )


def _check_scheduler(
    problems,
    zero,
    world: int,
    b: int,
    live_nbytes: int,
    working: int,
    pool_capacity: int | None,
    pool_working: int,
) -> None:
    """schedule/budget.py ScheduleBudget.check_serves, which initialize runs after moving the model
    home (so the pre-flight check refuses it first): the live budget must hold the partitioner's
    working set, and the parameter pool its NVMe part."""
    if live_nbytes < working:
        need = -(-working // b) * world
        problems.append(
            Problem(
                f"stage3_max_live_parameters ({int(zero.stage3_max_live_parameters):,} elements) is smaller than the "
                f"units the model holds at once ({format_nbytes(working)} per rank): the prefetch scheduler refuses it",
                f"raise zero_optimization.stage3_max_live_parameters to at least {need:,}",
            )
        )
    # A pool that cannot hold even the largest layer is initialize's to refuse, with the layer's name.
    pool_refused = any(p.engine_refuses for p in problems)
    if pool_capacity is not None and pool_working > 0 and not pool_refused:
        need = round_up(pool_working, 4096)
        if pool_capacity < need:
            problems.append(
                Problem(
                    f"the parameter pool ({format_nbytes(pool_capacity)}) cannot hold the units the model holds at "
                    f"once ({format_nbytes(need)}): the prefetch scheduler refuses it",
                    _raise_pool(zero.offload_param, b, need),
                )
            )
