"""The ``zero_optimization`` section: stage, offload targets, partitioner and prefetch knobs.

Defaults are DeepSpeed's code defaults (``deepspeed/runtime/zero/config.py``,
``offload_config.py``); where its docs say otherwise the code wins and the
field says so. Sizes named ``*_size``, ``stage3_*``, ``sub_group_size`` and
``max_in_cpu`` count *elements*, as in DeepSpeed; the engine converts to
bytes with the dtype it stores.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import ClassVar, Literal

from infinity.config.errors import ConfigError
from infinity.config.values import check_section, knob

OffloadDevice = Literal["none", "cpu", "nvme", "auto"]
"""Where a section's state rests. "auto" (infinity): the placement planner decides per unit and per
state class between host memory and NVMe, within ``host_memory_budget`` (infinity.estimate.placement);
an "auto" here is a value, not a blank for initialize() to fill."""
ZeroStage = Literal[0, 1, 2, 3]
NvmePath = str | tuple[str, ...] | None
"""One folder, or (an infinity extension: DeepSpeed takes one) a list of folders, one per drive."""


def nvme_paths(section: OffloadParamConfig | OffloadOptimizerConfig) -> tuple[str, ...]:
    """The folders a section's nvme_path names (none, one, or one per drive)."""
    p = section.nvme_path
    return () if p is None else (p,) if isinstance(p, str) else p


def _check_nvme_path(section: OffloadParamConfig | OffloadOptimizerConfig) -> None:
    """A list names each folder once (as written: ``~`` and relative paths resolved, nothing read
    from the disk; store.nvme_path checks the folders themselves, symbolic links included)."""
    seen: dict[str, str] = {}
    for p in nvme_paths(section):
        norm = os.path.normpath(os.path.abspath(os.path.expanduser(p)))
        if norm in seen:
            same = (
                f"'{p}' twice"
                if p == seen[norm]
                else f"the same folder twice: '{seen[norm]}' and '{p}' are both {norm}"
            )
            raise ConfigError(
                f"{section.PATH}.nvme_path lists {same}; list each drive's folder once "
                "(the swap space is striped over the folders listed, one per drive)"
            )
        seen[norm] = p


@dataclasses.dataclass(frozen=True)
class OffloadParamConfig:
    """``zero_optimization.offload_param``: where stage-3 parameter partitions live at rest."""

    PATH: ClassVar[str] = "zero_optimization.offload_param"

    device: OffloadDevice = knob("none")
    """none | cpu | nvme | auto. DeepSpeed's docs say the default is cpu; its code says none. auto
    (infinity): each unit's parameter shard in host memory or on NVMe, as the placement planner
    decides within host_memory_budget."""
    nvme_path: NvmePath = knob(None)
    """Folder for the swap files (required with device nvme; each rank uses ``rank<N>/`` below it), or a
    list of folders, one per drive, that each rank's swap space is striped over (infinity; DeepSpeed
    takes one folder and says to build a RAID-0)."""
    buffer_count: int = knob(5, ge=1)
    """Pinned swap-in buffers in the parameter pool."""
    buffer_size: int = knob(100_000_000, ge=1)
    """Elements per pool buffer; must hold the largest parameter partition."""
    max_in_cpu: int = knob(1_000_000_000, ge=0)
    """Parameter elements kept in CPU memory when device is nvme."""
    pin_memory: bool = knob(True)
    """Page-locked host buffers. DeepSpeed's default became true in #8207 (it was false)."""
    integrity: bool = knob(True)
    """infinity: with device nvme, a CRC32C of every parameter partition written to the swap files,
    checked when it is read back; a mismatch (a zeroed block, a flipped bit) stops training with an
    error naming the file, offset, unit and both checksums instead of training on wrong numbers.
    Costs one extra pass over the swapped bytes, mostly beside the I/O (docs/reliability.md); false
    turns it off."""

    def __post_init__(self) -> None:
        check_section(self)
        _check_nvme_path(self)


