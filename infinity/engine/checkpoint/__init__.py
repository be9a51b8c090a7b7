"""Checkpoints under offload: save and resume the full training state, export full weights.

Streaming (a unit at a time, with the aio engine), atomic (see [Note:
publishing a checkpoint] in atomic.py), checksummed (CRC32C per tensor and
per file), and free of pickle: tensors live in safetensors files and
everything else in JSON. See format.py for the layout on disk. Frozen units
(a LoRA base, a distillation's teacher) are kept as a reference to the
pretrained files they came from while unchanged, else saved once
([Note: frozen units in a checkpoint] in sources.py); a transformers model's
config.json and a PEFT adapter's config are kept for export (model_files.py). A frozen base
resting quantised is kept as its reference or its packed bytes ([Note: a quantised base in a
checkpoint] in quantised.py); a LoRA model's merged weights are streamed out by merged.py (from a
live engine) and merged_checkpoint.py (from a checkpoint).
"""

from infinity.engine.checkpoint.errors import (
    CheckpointBusyError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointIncompleteError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointPeerError,
    CheckpointSpaceError,
    CheckpointUnsupportedError,
)
from infinity.engine.checkpoint.export import export_checkpoint, save_16bit_model
from infinity.engine.checkpoint.load import load_checkpoint
from infinity.engine.checkpoint.merged import save_merged
from infinity.engine.checkpoint.merged_checkpoint import export_merged
from infinity.engine.checkpoint.reader import CheckpointReader
from infinity.engine.checkpoint.save import save_checkpoint
from infinity.engine.checkpoint.target import CheckpointTarget, TrainingParts

__all__ = [
    "CheckpointBusyError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointIncompleteError",
    "CheckpointMismatchError",
    "CheckpointUnsupportedError",
    "CheckpointNotFoundError",
    "CheckpointPeerError",
    "CheckpointReader",
    "CheckpointSpaceError",
    "CheckpointTarget",
    "TrainingParts",
    "export_checkpoint",
    "export_merged",
    "load_checkpoint",
    "save_16bit_model",
    "save_checkpoint",
    "save_merged",
]
