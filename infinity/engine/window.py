"""UpdateWindow: the backward() calls since the last update, as the engine checks them before updating.

The gradient itself is GradReducer's ([Note: the accumulation window] in
infinity/zero/grads.py); this record keeps what the engine needs to decide
and to say what an update does: how many backward() calls completed, where
one raised, and their losses.

[Note: the training loop's call order]
``engine.backward`` / ``engine.step`` / ``engine.zero_grad`` behave as
torch's ``loss.backward()`` / ``optimizer.step(); optimizer.zero_grad()``
(the oracle the tests hold them to), whatever order they are called in:
- backward() calls before one update add up, as two ``loss.backward()`` add
  into ``.grad`` (gradient_accumulation_steps sets only the 1/N scale and
  which step() updates);
- an update with no backward() since the last one changes no parameter,
  moment or step count, as torch's AdamW skips parameters whose ``.grad`` is
  None, and a warning says so; the lr schedule advances, as
  ``optimizer.step(); scheduler.step()`` advances it;
- a backward() that raises keeps every earlier backward's contribution and
  what of its own had reached the gradient (torch's ``.grad`` keeps that too);
  the exception carries a note saying so, the engine stays usable, step()
  applies that gradient (and warns), and zero_grad() drops it instead.

[Note: non-finite steps]
fp16 skips a step whose gradients overflow (dynamic loss scaling); in fp32
and bf16 nothing would, and one inf or NaN gradient poisons every weight.
Every step whose gradient norm or loss is not finite logs a warning naming
the step, the norm and the loss; with ``"skip_nonfinite_steps": true`` (an
infinity key; DeepSpeed has none) it is skipped as an fp16 overflow is:
parameters, optimizer state and lr schedule stay, ``skipped_steps`` counts
it. A skipped step does not advance the lr schedule, in fp16 too, as in
DeepSpeed; ``global_steps`` counts it. The decision is the same on every
rank: the norm and the count of non-finite losses are all-reduced together.

Threading: the training thread.
"""

from __future__ import annotations

import dataclasses
import enum
import math

import torch

from infinity.zero.collectives import DataParallelGroup


class Outcome(enum.Enum):
    """What an update at the accumulation boundary did."""

    APPLIED = "applied"
    """The optimizer stepped."""
    NO_GRADIENT = "no gradient"
    """No parameter had a gradient: nothing to step (the lr schedule still advances, as in torch)."""
    SKIPPED = "skipped"
    """fp16 overflow, or a non-finite step under skip_nonfinite_steps: nothing moves, lr schedule included."""


@dataclasses.dataclass
class UpdateWindow:
    """The backward() calls since the last update ([Note: the training loop's call order])."""

    backwards: int = 0
    """backward() calls that completed."""
    failed_at: int | None = None
    """The micro-step of the first backward() that raised, if one did."""
    losses: list[tuple[int, torch.Tensor]] = dataclasses.field(default_factory=list)
    """(micro-step, loss) of every completed backward(), for [Note: non-finite steps]."""

    def completed(self, micro_step: int, loss: torch.Tensor) -> None:
        self.backwards += 1
        self.losses.append((micro_step, loss.detach()))

    def failed(self, micro_step: int, *, updates: int, dropped: bool) -> str:
        """Records a backward() that raised; returns the note its exception carries."""
        if self.failed_at is None:
            self.failed_at = micro_step
        own = (
            "the part of it already reduced across ranks (units still being reduced were dropped)"
            if dropped
            else "the part of it that reached parameters before the error (as torch's .grad keeps it)"
        )
        return (
            f"infinity: backward() raised at micro-step {micro_step} (after {updates} updates); the engine is "
            f"usable. The gradient since the last update keeps the {self.backwards} complete backward() call(s) "
            f"before this one and {own}. engine.step() applies that gradient; call engine.zero_grad() first "
            "to drop it."
        )

    def nonfinite_losses(self) -> list[tuple[int, float]]:
        """(micro-step, value) of this rank's losses that are inf or NaN."""
        if not self.losses:
            return []
        values = torch.stack([loss.float() for _, loss in self.losses]).cpu().tolist()
        return [
            (micro, v)
            for (micro, _), v in zip(self.losses, values, strict=True)
            if not math.isfinite(v)
        ]

    def global_norm(
        self, group: DataParallelGroup, local_sumsq: float, scale: float
    ) -> tuple[float, int]:
        """The gradient norm over every rank's ``local_sumsq`` (loss scale removed) and the number of
        non-finite losses on all ranks, in one all-reduce."""
        stats = torch.tensor(
            [local_sumsq, float(len(self.nonfinite_losses()))], dtype=torch.float64
        )
        group.all_reduce_sum(stats)
        return math.sqrt(float(stats[0])) / scale, int(stats[1])

    def nonfinite_message(self, step: int, norm: float, bad_losses: int, *, skipped: bool) -> str:
        """The warning for a step whose norm or losses are not finite ([Note: non-finite steps])."""
        mine = self.nonfinite_losses()
        if mine:
            loss = ", ".join(f"loss {v} at micro-step {m}" for m, v in mine)
        elif bad_losses:
            loss = "a non-finite loss on another rank"
        else:
            loss = "every loss finite"
        head = f"step {step}: gradient norm {norm}, {loss}: "
        if skipped:
            return (
                head
                + "step skipped (skip_nonfinite_steps): parameters, optimizer state and lr schedule unchanged"
            )
        reach = "" if math.isfinite(norm) else ", so the parameters it reaches become inf or NaN"
        return (
            head
            + f'the update applies it{reach}. Set "skip_nonfinite_steps": true in the config (an '
            "infinity key) to skip such steps, as fp16 skips overflowing ones"
        )


def no_backward_message(step: int) -> str:
    return (
        f"engine.step() at step {step}: no backward() since the last update, so there is no gradient: parameters "
        "and optimizer state are left as they are (as torch's optimizer skips parameters whose .grad is None) "
        "and the lr schedule advances; call engine.backward(loss) before engine.step()"
    )
