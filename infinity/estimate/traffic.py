"""NVMe traffic per optimizer step: what each placement of the training state costs in bytes moved.

[Note: traffic model]
Per optimizer step, with gas = gradient_accumulation_steps, n a shard's
elements and b the training dtype's itemsize, an array at home on NVMe moves,
counting each time the runtime's schedule needs it and no cache hit
(``spill_cost``, the placement planner's objective):

  parameter shard, 16-bit (stage 3)   read by each micro-batch's forward and backward, but not
                                      by the first forward after a step, which takes the copy the
                                      step just wrote: (2·gas − 1)·b·n in; written by the step: b·n out
  parameter shard, fp32 (stage 3)     the same, and read by the step too (it is its own master):
                                      2·gas·4n in, 4n out
  master, m, v                        read and written by the step: 4n in, 4n out
  g                                   written by each micro-batch's backward, read by the next one's
                                      and by the step: gas·4n in, gas·4n out
  parameter shard of a frozen unit    read by each micro-batch's forward and backward, never
                                      written: 2·gas·b·n in (its bytes at rest: packed when
                                      quantised; [Note: frozen units] in runtime_plan.py)

The cost is additive over (unit, class), so the planner can trade them one
against another. Reads of parameter shards are lowered further by what the
parameter pool keeps at a turn of the schedule (``expected_traffic``): the
forward's last units are the backward's first, the backward's last the
step's first; each turn finds up to the pool's free capacity (its capacity
less the partitioner's working set) still resident. That saving is the same
whichever units are spilled (as long as more is spilled than the pool holds),
so it does not change which placement is cheapest.

Trained by ``engine.train_batch`` in ``blocks`` blocks of micro-batches, a
block runs every one of its micro-batches through each unit while it is
resident and reduces each gradient once ([Note: layer-major accumulation] in
infinity/engine/layer_major.py, [Note: layer-major blocks] in blocks.py):
every array moves as with gas = blocks, whatever the window's micro-batches
(one block: as with one micro-batch).
"""

from __future__ import annotations

import dataclasses

from infinity.estimate.runtime_plan import FP32_NBYTES, PARAM, RuntimePlan


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Bytes read from and written to NVMe per optimizer step."""

    read_nbytes: int = 0
    write_nbytes: int = 0

    @property
    def nbytes(self) -> int:
        return self.read_nbytes + self.write_nbytes

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(self.read_nbytes + other.read_nbytes, self.write_nbytes + other.write_nbytes)


def spill_cost(cls: str, nbytes: int, *, gas: int, own_master: bool) -> Traffic:
    """What an array of ``nbytes`` of state class ``cls`` moves per step at home on NVMe (the note).
    ``own_master``: the parameter shard is fp32 and the optimizer updates it in place."""
    if cls == PARAM:
        reads = 2 * gas if own_master else 2 * gas - 1
        return Traffic(reads * nbytes, nbytes)
    if cls == "g":
        return Traffic(gas * nbytes, gas * nbytes)
    return Traffic(nbytes, nbytes)


def frozen_param_cost(nbytes: int, *, gas: int) -> Traffic:
    """What a frozen unit's parameter shard of ``nbytes`` at rest moves per step on NVMe (the note)."""
    return Traffic(2 * gas * nbytes, 0)


def _own_master(plan: RuntimePlan) -> bool:
    return plan.optimizer is not None and "master" not in plan.optimizer.state_keys


def passes(plan: RuntimePlan, blocks: int | None) -> int:
    """How many times a step runs the model through each unit: once per micro-batch, or once per
    layer-major block (``blocks``: engine.train_batch's, see the note)."""
    return plan.gradient_accumulation_steps if blocks is None else blocks


def worst_case_traffic(plan: RuntimePlan, *, blocks: int | None = None) -> Traffic:
    """The plan's traffic with no cache hits: the sum of ``spill_cost`` over its arrays on NVMe
    (``blocks``: trained by engine.train_batch in that many blocks, see the note)."""
    gas = passes(plan, blocks)
    total = Traffic()
    own = _own_master(plan)
    trainable = {u.index for u in plan.trainable_units()}
    for sp, unit in zip(plan.shards, plan.units, strict=True):
        if sp.param_home == "nvme" and unit.index in trainable:
            total += spill_cost(PARAM, unit.layout.shard_nbytes, gas=gas, own_master=own)
        elif sp.param_home == "nvme":
            total += frozen_param_cost(plan.at_rest_nbytes(unit), gas=gas)
        for key in sp.nvme_keys():
            total += spill_cost(key, FP32_NBYTES * sp.numel, gas=gas, own_master=own)
    return total


def pool_turn_nbytes(plan: RuntimePlan) -> int:
    """Parameter bytes the pool can keep resident across a turn of the schedule: its capacity less the
    partitioner's working set on NVMe, no more than the parameter bytes on NVMe."""
    nvme = plan.state_nbytes(PARAM, "nvme")
    if plan.param_store is None or not nvme:
        return 0
    free = plan.param_store.pool.capacity_nbytes - (
        plan.schedule.pool_working_set_nbytes if plan.schedule else 0
    )
    return max(0, min(nvme, free))


def expected_traffic(plan: RuntimePlan, *, blocks: int | None = None) -> Traffic:
    """The least the plan moves per step (the note): the worst case less the parameter reads the pool
    saves at each turn — the forward-to-backward turn of every micro-batch, the backward-to-forward turn
    between micro-batches, and for fp32 shards the backward-to-step turn (``blocks``: as with that many
    micro-batches, see the note)."""
    gas = passes(plan, blocks)
    worst = worst_case_traffic(plan, blocks=blocks)
    # Each read pass over the NVMe shards follows a turn: the backward of every micro-batch (gas), the
    # forward of every micro-batch after the first (gas - 1), and for fp32 shards the step.
    turns = 2 * gas if _own_master(plan) else 2 * gas - 1
    saved = min(turns * pool_turn_nbytes(plan), worst.read_nbytes)
    return Traffic(worst.read_nbytes - saved, worst.write_nbytes)
