"""SettingPlan: the itemised bytes one setting (stage × offload) allocates per rank, by tier and phase.

Items are built from the rules in rules.py (each mirrors named runtime code);
this module only applies them to one setting and adds them up. Two phases
matter for a peak: ``init`` (inside initialize: the model as the user built it
is still resident while the stores fill) and ``train`` (forward, backward,
step); ``run`` items exist in both. A tier's peak is the larger phase sum.
On a CPU compute device, device and host share RAM: ``ram_nbytes`` is the
larger phase sum of both.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Literal

import torch

from infinity.config import InfinityConfig
from infinity.estimate import rules
from infinity.estimate.activations import Activations
from infinity.estimate.model import ModelSpec, true_shapes
from infinity.memory import format_nbytes
from infinity.zero.unit import ParamUnit

Tier = Literal["device", "host", "nvme"]
Phase = Literal["init", "train", "run"]
Where = Literal["none", "cpu", "nvme"]

_ZINIT_CPU = "zero.Init store (fp32 shards)"


@dataclasses.dataclass(frozen=True)
class Setting:
    """Where state lives: the ZeRO stage and the two offload devices."""

    stage: int
    offload_param: Where
    offload_optimizer: Where
    tuned: bool = False
    """The config's sizing keys changed to fit (see tune.py); the plan lists the changes."""

    def label(self) -> str:
        tuned = " (tuned)" if self.tuned else ""
        return f"stage {self.stage}, params {self.offload_param}, optimizer {self.offload_optimizer}{tuned}"

    def keys(self) -> str:
        """The config keys that select this setting."""
        parts = [f"zero_optimization.stage={self.stage}"]
        if self.stage == 3:
            parts.append(f"offload_param.device={self.offload_param}")
        if self.stage >= 1:
            parts.append(f"offload_optimizer.device={self.offload_optimizer}")
        return ", ".join(parts)

    def words(self) -> str:
        """A reader's description: 'params on NVMe and optimizer on NVMe'."""
        where = {"none": "in device memory", "cpu": "in host memory", "nvme": "on NVMe"}
        p = "partitioned params" if self.stage == 3 else "params"
        opt_where = where[self.offload_optimizer]
        if self.offload_optimizer == "none":
            opt_where = "not offloaded"
        return f"stage {self.stage} with {p} {where[self.offload_param]} and optimizer {opt_where}"


def all_settings() -> list[Setting]:
    """Every valid setting: offload_param needs stage 3; offload_optimizer needs stage >= 1."""
    out = [Setting(0, "none", "none")]
    for stage in (1, 2):
        for o in ("none", "cpu", "nvme"):
            out.append(Setting(stage, "none", o))
    for p in ("none", "cpu", "nvme"):
        for o in ("none", "cpu", "nvme"):
            out.append(Setting(3, p, o))
    return out


@dataclasses.dataclass(frozen=True)
class Item:
    """One allocation (or group of like allocations) of a rank."""

    name: str
    tier: Tier
    nbytes: int
    phase: Phase
    detail: str = ""
    """What it is and which code allocates it."""
    key: str | None = None
    """The config key that sizes it (the fix when it is too big)."""
    counted: bool = True
    """False for budgets shown for sizing that live inside another item."""
    heap: bool = False
    """Allocated and freed by torch's allocator step after step (not an mmap'd buffer made once):
    the heap keeps some of it after it is freed (see rules.SLACK_PERCENT)."""


@dataclasses.dataclass(frozen=True)
class Problem:
    """A setting the runtime would refuse or stall on, whatever the machine."""

    message: str
    fix: str