@dataclasses.dataclass(frozen=True)
class OffloadOptimizerConfig:
    """``zero_optimization.offload_optimizer``: where fp32 master weights and moments live."""

    PATH: ClassVar[str] = "zero_optimization.offload_optimizer"

    device: OffloadDevice = knob("none")
    """none | cpu | nvme | auto. The optimizer step runs on the CPU for cpu, nvme and auto. auto
    (infinity): each unit's master weights, moments and gradient in host memory or on NVMe, as the
    placement planner decides within host_memory_budget."""
    nvme_path: NvmePath = knob(None)
    """Folder for the swap files (required with device nvme), or a list of folders, one per drive,
    striped over as offload_param.nvme_path is."""
    buffer_count: int = knob(4, ge=1)
    """Pinned buffers for optimizer-state swapping (Adam streams 4 states: param, grad, m, v)."""
    pin_memory: bool = knob(True)
    """Page-locked host buffers (DeepSpeed's default since #8207)."""
    integrity: bool = knob(True)
    """infinity: with device nvme, a CRC32C of every optimizer-state tensor written to the swap files,
    checked when it is read back (see offload_param.integrity); false turns it off."""
    grads_in_host: bool = knob(False)
    """infinity: with device nvme, the fp32 gradient partitions wait for the step in host memory
    (4 B per parameter) instead of swap files, which saves writing and reading them back: 8 B per
    parameter of NVMe traffic per step. DeepSpeed swaps them to NVMe (the default here too)."""
    pipeline_read: bool = knob(False)
    """Read sub-group i+1 while sub-group i is updated."""
    pipeline_write: bool = knob(False)
    """Write sub-group i-1 while sub-group i is updated."""
    fast_init: bool = knob(False)
    """DeepSpeed: build the fp32 state from the swapped 16-bit params."""
    ratio: float = knob(1.0, ge=0.0, le=1.0)
    """DeepSpeed Twin-Flow: the share of the optimizer step run on the CPU."""
    super_offload: bool = knob(False)
    """DeepSpeed SuperOffload for GH200-class machines."""
    convert_grad_on_cpu: bool = knob(True)
    """DeepSpeed SuperOffload: convert gradients on the CPU rather than the GPU."""
    cpuadam_cores_perc: float = knob(0.8, ge=0.0, le=1.0)
    """DeepSpeed SuperOffload: share of CPU cores given to CPU Adam."""

    def __post_init__(self) -> None:
        check_section(self)
        _check_nvme_path(self)


