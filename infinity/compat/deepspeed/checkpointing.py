"""``deepspeed.checkpointing``: DeepSpeed's activation-checkpointing API, which infinity's
``infinity.checkpointing`` (infinity.zero.checkpointing) already is, under the same names:
``checkpoint``, ``non_reentrant_checkpoint``, ``configure``, ``is_configured``; and ``reset``."""

from __future__ import annotations

from typing import Any

from infinity.compat.deepspeed.errors import refuse
from infinity.zero.checkpointing import (
    checkpoint,
    configure,
    is_configured,
    non_reentrant_checkpoint,
)

__all__ = [
    "checkpoint",
    "configure",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "non_reentrant_checkpoint",
    "reset",
]


def reset() -> None:
    """DeepSpeed frees the buffers of ``contiguous_memory_optimization`` here; infinity keeps none
    (the option is accepted without effect), so there is nothing to free."""


def model_parallel_cuda_manual_seed(seed: Any) -> None:
    raise refuse(
        "deepspeed.checkpointing.model_parallel_cuda_manual_seed()",
        "it seeds Megatron's model-parallel RNG tracker, and infinity has no model parallelism",
        "seed with torch.manual_seed(seed); the checkpoint functions replay forward's RNG state",
    )
