"""``deepspeed.ops.adam``: ``DeepSpeedCPUAdam`` and ``FusedAdam`` with DeepSpeed's signatures (and
defaults: ``weight_decay=0``), as infinity's ``CPUAdam``.

Both run the CPU Adam kernel when stepped themselves (fp32 CPU parameters, as DeepSpeedCPUAdam
needs too); handed to ``initialize``, their param groups and hyper-parameters are what the engine's
Adam runs, wherever the state rests. ``amsgrad`` is refused, as infinity's kernel has none.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from infinity.compat.deepspeed.errors import refuse
from infinity.optim import CPUAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]


def _no_amsgrad(cls: str, amsgrad: bool) -> None:
    if amsgrad:
        raise refuse(
            f"deepspeed.ops.adam.{cls}(amsgrad=True)",
            "infinity's Adam kernel has no AMSGrad",
            "pass amsgrad=False",
        )


class DeepSpeedCPUAdam(CPUAdam):
    """DeepSpeed's CPU Adam(W): ``adamw_mode=True`` decouples the weight decay (AdamW)."""

    def __init__(
        self,
        model_params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ):
        _no_amsgrad("DeepSpeedCPUAdam", amsgrad)
        if not fp32_optimizer_states:
            raise refuse(
                "deepspeed.ops.adam.DeepSpeedCPUAdam(fp32_optimizer_states=False)",
                "infinity keeps Adam's moments in fp32",
                "pass fp32_optimizer_states=True",
            )
        super().__init__(
            model_params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adamw_mode=adamw_mode,
            bias_correction=bias_correction,
        )


class FusedAdam(CPUAdam):
    """DeepSpeed's fused Adam(W): ``adam_w_mode=True`` decouples the weight decay (AdamW);
    ``set_grad_none``: ``zero_grad()`` sets gradients to None (False: to zeros)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ):
        _no_amsgrad("FusedAdam", amsgrad)
        self.set_grad_none = set_grad_none
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adamw_mode=adam_w_mode,
            bias_correction=bias_correction,
        )

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)