@dataclasses.dataclass(frozen=True)
class LayerMajorConfig:
    """``zero_optimization.layer_major`` (infinity; DeepSpeed has none): how ``engine.train_batch``
    runs a window's micro-batches ([Note: layer-major blocks] in infinity/estimate/blocks.py). With
    this section in the config, initialize plans for train_batch: the pre-flight check counts a
    block's micro-batches' activations; without it, train_batch's first call chooses the block
    within the host memory free then."""

    PATH: ClassVar[str] = "zero_optimization.layer_major"

    block: int | Literal["auto"] = knob("auto", ge=1)
    """Micro-batches run layer-major at once (each unit read once per block; gradients accumulate
    over the blocks): an integer (at most gradient_accumulation_steps is used; 1 is the
    micro-batch loop's order), or "auto": the block with the least predicted step time whose
    activations fit the host-memory budget."""

    def __post_init__(self) -> None:
        check_section(self)


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
    """``zero_optimization``: how training state is partitioned across ranks and tiers."""

    PATH: ClassVar[str] = "zero_optimization"

    stage: ZeroStage = knob(0, auto_default=False)
    """0 none; 1 optimizer state; 2 + gradients; 3 + parameters partitioned across ranks. "auto" needs
    stage= (Accelerate fills it from its plugin's zero_stage): its default would run nothing offloaded."""
    offload_param: OffloadParamConfig = knob(OffloadParamConfig())
    """Parameter offload (stage 3 only)."""
    offload_optimizer: OffloadOptimizerConfig = knob(OffloadOptimizerConfig())
    """Optimizer-state offload (stages 1-3; nvme is accepted at stages 1 and 2 too, unlike DeepSpeed)."""
    layer_major: LayerMajorConfig = knob(LayerMajorConfig())
    """infinity: engine.train_batch's blocks of micro-batches run layer-major."""
    sub_group_size: int = knob(1_000_000_000, ge=1)
    """Elements per optimizer-step tile; with nvme, the unit streamed NVMe <-> CPU."""
    stage3_prefetch_bucket_size: int = knob(50_000_000, ge=0, aliases=("prefetch_bucket_size",))
    """Most parameter elements fetched ahead of use (DeepSpeed code 5e7; its docs table says 5e8)."""
    stage3_param_persistence_threshold: int = knob(
        100_000, ge=0, aliases=("param_persistence_threshold",)
    )
    """Parameters with fewer elements stay resident, never partitioned."""
    stage3_max_live_parameters: int = knob(1_000_000_000, ge=0, aliases=("max_live_parameters",))
    """Most parameter elements resident before releases are forced."""
    stage3_max_reuse_distance: int = knob(1_000_000_000, ge=0, aliases=("max_reuse_distance",))
    """Keep a parameter that is used again within this many elements of the trace."""
    stage3_gather_16bit_weights_on_model_save: bool = knob(
        False,
        aliases=("gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save"),
    )
    """Gather full 16-bit weights when the model is saved."""
    stage3_model_persistence_threshold: int = knob(
        sys.maxsize, ge=0, aliases=("model_persistence_threshold",)
    )
    """DeepSpeed: cap on the total elements kept resident by the persistence threshold."""
    stage3_module_granularity_threshold: int = knob(0, aliases=("module_granularity_threshold",))
    """DeepSpeed: fetch fine-grained modules as one unit."""
    stage3_use_all_reduce_for_fetch_params: bool = knob(
        False, aliases=("use_all_reduce_for_fetch_params",)
    )
    """DeepSpeed: fetch parameters with all-reduce instead of all-gather."""
    stage3_allgather_sequential: bool = knob(False, aliases=("allgather_sequential",))
    """DeepSpeed: all-gather parameters one by one, without bucketing."""
    stage3_partition_stream_chunk_size: int = knob(
        0, ge=0, aliases=("partition_stream_chunk_size",)
    )
    """DeepSpeed: stream very large parameters through chunks of this size in zero.Init."""
    overlap_comm: bool | None = knob(None)
    """DeepSpeed: overlap gradient reduction with backward; unset means true at stage 3."""
    contiguous_gradients: bool = knob(True)
    """DeepSpeed: copy gradients into one contiguous buffer as they are produced."""
    reduce_scatter: bool = knob(True)
    """DeepSpeed: reduce-scatter instead of all-reduce to average gradients."""
    reduce_bucket_size: int = knob(500_000_000, ge=0)
    """DeepSpeed: elements reduced at a time."""
    use_multi_rank_bucket_allreduce: bool = knob(True)
    """DeepSpeed: merge the ranks' reduce buckets into one all-reduce."""
    allgather_partitions: bool = knob(True)
    """DeepSpeed: all-gather updated partitions (instead of broadcasts) after the step."""
    allgather_bucket_size: int = knob(500_000_000, ge=0)
    """DeepSpeed: elements all-gathered at a time."""
    load_from_fp32_weights: bool = knob(True)
    """DeepSpeed: restore fp32 master weights from the checkpoint's fp32 copy."""
    elastic_checkpoint: bool = knob(False)
    """DeepSpeed: legacy elastic checkpoints."""
    ignore_unused_parameters: bool = knob(True)
    """DeepSpeed (stage 2): tolerate parameters that get no gradient."""
    legacy_stage1: bool = knob(False)
    """DeepSpeed: the old stage-1 implementation."""
    round_robin_gradients: bool = knob(False)
    """DeepSpeed (stages 1-2): spread gradient copies to the CPU across ranks."""
    zero_hpz_partition_size: int = knob(1, ge=0)
    """DeepSpeed ZeRO++: ranks in the secondary (hierarchical) parameter partition."""
    zero_quantized_weights: bool = knob(False)
    """DeepSpeed ZeRO++: quantize weights for all-gather."""
    zero_quantized_nontrainable_weights: bool = knob(False)
    """Stage 3: frozen weights (``requires_grad=False``: a LoRA run's base) rest quantised, in
    weight_quantization.quantized_initialization's format (default 8 bits, groups of 64), and are
    dequantised after each read; trainable ones stay as they are."""
    zero_quantized_gradients: bool = knob(False)
    """DeepSpeed ZeRO++: quantize gradients for reduction."""
    mics_shard_size: int = knob(-1, ge=-1)
    """DeepSpeed MiCS: shard group size (-1 off)."""
    mics_hierarchical_params_gather: bool = knob(False)
    """DeepSpeed MiCS: hierarchical all-gather."""
    memory_efficient_linear: bool = knob(True)
    """DeepSpeed (stage 3): its memory-efficient linear layer."""
    pipeline_loading_checkpoint: bool = knob(False)
    """DeepSpeed (stage 3): load checkpoints in pipeline mode."""
    override_module_apply: bool = knob(True)
    """DeepSpeed (stage 3): patch nn.Module.apply to gather parameters."""
    log_trace_cache_warnings: bool = knob(False)
    """DeepSpeed: log prefetch-trace invalidations."""
    enable_sanity_checks: bool = knob(False)
    """DeepSpeed: internal consistency checks."""
    save_muon_momentum_buffer_in_memory: bool = knob(False)
    """DeepSpeed: keep Muon's momentum in memory under NVMe offload."""
    cpu_offload_use_pin_memory: bool | None = knob(None)
    """DeepSpeed, deprecated: read by nothing there either (use offload_*.pin_memory)."""

    def __post_init__(self) -> None:
        check_section(self)
        if self.overlap_comm is None:
            object.__setattr__(self, "overlap_comm", self.stage == 3)
        p, o = self.offload_param, self.offload_optimizer
        if p.device != "none" and self.stage != 3:
            raise ConfigError(
                f'zero_optimization.offload_param.device is "{p.device}" but '
                f"zero_optimization.stage is {self.stage}; parameter offload needs stage 3 "
                '(as in DeepSpeed): set "stage": 3, or "offload_param": {"device": "none"}'
            )
        if o.device != "none" and self.stage == 0:
            raise ConfigError(
                f'zero_optimization.offload_optimizer.device is "{o.device}" but '
                "zero_optimization.stage is 0, which neither partitions nor offloads the "
                'optimizer: set "stage" to 1, 2 or 3, or "offload_optimizer": {"device": "none"}'
            )
        for section in (p, o):
            if section.device in ("nvme", "auto") and section.nvme_path is None:
                why = (
                    " (the placement planner spills there what host memory cannot hold)"
                    if section.device == "auto"
                    else ""
                )
                raise ConfigError(
                    f'{section.PATH}.nvme_path is required when {section.PATH}.device is "{section.device}"'
                    f"{why}: a folder on a fast local disk for the swap files; set it in the config, "
                    "or pass nvme_path= to initialize()/load_config()"
                )