@dataclasses.dataclass(frozen=True)
class SettingPlan:
    setting: Setting
    dtype: str
    items: tuple[Item, ...]
    problems: tuple[Problem, ...]
    device_type: str
    nvme_by_path: tuple[tuple[str, int], ...]
    """NVMe bytes per rank by directory (offload_param and offload_optimizer may differ)."""
    nvme_traffic_nbytes: int
    """Bytes a rank moves to and from NVMe per optimizer step (the speed ranking's first key)."""
    changes: tuple[tuple[str, int, int], ...] = ()
    """(config key, the config's value, the value planned) for a tuned setting."""

    def keys(self) -> str:
        """The config keys that select this plan (setting, plus tuned sizes)."""
        extra = [f"{k.removeprefix('zero_optimization.')}={new:,}" for k, _old, new in self.changes]
        return ", ".join([self.setting.keys()] + extra)

    def tier_nbytes(self, tier: Tier, phase: Phase) -> int:
        return sum(i.nbytes for i in self.items if i.counted and i.tier == tier and i.phase in (phase, "run"))

    def peak(self, tier: Tier) -> int:
        return max(self.tier_nbytes(tier, "init"), self.tier_nbytes(tier, "train"))

    @property
    def device_nbytes(self) -> int:
        return self.peak("device")

    @property
    def host_nbytes(self) -> int:
        return self.peak("host")

    @property
    def nvme_nbytes(self) -> int:
        return self.peak("nvme")

    @property
    def ram_nbytes(self) -> int:
        """Host memory when the compute device is the CPU (device and host share RAM)."""
        return max(
            self.tier_nbytes("host", ph) + self.tier_nbytes("device", ph) for ph in ("init", "train")
        )

    @property
    def pinned_pool_nbytes(self) -> int:
        """Bytes of pinned pools of at least one huge page (they may come from the hugetlb pool)."""
        return sum(i.nbytes for i in self.items if i.counted and i.tier == "host" and i.name.endswith(" pool")
                   and i.nbytes >= (2 << 20))


def _sum(units: Sequence[ParamUnit], attr: str, pred=lambda u: True) -> int:
    return sum(getattr(u.layout, attr) for u in units if pred(u))


