"""RunContext: what the pre-flight check and the placement planner know about a run before it allocates.

The model as described for the estimate, what the process holds already (its
baseline and the model as built: measured, not to be found again), whether
zero.Init built it, the activations of one micro-batch (infinity.models.GPT's
measured coefficients, any other model traced: infinity/estimate/traced.py)
and whether the model checkpoints them, and how many ranks share this node.
``itemise(cfg, runtime)`` is the Breakdown of a RuntimePlan under it
(itemise.py), and ``host_need`` the host memory that breakdown still needs per
rank — the quantity the pre-flight check compares with the
available memory and ``host_memory_budget`` bounds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from infinity.config import InfinityConfig
from infinity.estimate.activations import Activations
from infinity.estimate.breakdown import Breakdown
from infinity.estimate.itemise import itemise
from infinity.estimate.machine import ranks_on_this_node, runtime_baseline_nbytes
from infinity.estimate.model import ModelSpec, describe_model
from infinity.estimate.runtime_plan import RuntimePlan, train_dtype
from infinity.estimate.traced import PREFLIGHT_MAX_SEQ, max_context, model_activations
from infinity.zero import init as zero_init_mod


@dataclasses.dataclass(frozen=True)
class RunContext:
    spec: ModelSpec
    held_nbytes: int
    """Host memory this process holds now (baseline and the model as built)."""
    zero_init: bool
    activations: Activations | None
    device_type: str
    """"cpu" or "cuda"."""
    world_size: int
    ranks_per_node: int
    checkpointing: bool = False
    """Activations counted as with every transformer block checkpointed (as the model is set up, or the
    estimate's option)."""
    constructed: bool = False
    """The model is built (the pre-flight check, run inside initialize): what zero.Init's construction
    allocated is there already — its heap in ``held_nbytes``, its swap files on the disk whose free
    space is read — shown, not counted again."""
    block: int | None = None
    """Trained by engine.train_batch in blocks of this many micro-batches, their activations alive at
    once ([Note: layer-major blocks] in blocks.py); None: by the micro-batch loop."""

    def blocks(self, gas: int) -> int | None:
        """How many blocks a window of ``gas`` micro-batches runs in (None: the micro-batch loop)."""
        return None if self.block is None else -(-gas // min(self.block, gas))

    def itemise(
        self,
        cfg: InfinityConfig,
        runtime: RuntimePlan | None = None,
        changes: Sequence[tuple[str, int, int]] = (),
    ) -> Breakdown:
        return itemise(
            self.spec,
            cfg,
            world_size=self.world_size,
            device_type=self.device_type,
            baseline_nbytes=max(0, self.held_nbytes - self.spec.built_nbytes),
            activations=self.activations,
            checkpointing=self.checkpointing,
            block=self.block,
            zero_init=self.zero_init,
            constructed=self.constructed,
            changes=changes,
            runtime=runtime,
        )

    def host_need(self, breakdown: Breakdown) -> int:
        """Host memory ``breakdown`` needs per rank beyond what the process holds (RAM on a CPU device)."""
        per_rank = breakdown.ram_nbytes if breakdown.device_type == "cpu" else breakdown.host_nbytes
        return per_rank - self.held_nbytes


def run_context(
    model: nn.Module, cfg: InfinityConfig, *, device: torch.device | str, world_size: int
) -> RunContext:
    """The context of ``model`` trained under ``cfg`` on ``device`` in this process, measured now."""
    device_type = "cuda" if torch.device(device).type == "cuda" else "cpu"
    spec = describe_model(model)
    context = max_context(model)
    acts, checkpointing = model_activations(
        spec,
        micro_batch=cfg.train_micro_batch_size_per_gpu,
        seq=cfg.max_seq_length or (min(context, PREFLIGHT_MAX_SEQ) if context else None),
        dtype=train_dtype(cfg),
        device_type=device_type,
    )
    return RunContext(
        spec=spec,
        held_nbytes=runtime_baseline_nbytes(),
        zero_init=zero_init_mod.init_store_of(list(model.parameters())) is not None,
        activations=acts,
        device_type=device_type,
        world_size=world_size,
        ranks_per_node=ranks_on_this_node(),
        checkpointing=checkpointing,
        constructed=True,
    )
