"""Layer-major blocks: how many of a window's micro-batches engine.train_batch runs layer-major at once.

[Note: layer-major blocks]
``engine.train_batch`` runs the window's g micro-batches as ceil(g/k) blocks
of k (the last one shorter when k does not divide g): each block layer-major
([Note: layer-major accumulation] in infinity/engine/layer_major.py), the
gradients accumulating over the blocks as over the micro-batch loop's
micro-batches, the optimizer step after the last. k = g reads each unit once
per step; k = 1 is the micro-batch loop's order.
- Memory: a block's k micro-batches are alive at once. Each keeps its saved
  activations and, since one autograd call walks the k graphs together, its
  backward working set; and beyond those THREAD_LOGITS × its fp32 logits
  (activations.py says why). ``Activations.block`` counts them (6% high,
  BLOCK_FIT_MARGIN); itemise.py itemises them. That holds only because the
  engine trims the heaps as the block runs ([Note: layer-major accumulation],
  heaps): untrimmed, the forward threads' heaps kept their transients and the
  freed activations, a share that grows with the model's width. Measured peak
  RSS of train_batch in a fresh process against the estimate (infinity's
  GPT, fp32, stage 3, everything on NVMe): 1.04-1.09 at L 2-4, d 128-256,
  V 256-8192, T 32-256, k 8-32, and 1.06 at the 152M bench GPT (d 1024,
  T 256, k 2), where the untrimmed run peaked at 1,519 MiB against 1,208
  estimated (tests/estimate/test_layer_major.py holds the cheap shapes).
- Traffic: each array on NVMe moves as with gas = ceil(g/k) (traffic.py).
- Choice (``zero_optimization.layer_major.block``): an integer is taken as
  it is (at most g); "auto" takes, among k = ceil(g/n) for n = 1..g (n blocks),
  the one with the least predicted step time whose plan fits: compute is the
  same for every k (the same forwards and backwards), so the times differ by
  the NVMe bytes at the disk's speed, and the least bytes win; ties (nothing
  on NVMe) go to the least memory. Under "auto" offload sections the planner
  places the state anew for each k (a block's activations leave less of the
  budget for state); with fixed sections the plan is the same for every k
  and the largest k that fits the host memory wins.
- When: a config with the ``zero_optimization.layer_major`` section is
  planned for train_batch by initialize (rank_plan.py), and the pre-flight
  check counts a block's micro-batches. Without the section initialize plans
  for the micro-batch loop (one micro-batch's activations), and
  train_batch's first call chooses k within the host memory free then
  (``block_after_initialize``). Every rank takes the smallest rank's k (the
  blocks' backwards reduce gradients together).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

from infinity.config import InfinityConfig
from infinity.estimate.budget import default_budget
from infinity.estimate.context import run_context
from infinity.estimate.machine import MachineView, machine_view
from infinity.estimate.runtime_plan import RuntimePlan
from infinity.estimate.traffic import expected_traffic
from infinity.memory import format_nbytes
from infinity.zero.collectives import DataParallelGroup

log = logging.getLogger("infinity.estimate")

SECTION_KEY = "zero_optimization.layer_major"


def planned_for_train_batch(cfg: InfinityConfig) -> bool:
    """Whether initialize plans for engine.train_batch: the config has the layer_major section."""
    return SECTION_KEY in cfg.user_keys


def candidate_blocks(gas: int) -> list[int]:
    """The block sizes worth trying, largest first: ceil(gas / n) for n = 1..gas blocks (any other k
    runs as many blocks as the next one up, with more micro-batches alive)."""
    return sorted({-(-gas // n) for n in range(1, gas + 1)}, reverse=True)


def block_setting(cfg: InfinityConfig) -> int | Literal["auto"]:
    return cfg.zero_optimization.layer_major.block


@dataclasses.dataclass(frozen=True)
class BlockTrial:
    """One block size tried: its plan, whether that fits, what it needs in host memory."""

    block: int
    plan: RuntimePlan
    fits: bool
    need_nbytes: int

    def step_nbytes(self) -> int:
        """NVMe bytes a step moves in blocks of this size (traffic.py)."""
        gas = self.plan.gradient_accumulation_steps
        return expected_traffic(self.plan, blocks=-(-gas // self.block)).nbytes


def choose_block(
    gas: int, setting: int | Literal["auto"], trial: Callable[[int], BlockTrial]
) -> BlockTrial:
    """The block the note's choice takes: ``setting`` as it is (at most ``gas``), or under "auto"
    the fitting candidate that moves the fewest bytes (then needs the least); with none fitting,
    the one that needs the least (k = 1: the pre-flight check then refuses with what it needs)."""
    if setting != "auto":
        return trial(min(int(setting), gas))
    trials = [trial(k) for k in candidate_blocks(gas)]
    fitting = [t for t in trials if t.fits]
    if fitting:
        return min(fitting, key=lambda t: (t.step_nbytes(), t.need_nbytes))
    return min(trials, key=lambda t: t.need_nbytes)


def agree(block: int, group: DataParallelGroup) -> int:
    """The smallest block of the ranks (each rank may see other free memory)."""
    agreed = torch.tensor([-block], dtype=torch.int64)
    group.all_reduce_max(agreed)
    return -int(agreed)


def block_after_initialize(
    model: nn.Module,
    cfg: InfinityConfig,
    *,
    device: torch.device | str,
    group: DataParallelGroup,
    machine: MachineView | None = None,
) -> int:
    """train_batch's first call without the config's layer_major section (the note): the largest
    block whose micro-batches, beyond the one micro-batch the pre-flight check counted, fit the host
    memory available now less the safety margin (budget.py); ``block`` as the config sets it when it
    is an integer. A model whose activations are not known runs the whole window as one block, as the
    pre-flight check does not count them either."""
    gas = cfg.gradient_accumulation_steps
    setting = block_setting(cfg)
    if setting != "auto":
        return agree(min(int(setting), gas), group)
    ctx = run_context(model, cfg, device=device, world_size=group.world_size)
    a = ctx.activations
    if a is None:
        log.info(
            "engine.train_batch: the model's activations are not known (its inputs or context); "
            "its %d micro-batches run as one layer-major block",
            gas,
        )
        return agree(gas, group)
    free, source = default_budget(machine or machine_view(), ctx.ranks_per_node)
    counted = a.peak(checkpointing=ctx.checkpointing)
    fits = [
        k
        for k in candidate_blocks(gas)
        if a.block(k, checkpointing=ctx.checkpointing) - counted <= free
    ]
    block = agree(max(fits, default=1), group)
    need = a.block(block, checkpointing=ctx.checkpointing) - counted
    log.info(
        "engine.train_batch: %d micro-batches per layer-major block (%d block(s) per step), "
        "%s more host memory than one micro-batch's, within %s (set "
        "zero_optimization.layer_major.block to choose, and have initialize count it)",
        block,
        -(-gas // block),
        format_nbytes(need),
        source,
    )
    return block
