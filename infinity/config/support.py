"""What this runtime acts on: the one table of DeepSpeed keys accepted but without effect here.

Every key the config layer knows is either acted on (the engine honours it,
or refuses values it cannot honour) or listed in ``NOT_ACTED_ON``. When a
user's config contains listed keys, they are reported once per process with
a ``logging`` warning on logger ``infinity.config`` -- accepted, never
silently ignored. As the engine implements a key, delete its line here.

``OPAQUE`` sections are known DeepSpeed sections whose inside this runtime
does not read at all (monitoring, profilers, other parallelisms...); they
are kept verbatim for ``to_dict()`` and reported as one key each.

Threading: the once-per-process record is guarded by a lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

logger = logging.getLogger("infinity.config")

# Key paths are written as users write them (DeepSpeed's canonical names).
NOT_ACTED_ON: frozenset[str] = frozenset(
    {
        # top level
        "dump_state",
        "prescale_gradients",
        "gradient_predivide_factor",
        "sparse_gradients",
        "communication_data_type",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
        "memory_breakdown",
        "dataloader_drop_last",
        "disable_allgather",
        # zero_optimization: communication and DeepSpeed-internal knobs
        "zero_optimization.overlap_comm",
        "zero_optimization.contiguous_gradients",
        "zero_optimization.reduce_scatter",
        "zero_optimization.reduce_bucket_size",
        "zero_optimization.use_multi_rank_bucket_allreduce",
        "zero_optimization.allgather_partitions",
        "zero_optimization.allgather_bucket_size",
        "zero_optimization.load_from_fp32_weights",
        "zero_optimization.elastic_checkpoint",
        "zero_optimization.ignore_unused_parameters",
        "zero_optimization.legacy_stage1",
        "zero_optimization.round_robin_gradients",
        "zero_optimization.stage3_model_persistence_threshold",
        "zero_optimization.stage3_module_granularity_threshold",
        "zero_optimization.stage3_use_all_reduce_for_fetch_params",
        "zero_optimization.stage3_allgather_sequential",
        "zero_optimization.stage3_partition_stream_chunk_size",
        "zero_optimization.zero_hpz_partition_size",
        "zero_optimization.zero_quantized_weights",
        "zero_optimization.zero_quantized_gradients",
        "zero_optimization.mics_shard_size",
        "zero_optimization.mics_hierarchical_params_gather",
        "zero_optimization.memory_efficient_linear",
        "zero_optimization.pipeline_loading_checkpoint",
        "zero_optimization.override_module_apply",
        "zero_optimization.log_trace_cache_warnings",
        "zero_optimization.enable_sanity_checks",
        "zero_optimization.save_muon_momentum_buffer_in_memory",
        "zero_optimization.cpu_offload_use_pin_memory",
        "zero_optimization.offload_optimizer.fast_init",
        "zero_optimization.offload_optimizer.ratio",
        "zero_optimization.offload_optimizer.super_offload",
        "zero_optimization.offload_optimizer.convert_grad_on_cpu",
        "zero_optimization.offload_optimizer.cpuadam_cores_perc",
        # precision
        "fp16.fp16_master_weights_and_grads",
        "fp16.fused_mode",
        "bf16.immediate_grad_update",
        "bf16.check_grad_overflow",
        "bf16.bf16_master_weights_and_grads",
        "bf16.bf16_optimizer_states",
        # optimizer
        "optimizer.legacy_fusion",
        # aio
        "aio.use_gds",
        # activation_checkpointing (cpu_checkpointing and partition_activations are acted on by
        # infinity.checkpointing, see [Note: checkpoint inputs] in infinity/zero/checkpointing.py)
        #   copies partitioned checkpoints into buffers preallocated for number_checkpoints layers,
        #   against CUDA caching-allocator fragmentation; infinity keeps each input as its own
        #   tensor (the allocator reuses the blocks every step), so there is nothing to copy into
        "activation_checkpointing.contiguous_memory_optimization",
        #   only sizes those buffers
        "activation_checkpointing.number_checkpoints",
        #   a device synchronize at every checkpoint boundary, a debugging aid that changes no
        #   result; infinity's copies already wait where they must (unpack before the recomputation)
        "activation_checkpointing.synchronize_checkpoint_boundary",
        #   per-checkpoint timing through DeepSpeed's timers, which infinity does not have (its
        #   wall_clock_breakdown times the whole forward, backward and step)
        "activation_checkpointing.profile",
        # checkpoint: every rank saves under the tag rank 0 chose (the tag travels with the save's
        #   agreement), so there is nothing to validate
        "checkpoint.tag_validation",
        #   infinity's checkpoints load on any number of ranks and nodes as saved; there is no
        #   offline-converted format to ask for
        "checkpoint.load_universal",
    }
)

# Known DeepSpeed sections (and section-valued zero keys) kept verbatim, not read.
OPAQUE: frozenset[str] = frozenset(
    {
        "aim",
        "amp",
        "autotuning",
        "checkpoint.parallel_write",
        "comet",
        "comms_logger",
        "compile",
        "compression_training",
        "curriculum_learning",
        "data_efficiency",
        "data_types",
        "datastates",
        "eigenvalue",
        "elasticity",
        "expert_parallel",
        "flops_profiler",
        "gradient_allreduce_op",
        "graph_harvesting",
        "hybrid_engine",
        "log_level",
        "monitor_config",
        "nebula",
        "pipeline",
        "progressive_layer_drop",
        "quantize_training",
        "seq_parallel_communication_data_type",
        "sequence_parallel_size",
        "sparse_attention",
        "tensor_parallel",
        "timers",
        "torch_autocast",
        "use_data_before_expert_parallelism",
        "vocabulary_size",
        "zero_optimization.leaf_module",
        "zero_optimization.zenflow",
        "zero_optimization.zeropp_loco_param",
    }
)


def acted_on(path: str) -> bool:
    """Whether the runtime honours the key at ``path`` (a known key path)."""
    return path not in NOT_ACTED_ON and path not in OPAQUE


_reported: set[str] = set()
_lock = threading.Lock()


def report_not_acted_on(paths: Iterable[str]) -> list[str]:
    """Logs, once per process per key, the given keys as accepted without effect; returns the new ones."""
    with _lock:
        new = sorted(set(paths) - _reported)
        _reported.update(new)
    if new:
        logger.warning(
            "these DeepSpeed config keys are accepted but have no effect in infinity: %s",
            ", ".join(new),
        )
    return new


def _forget_reports() -> None:
    """Test hook: makes the next load report again."""
    with _lock:
        _reported.clear()
