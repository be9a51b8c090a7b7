"""The run configuration: DeepSpeed's JSON schema read into typed, frozen, validated sections.

``load_config(path_or_dict, world_size=..., optimizer=..., **auto_values)``
is the one entry point; it returns an ``InfinityConfig`` (``describe_config``
renders one for people) composed of
``ZeroConfig`` (with ``OffloadParamConfig`` / ``OffloadOptimizerConfig``),
``FP16Config``, ``BF16Config``, ``OptimizerConfig``, ``SchedulerConfig``,
``ActivationCheckpointingConfig``, the monitor sections (``TensorBoardConfig``,
``CSVMonitorConfig``, ``WandbConfig``) and ``infinity.aio.AioConfig``. Which keys the runtime acts on is one table:
``infinity.config.support.NOT_ACTED_ON``. Which keyword arguments fill "auto"
is another, HF's (``infinity.config.arguments``); ``training_arguments_values``
reads them off a transformers ``TrainingArguments`` for the adapters.

Imports only infinity.aio (and torch, hjson).
"""

from infinity.aio.config import AioConfig
from infinity.config.activation import ActivationCheckpointingConfig
from infinity.config.arguments import TRAINING_ARGUMENTS, training_arguments_values
from infinity.config.checkpoint import CheckpointConfig
from infinity.config.errors import ConfigError
from infinity.config.jsonfile import read_config_file
from infinity.config.loader import load_config
from infinity.config.monitor import CSVMonitorConfig, TensorBoardConfig, WandbConfig
from infinity.config.optim import (
    SUPPORTED_OPTIMIZERS,
    SUPPORTED_SCHEDULERS,
    AdamParams,
    OptimizerConfig,
    SchedulerConfig,
    WarmupCosineLRParams,
    WarmupDecayLRParams,
    WarmupLRParams,
)
from infinity.config.precision import BF16Config, FP16Config
from infinity.config.quantization import QuantizedInitializationConfig, WeightQuantizationConfig
from infinity.config.root import InfinityConfig
from infinity.config.summary import describe_config
from infinity.config.support import NOT_ACTED_ON, OPAQUE, acted_on
from infinity.config.trace import TraceConfig, parse_trace_env
from infinity.config.zero import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

__all__ = [
    "NOT_ACTED_ON",
    "OPAQUE",
    "SUPPORTED_OPTIMIZERS",
    "SUPPORTED_SCHEDULERS",
    "TRAINING_ARGUMENTS",
    "ActivationCheckpointingConfig",
    "AdamParams",
    "AioConfig",
    "BF16Config",
    "CSVMonitorConfig",
    "CheckpointConfig",
    "ConfigError",
    "FP16Config",
    "InfinityConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "QuantizedInitializationConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "TensorBoardConfig",
    "TraceConfig",
    "WarmupCosineLRParams",
    "WarmupDecayLRParams",
    "WarmupLRParams",
    "WandbConfig",
    "WeightQuantizationConfig",
    "ZeroConfig",
    "acted_on",
    "describe_config",
    "load_config",
    "parse_trace_env",
    "read_config_file",
    "training_arguments_values",
]
