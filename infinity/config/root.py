"""InfinityConfig: the whole run's configuration, composed of the typed sections.

Built by ``load_config`` from a DeepSpeed-style file or dict (every "auto"
resolved, batch sizes completed), or directly in code. Frozen; validated in
``__post_init__`` so that no invalid combination can exist: fp16 with bf16,
batch sizes that do not multiply out, offload rules (see ZeroConfig).
``to_dict()`` gives back a DeepSpeed-shaped dict of the resolved values
(for checkpoint manifests); ``infinity.config.describe_config`` (summary.py)
renders it as a few readable lines.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, ClassVar, Literal

from infinity.aio.config import AioConfig
from infinity.config.activation import ActivationCheckpointingConfig
from infinity.config.budget import HostMemoryBudget, parse_host_memory_budget
from infinity.config.checkpoint import CheckpointConfig
from infinity.config.errors import ConfigError
from infinity.config.monitor import CSVMonitorConfig, TensorBoardConfig, WandbConfig
from infinity.config.optim import OptimizerConfig, SchedulerConfig
from infinity.config.precision import BF16Config, FP16Config
from infinity.config.quantization import WeightQuantizationConfig
from infinity.config.support import NOT_ACTED_ON, OPAQUE
from infinity.config.trace import TraceConfig
from infinity.config.values import (
    check_section,
    hints,
    internal,
    is_internal,
    knob,
    section_type,
)
from infinity.config.zero import ZeroConfig


@dataclasses.dataclass(frozen=True)
class InfinityConfig:
    """A validated run configuration (DeepSpeed's schema plus infinity's own keys)."""

    PATH: ClassVar[str] = ""

    train_batch_size: int = knob(1, ge=1)
    """Samples per optimizer step across all ranks: micro x accumulation x world size."""
    train_micro_batch_size_per_gpu: int = knob(1, ge=1)
    """Samples per forward/backward on one rank."""
    gradient_accumulation_steps: int = knob(1, ge=1)
    """Micro-batches per optimizer step."""
    gradient_clipping: float = knob(0.0, ge=0.0)
    """Clip the global gradient norm to this value; 0 disables clipping."""
    steps_per_print: int | None = knob(None, ge=1)
    """Log progress (step, lr, gradient norm, loss scale) on rank 0 every this many optimizer steps
    (DeepSpeed's code default is unset)."""
    preflight: bool = knob(True)
    """infinity: check memory and disk against the run before allocating anything."""
    max_seq_length: int | None = knob(None, ge=1)
    """infinity: the longest sequence, in tokens, a micro-batch carries: the pre-flight check and the
    placement planner size activations for it. Unset: the model's context, at most 2048 tokens (a
    model trained on shorter sequences is then refused for activations it never holds)."""
    skip_nonfinite_steps: bool = knob(False)
    """infinity (DeepSpeed has no such key): skip an optimizer step whose gradient norm or loss is inf
    or NaN, as fp16 skips an overflowing one (parameters, optimizer state and lr schedule stay;
    skipped_steps counts it). Off, such a step is applied and a warning names it."""
    host_memory_budget: float | str | None = knob(None)
    """infinity: the host memory the placement planner may fill when an offload section's device is
    "auto": bytes (12884901888, "12GiB") or a fraction of the available memory (0.5, "50%"); unset:
    the available memory less a safety margin (infinity/config/budget.py)."""
    fp16: FP16Config = knob(FP16Config())
    """fp16 training and loss scaling."""
    bf16: BF16Config = knob(BF16Config(), aliases=("bfloat16",))
    """bf16 training (section alias: bfloat16)."""
    zero_optimization: ZeroConfig = knob(ZeroConfig())
    """Partitioning and offload."""
    optimizer: OptimizerConfig | None = knob(None)
    """The optimizer to build, if the user passes none."""
    scheduler: SchedulerConfig | None = knob(None)
    """The lr schedule to build, if the user passes none."""
    aio: AioConfig = knob(AioConfig())
    """NVMe I/O engine settings (aio.intra_op_parallelism is an alias of aio.thread_count)."""
    weight_quantization: WeightQuantizationConfig = knob(WeightQuantizationConfig())
    """Weight-only quantisation at rest, for inference (DeepSpeed ZeRO-Inference's keys)."""
    activation_checkpointing: ActivationCheckpointingConfig = knob(ActivationCheckpointingConfig())
    """Where infinity.checkpointing keeps checkpoint inputs (host memory, split across model parallelism)."""
    tensorboard: TensorBoardConfig = knob(TensorBoardConfig())
    """TensorBoard event files of every optimizer step's figures (infinity.monitor)."""
    csv_monitor: CSVMonitorConfig = knob(CSVMonitorConfig())
    """CSV files of every optimizer step's figures (infinity.monitor)."""
    wandb: WandbConfig = knob(WandbConfig())
    """A Weights & Biases run of every optimizer step's figures (infinity.monitor)."""
    checkpoint: CheckpointConfig = knob(CheckpointConfig())
    """How engine checkpoints are written (node-local storage: docs/node-local-checkpoints.md)."""
    trace: TraceConfig = knob(TraceConfig())
    """infinity: record chosen steps as a timeline (Chrome-trace / Perfetto JSON; docs/tracing.md)."""
    wall_clock_breakdown: bool = knob(False)
    """Log forward, backward, step and I/O-wait times of each logged step (every steps_per_print
    steps, or every step when that is unset), with the device synchronised at each boundary."""
    dump_state: bool = knob(False)
    """DeepSpeed: print the engine's state after initialization."""
    prescale_gradients: bool = knob(False)
    """DeepSpeed: scale gradients before the all-reduce."""
    gradient_predivide_factor: float = knob(1.0, gt=0.0)
    """DeepSpeed: divide gradients by this before the all-reduce."""
    sparse_gradients: bool = knob(False)
    """DeepSpeed: CSR gradients for sparse embeddings."""
    communication_data_type: Literal["fp16", "bf16", "fp32"] | None = knob(None, casefold=True)
    """DeepSpeed: dtype of gradient communication."""
    zero_allow_untested_optimizer: bool = knob(False)
    """DeepSpeed: allow client optimizers it has not tested with ZeRO."""
    zero_force_ds_cpu_optimizer: bool = knob(True)
    """DeepSpeed: insist on its CPU Adam under optimizer offload."""
    memory_breakdown: bool = knob(False)
    """DeepSpeed: log memory use."""
    dataloader_drop_last: bool = knob(False)
    """DeepSpeed: drop the last incomplete batch of its data loader."""
    disable_allgather: bool = knob(False)
    """DeepSpeed: broadcast instead of all-gather."""

    world_size: int = internal(1, compare=True)
    """Data-parallel ranks the batch sizes were resolved for (not a DeepSpeed key)."""
    opaque: dict[str, Any] = internal(default_factory=dict)
    """Known DeepSpeed sections infinity does not read, verbatim, by key path (see support.OPAQUE)."""
    auto_filled: tuple[tuple[str, str], ...] = internal(())
    """(key path, where its value came from) for every value load_config filled in: each "auto",
    and the optimizer section it writes from lr= when the config has none."""
    user_keys: frozenset[str] = internal(frozenset())
    """Key paths present in the user's config (canonical names)."""

    def __post_init__(self) -> None:
        check_section(self)
        parse_host_memory_budget(self.host_memory_budget)  # refused here, naming the key
        if (
            isinstance(self.world_size, bool)
            or not isinstance(self.world_size, int)
            or self.world_size < 1
        ):
            raise ConfigError(f"world_size must be an integer >= 1; got {self.world_size!r}")
        t, m, a, w = (
            self.train_batch_size,
            self.train_micro_batch_size_per_gpu,
            self.gradient_accumulation_steps,
            self.world_size,
        )
        if t != m * a * w:
            raise ConfigError(
                f"train_batch_size ({t}) must equal train_micro_batch_size_per_gpu x "
                f"gradient_accumulation_steps x world_size = {m} x {a} x {w} = {m * a * w}"
            )
        if self.fp16.enabled and self.bf16.enabled:
            raise ConfigError(
                "fp16.enabled and bf16.enabled are both true; enable one of them (or neither, for fp32)"
            )
        stage = self.zero_optimization.stage
        for path, on in (
            ("fp16.fp16_master_weights_and_grads", self.fp16.fp16_master_weights_and_grads),
            ("bf16.bf16_master_weights_and_grads", self.bf16.bf16_master_weights_and_grads),
            ("bf16.bf16_optimizer_states", self.bf16.bf16_optimizer_states),
        ):
            if on and stage == 0:
                raise ConfigError(
                    f"{path} is true but zero_optimization.stage is 0; it needs stage 1, 2 or 3 "
                    "(as in DeepSpeed)"
                )
        if self.bf16.bf16_optimizer_states and not self.bf16.bf16_master_weights_and_grads:
            raise ConfigError(
                "bf16.bf16_optimizer_states needs bf16.bf16_master_weights_and_grads to be true "
                "(as in DeepSpeed)"
            )

    @property
    def host_budget(self) -> HostMemoryBudget | None:
        """``host_memory_budget`` parsed (None: unset, the planner's default applies)."""
        return parse_host_memory_budget(self.host_memory_budget)

    @property
    def precision(self) -> Literal["fp32", "fp16", "bf16"]:
        """The training precision the config selects."""
        return "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"

    def ignored_keys(self) -> list[str]:
        """Key paths in the user's config that this runtime accepts without acting on."""
        return sorted(k for k in self.user_keys if k in NOT_ACTED_ON or k in OPAQUE)

    def to_dict(self) -> dict[str, Any]:
        """A DeepSpeed-shaped dict of the resolved values; load_config(to_dict()) gives this config back."""
        out = _section_dict(self)
        for path, value in self.opaque.items():
            node = out
            *parents, leaf = path.split(".")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = copy.deepcopy(value)
        return out


def _section_dict(obj: Any) -> dict[str, Any]:
    if isinstance(obj, AioConfig):
        return obj.to_dict()
    out: dict[str, Any] = {}
    types = hints(type(obj))
    for f in dataclasses.fields(obj):
        if is_internal(f):
            continue
        value = getattr(obj, f.name)
        if value is None and section_type(types[f.name]) is not None:
            continue  # no optimizer / scheduler section
        out[f.name] = _value(value)
    return out


def _value(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _section_dict(value)
    if isinstance(value, tuple):
        return [_value(v) for v in value]
    return value