def plan_setting(
    spec: ModelSpec,
    cfg: InfinityConfig,
    *,
    world_size: int,
    device_type: str,
    baseline_nbytes: int,
    activations: Activations | None,
    checkpointing: bool,
    zero_init: bool,
    changes: Sequence[tuple[str, int, int]] = (),
) -> SettingPlan:
    """Itemises what ``cfg`` (one setting) allocates per rank (see the module docstring).
    ``changes``: the sizing keys tune.py changed (recorded in the plan)."""
    zero = cfg.zero_optimization
    stage = zero.stage
    setting = Setting(stage, zero.offload_param.device, zero.offload_optimizer.device, tuned=bool(changes))
    dtype = rules.param_dtype(cfg)
    b = rules.itemsize(dtype)
    dname = str(dtype).removeprefix("torch.")
    with true_shapes(spec.module):
        units = rules.units_for(spec.module, cfg, world_size)
        params = [p for u in units for p in u.params]
        numels = [p.numel() for p in params]
        grad_numels = [p.numel() for p in params if p.requires_grad]
    cuda = device_type == "cuda"
    W = world_size
    items: list[Item] = []
    problems: list[Problem] = []
    block = cfg.aio.block_size
    add = items.append

    add(Item("process baseline", "host", baseline_nbytes, "run",
             "torch and infinity imported, torch._dynamo loaded by the first optimizer"
             + (", the CUDA context" if cuda else "")))

    # -- the model as the user built it ----------------------------------------
    zinit = zero_init and stage == 3
    nvme_paths: dict[str, int] = {}
    if zinit:
        with true_shapes(spec.module):
            sizes = rules.zero_init_shard_sizes(spec.module, W)
        if zero.offload_param.device == "nvme":
            add(Item("zero.Init pool", "host", rules.pool_nbytes(1, rules.INIT_POOL_NBYTES), "run",
                     "infinity/zero/init.py: the init store's pool (kept while the init store lives)"))
            n = rules.swap_growth_nbytes(sizes, block)
            add(Item("zero.Init swap files", "nvme", n, "run",
                     "each parameter's fp32 shard as built, files grown on demand", "offload_param.nvme_path"))
            meta = rules.swap_dir_overhead_nbytes(n)
            add(Item("zero.Init swap directory", "nvme", meta, "run", "lock file and file-system extent blocks"))
            nvme_paths[str(zero.offload_param.nvme_path)] = nvme_paths.get(str(zero.offload_param.nvme_path), 0) + n + meta
        else:
            add(Item(_ZINIT_CPU, "host", sum(sizes), "init",
                     "infinity/zero/init.py: each parameter's shard as built, freed once initialize has it", heap=True))
    else:
        built = spec.built_nbytes if spec.built_nbytes else spec.num_params * rules.FP32_NBYTES
        add(Item("model as built (fp32)", "host", built, "init",
                 "the module's parameters before initialize moves them"
                 + ("" if stage == 3 else (" (the same memory the module trains with on a CPU device)" if dtype == torch.float32 and not cuda else "")),
                 None, heap=True))

    # -- optimizer state (partitioned_adam.py; build.py _state_store) ---------------
    S = _sum(units, "shard_numel")
    keys = rules.state_keys(stage, dtype)
    opt_tier: Tier = "nvme" if setting.offload_optimizer == "nvme" else "host"
    opt_detail = "fp32, this rank's shards" + (" (swap files)" if opt_tier == "nvme" else " (host tensors)")
    key_opt = "zero_optimization.offload_optimizer.device"
    if "master" in keys:
        add(Item("fp32 master weights", opt_tier, S * 4, "run", opt_detail, key_opt))
    add(Item("Adam moments m, v", opt_tier, 2 * S * 4, "run", opt_detail, key_opt))
    add(Item("gradient partitions (fp32)", opt_tier, S * 4, "run", opt_detail + "; accumulated across micro-batches",
             key_opt))
    if opt_tier == "nvme":
        reserved = rules.swap_nbytes(S * rules.STATE_NBYTES_PER_ELEMENT, block)
        slack = reserved - S * 4 * len(keys)
        if slack:
            add(Item("optimizer swap reserve", "nvme", slack, "run",
                     "build.py reserves 16 B per element (rounded to aio.block_size)"
                     + (", also when the fp32 master is the parameter shard" if len(keys) == 3 else "")))
        path = str(zero.offload_optimizer.nvme_path)
        meta = rules.swap_dir_overhead_nbytes(reserved)
        add(Item("optimizer swap directory", "nvme", meta, "run", "lock file and file-system extent blocks"))
        nvme_paths[path] = nvme_paths.get(path, 0) + reserved + meta
        sub = rules.optimizer_pool_numel(units, zero)
        pool = rules.pool_nbytes(rules.OPTIMIZER_POOL_BUFFERS, sub * rules.STATE_NBYTES_PER_ELEMENT)
        add(Item("optimizer pool", "host", pool, "run",
                 f"3 sub-groups × {sub:,} elements × 16 B (read ‖ update ‖ write), pinned, huge pages",
                 "zero_optimization.sub_group_size"))
    else:
        add(Item("optimizer pool", "host", rules.pool_nbytes(1, rules.EMPTY_POOL_NBYTES), "run", "unused (no NVMe)"))

    # -- parameters (stage 3: the parameter store; else resident in the module) ----------
    nvme_traffic = 0
    if stage == 3:
        homes = rules.param_homes(units, zero)
        nv = [u for u in units if homes[u.index] == "nvme"]
        in_host = _sum(units, "shard_nbytes", lambda u: homes[u.index] == "cpu")
        n_persist = _sum(units, "shard_nbytes", lambda u: u.persistent)
        why = []
        if n_persist:
            why.append(f"{format_nbytes(n_persist)} persistent (< stage3_param_persistence_threshold)")
        if setting.offload_param == "nvme" and in_host > n_persist:
            why.append(f"{format_nbytes(in_host - n_persist)} kept by offload_param.max_in_cpu")
        add(Item(f"parameter shards in host memory ({dname})", "host", in_host, "run",
                 "; ".join(why) or "offload_param.device " + setting.offload_param,
                 "zero_optimization.offload_param.max_in_cpu" if setting.offload_param == "nvme" else
                 "zero_optimization.offload_param.device"))
        off = zero.offload_param
        if nv:
            pool_capacity = off.buffer_count * _round4k(off.buffer_size * b)
            add(Item("parameter pool", "host", rules.pool_nbytes(off.buffer_count, off.buffer_size * b), "run",
                     f"buffer_count {off.buffer_count} × buffer_size {off.buffer_size:,} × {b} B, pinned, huge pages",
                     "zero_optimization.offload_param.buffer_size"))
            nvme_nbytes = _sum(nv, "shard_nbytes")
            n = rules.swap_nbytes(nvme_nbytes, block)
            add(Item(f"parameter swap files ({dname})", "nvme", n, "run", "this rank's shards",
                     "zero_optimization.offload_param.nvme_path"))
            meta = rules.swap_dir_overhead_nbytes(n)
            add(Item("parameter swap directory", "nvme", meta, "run", "lock file and file-system extent blocks"))
            nvme_paths[str(off.nvme_path)] = nvme_paths.get(str(off.nvme_path), 0) + n + meta
            reads = 3 if dtype == torch.float32 else 2  # forward, backward (+ the step reads an fp32 master)
            nvme_traffic += nvme_nbytes * (reads + 1)
            _check_param_pool(problems, units, nv, homes, zero, b, pool_capacity)
            budget_where = "inside the parameter pool (host)"
        else:
            add(Item("parameter pool", "host", rules.pool_nbytes(1, rules.EMPTY_POOL_NBYTES), "run",
                     "unused (no parameter on NVMe)"))
            budget_where = "on the device" if cuda else "in host memory"
        total_p = _sum(units, "shard_nbytes", lambda u: not u.persistent)
        for label, key, numel in (
            ("prefetch budget", "stage3_prefetch_bucket_size", zero.stage3_prefetch_bucket_size),
            ("live-parameter budget", "stage3_max_live_parameters", zero.stage3_max_live_parameters),
        ):
            add(Item(label, "host" if nv else "device", min(numel * b, total_p), "train",
                     f"{key} {numel:,} elements × {b} B; {budget_where}, not added (no prefetch scheduler is wired yet)",
                     f"zero_optimization.{key}", counted=False))
        if cuda or W > 1:
            add(Item(f"persistent parameters, gathered ({dname})", "device",
                     sum(u.full_nbytes for u in units if u.persistent), "train",
                     "gathered once, kept for the whole run", "zero_optimization.stage3_param_persistence_threshold", heap=True))
            add(Item(f"gathered parameters, working set ({dname})", "device", rules.gathered_working_set(units),
                     "train", "the three largest units: tied embedding, unit in use, unit reducing its grads", heap=True))
        add(_grad_in_flight(grad_numels, b))
    else:
        phase: Phase = "run" if cuda else "train"
        add(Item(f"parameters in the module ({dname})", "device", sum(numels) * b, phase,
                 "stages 0-2 keep every parameter resident", heap=True))
        if stage <= 1:
            add(Item(f"gradients p.grad ({dname})", "device", sum(grad_numels) * b, "train",
                     "stages 0-1: autograd accumulates whole grads; reduced at the window's end",
                     "zero_optimization.stage", heap=True))
        else:
            add(_grad_in_flight(grad_numels, b))
    if opt_tier == "nvme":
        nvme_traffic += S * 4 * len(keys) * 2 - (S * 4 if "g" in keys else 0)  # g is only read back

    flat = rules.flat_buffers_nbytes(units, stage, W, dtype, caching=not cuda)
    if flat:
        add(Item("flat buffers (TensorCache)", "device", flat, "train",
                 "fp32 flat grads / gathers, reused; cached up to 4 × the largest unit" if not cuda else
                 "fp32 flat grads / gathers in use", heap=True))

    # -- initialisation transient (build.py: _full_values, shard conversion) ----------
    largest = max((u.layout.padded_numel for u in units), default=0)
    add(Item("initialisation transient", "host", largest * (rules.FP32_NBYTES + b), "init",
             "build.py _full_values: one unit's flat fp32 values and its converted shard", heap=True))

    if activations is not None:
        act_tier: Tier = "device"
        saved = activations.saved_checkpointed if checkpointing else activations.saved
        other = activations.saved if checkpointing else activations.saved_checkpointed
        add(Item("activations saved for backward", act_tier, saved, "train",
                 f"micro-batch {activations.micro_batch} × seq {activations.seq}, "
                 + ("every block checkpointed" if checkpointing else "no checkpointing")
                 + f" ({'without' if checkpointing else 'with'} checkpointing: {format_nbytes(other)})",
                 "train_micro_batch_size_per_gpu", heap=True))
        add(Item("backward working memory", act_tier, activations.working, "train",
                 "gradients of the logits and of one block's activations", heap=True))

    add(Item("runtime overhead (initialize)", "host", rules.INIT_OVERHEAD_NBYTES, "init",
             "aio engines, store records, hooks (measured)"))
    add(Item("runtime overhead (first step)", "host", rules.first_step_overhead_nbytes(dtype), "train",
             "kernel workspaces, autograd, thread arenas (measured)"))
    for tier in ("host", "device"):
        for ph in ("init", "train"):
            base = sum(i.nbytes for i in items if i.heap and i.tier == tier and i.phase in (ph, "run"))
            slack = -(-base * rules.SLACK_PERCENT // 100)
            if slack:
                add(Item("allocator slack", tier, slack, ph,  # type: ignore[arg-type]
                         f"{rules.SLACK_PERCENT}% of the tensors torch allocates and frees in this phase: "
                         "freed memory the heap keeps (measured)"))

    return SettingPlan(
        setting=setting,
        dtype=dname,
        items=tuple(items),
        problems=tuple(problems),
        device_type=device_type,
        nvme_by_path=tuple(nvme_paths.items()),
        nvme_traffic_nbytes=nvme_traffic,
        changes=tuple(changes),
    )


def _grad_in_flight(grad_numels: list[int], b: int) -> Item:
    """grad_hooks.py/grads.py: each grad is taken as autograd makes it and added into the fp32
    gradient partition (a 16-bit grad is upcast on the way)."""
    per = b + (rules.FP32_NBYTES if b < rules.FP32_NBYTES else 0)
    return Item("gradient in flight (largest parameter)", "device", max(grad_numels, default=0) * per, "train",
                "grad_hooks.py: each grad is taken as autograd makes it and added into its fp32 partition",
                heap=True)


def _round4k(n: int) -> int:
    return -(-n // 4096) * 4096


def _check_param_pool(problems, units, nv, homes, zero, b, capacity) -> None:
    """The parameter pool must hold the largest NVMe shard (build.py refuses otherwise) and what
    the optimizer step holds at once (else it waits for pool space until its timeout)."""
    off = zero.offload_param
    largest = max(nv, key=lambda u: u.layout.shard_nbytes)
    if largest.layout.shard_nbytes > capacity:
        problems.append(Problem(
            f"the parameter pool ({off.buffer_count} × {off.buffer_size:,} elements) cannot hold layer "
            f"{largest.module_name!r}, whose shard is {largest.layout.shard_numel:,} elements; initialize refuses it",
            f"raise zero_optimization.offload_param.buffer_size to at least "
            f"{math.ceil(largest.layout.shard_numel / off.buffer_count):,}",
        ))
        return
    need = rules.step_param_pool_need(units, homes, int(zero.sub_group_size))
    if need > capacity:
        sub = max(u.layout.shard_numel for u in nv)
        problems.append(Problem(
            f"the optimizer step holds {format_nbytes(need)} of parameter shards at once (two sub-groups of "
            f"sub_group_size {int(zero.sub_group_size):,}), more than the parameter pool's "
            f"{format_nbytes(capacity)}: it would wait for pool space until it times out",
            f"raise zero_optimization.offload_param.buffer_size to at least "
            f"{math.ceil(need / b / off.buffer_count):,}, or lower zero_optimization.sub_group_size "
            f"(to {sub:,}, the largest shard, it needs {format_nbytes(_pair_need(units, homes, sub))})",
        ))


def _pair_need(units, homes, sub: int) -> int:
    return rules.step_param_pool_need(units, homes, sub)
