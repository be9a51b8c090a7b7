"""LoRA in an estimate: a model wrapped in PEFT's adapters as a user's run wraps it, and what the
sizing model holds for its frozen base and for its adapters.

``with_lora`` wraps a model (on the meta device, as ``infinity estimate --model-config`` builds it)
with ``peft.get_peft_model``: the base is then frozen exactly as the run freezes it, and the
estimate counts it as the engine does ([Note: frozen units] in runtime_plan.py: its bytes at rest,
packed when ``zero_quantized_nontrainable_weights`` quantises it, and no gradient, master or
optimizer state). ``lora_footprint`` reads those figures back from a setting's RuntimePlan, the plan
the engine allocates: nothing here is a second formula.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence

from torch import nn

from infinity.estimate.breakdown import Breakdown
from infinity.memory import format_nbytes

PEFT_MISSING = "LoRA needs peft: pip install 'infinity[lora]' (or pip install peft)"


def with_lora(model: nn.Module, rank: int, targets: Sequence[str] | None = None) -> nn.Module:
    """``model`` with LoRA adapters of rank ``rank`` (lora_alpha 2 × rank, no dropout) on the modules
    ``targets`` names (None: PEFT's default for the architecture), by ``peft.get_peft_model``.

    Raises ValueError for a rank below 1, for peft missing, and for targets the model lacks (naming
    the module names it has)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"the LoRA rank must be a whole number >= 1; got {rank!r}")
    try:
        import peft
    except ImportError:
        raise ValueError(PEFT_MISSING) from None
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        lora_dropout=0.0,
        target_modules=list(targets) if targets else None,
    )
    try:
        with warnings.catch_warnings():  # peft 0.21 reads transformers 5's deprecated attribute
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
            return peft.get_peft_model(model, config)
    except ValueError as e:
        raise ValueError(
            f"LoRA targets {', '.join(targets) if targets else '(PEFT default)'} do not fit "
            f"{type(model).__name__}: {str(e).rstrip('.')}. Its linear layers are named: "
            f"{', '.join(linear_names(model))}"
        ) from None


def linear_names(model: nn.Module) -> list[str]:
    """The last name of each linear layer in ``model``, once each: what LoRA targets can name."""
    return sorted(
        {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    )


@dataclasses.dataclass(frozen=True)
class LoraFootprint:
    """The frozen base and the adapters as a setting's RuntimePlan holds them (per rank)."""

    frozen_params: int
    frozen_at_rest: tuple[tuple[str, int], ...]
    """(home, bytes) of the frozen units' shards as they rest: "cpu" or "nvme" at stage 3 (packed
    when quantised), "module" at stages 0-2 (whole in the module)."""
    frozen_format: str
    """How the frozen base rests: its dtype, or the quantised format."""
    trainable_params: int
    optimizer_state: tuple[tuple[str, int], ...]
    """(home, bytes) of the optimizer's arrays (fp32 master, Adam m and v, gradient partitions): the
    trainable units' only."""

    @property
    def frozen_nbytes(self) -> int:
        return sum(n for _, n in self.frozen_at_rest)

    @property
    def optimizer_nbytes(self) -> int:
        return sum(n for _, n in self.optimizer_state)

    def lines(self) -> list[str]:
        def where(pairs: tuple[tuple[str, int], ...]) -> str:
            shown = [f"{format_nbytes(n)} {_HOME[h]}" for h, n in pairs if n]
            return ", ".join(shown) or "0 B"

        return [
            f"frozen base  {self.frozen_params:,} parameters, {self.frozen_format}: "
            f"{where(self.frozen_at_rest)} at rest; no gradient, master or optimizer state",
            f"adapters     {self.trainable_params:,} parameters; their optimizer state "
            f"{where(self.optimizer_state)}",
        ]


_HOME = {"cpu": "in host memory", "nvme": "on NVMe", "module": "in the module"}


def lora_footprint(breakdown: Breakdown) -> LoraFootprint:
    """The frozen base and the adapters in ``breakdown``'s RuntimePlan (what the engine allocates)."""
    rt = breakdown.runtime
    if rt is None:
        raise ValueError("the breakdown carries no RuntimePlan (it was not itemised from one)")
    units = rt.unit_map.units
    frozen = [u for u in units if not u.trainable]
    at_rest: dict[str, int] = {}
    for u in frozen:
        rests = rt.shards[u.index].param_home or "module"
        at_rest[rests] = at_rest.get(rests, 0) + rt.at_rest_nbytes(u)
    state: dict[str, int] = {}
    if rt.optimizer is not None:
        for key in rt.optimizer.state_keys:
            for where in ("cpu", "nvme"):
                state[where] = state.get(where, 0) + rt.state_nbytes(key, where)
    fmt = next((rt.format_of(u) for u in frozen if rt.format_of(u) is not None), None)
    dtype = str(rt.dtype).removeprefix("torch.")
    return LoraFootprint(
        frozen_params=sum(u.layout.numel for u in frozen),
        frozen_at_rest=tuple(sorted(at_rest.items())),
        frozen_format=(
            f"{fmt.spec.name.lower()}, groups of {fmt.spec.group_size}" if fmt else dtype
        ),
        trainable_params=sum(u.layout.numel for u in units if u.trainable),
        optimizer_state=tuple(sorted(state.items())),
    )
