"""CPUAdam: a drop-in for torch.optim.AdamW (or Adam) on CPU fp32 parameters, run by csrc/adam.

Same results as ``torch.optim.AdamW(foreach=False)`` (within an ulp of the
update; see [Note: Adam numerics] in csrc/adam/kernel_impl.h), with param
groups that each carry their own lr, betas, eps and weight decay.

State layout is torch's, so checkpoints move both ways: per parameter
``{"step": 0-dim float32 tensor, "exp_avg": ..., "exp_avg_sq": ...}``, and
groups carry torch's Adam keys (``decoupled_weight_decay`` is ``adamw_mode``)
plus ``bias_correction``. A state dict saved by torch.optim.AdamW or Adam loads
here (and sets the mode from its ``decoupled_weight_decay``); one saved here
loads into either.

Not supported (refused with an error, also when loading a state dict):
``amsgrad=True`` and ``maximize=True``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from infinity import _adam
from infinity.optim.functional import AdamHyper, foreach_adam_step

# Keys torch.optim.Adam keeps in every group; a state dict saved here must
# carry them so that torch's Adam/AdamW can load it and step.
_TORCH_GROUP_DEFAULTS: dict[str, Any] = {
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
}
_STEP_DTYPES = (torch.float32, torch.float64)
_UNSUPPORTED = {
    "amsgrad": "use torch.optim.AdamW(amsgrad=True) for AMSGrad",
    "maximize": "negate the loss instead",
}


def _bump_versions(params: list[torch.Tensor]) -> None:
    """Tell autograd the parameters changed in place (the kernel writes through data pointers)."""
    try:
        torch.autograd.graph.increment_version(params)
    except TypeError:  # torch < 2.5 takes one tensor at a time
        for p in params:
            torch.autograd.graph.increment_version(p)


def _check_hyper(group: dict[str, Any], where: str) -> None:
    lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    if not 0.0 <= float(lr):
        raise ValueError(f"Invalid learning rate: {lr} ({where})")
    if not 0.0 <= float(eps):
        raise ValueError(f"Invalid epsilon value: {eps} ({where})")
    if not 0.0 <= float(beta1) < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {beta1} ({where})")
    if not 0.0 <= float(beta2) < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {beta2} ({where})")
    if not 0.0 <= float(wd):
        raise ValueError(f"Invalid weight_decay value: {wd} ({where})")
    for key, advice in _UNSUPPORTED.items():
        if group.get(key, False):
            raise ValueError(f"CPUAdam does not implement {key}=True ({where}); {advice}")


class CPUAdam(torch.optim.Optimizer):
    """Adam/AdamW for fp32 CPU parameters: one fused C++ pass per step over all of a group's tensors.

    Args:
        params: parameters or param groups (dicts that may set ``lr``, ``betas``,
            ``eps``, ``weight_decay``, ``bias_correction``, ``decoupled_weight_decay``).
        lr, betas, eps, weight_decay: as in torch.optim.AdamW (same defaults).
        adamw_mode: True for AdamW (decoupled weight decay), False for Adam (L2,
            weight decay added to the gradient), i.e. torch.optim.Adam.
        bias_correction: divide by ``1 - beta^step`` (True, as torch does).
        num_threads: threads for the kernel; None follows ``torch.get_num_threads()``.

    Parameters must be contiguous fp32 CPU tensors (the update is written in
    place); gradients must be dense. Steps run under ``torch.no_grad()``.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        adamw_mode: bool = True,
        bias_correction: bool = True,
        *,
        num_threads: int | None = None,
    ) -> None:
        if num_threads is not None and (
            isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1
        ):
            raise ValueError(
                f"num_threads must be a positive int or None (torch's count), got {num_threads!r}"
            )
        self.num_threads = num_threads
        defaults = {
            "lr": lr,
            "betas": (betas[0], betas[1]),
            "eps": eps,
            "weight_decay": weight_decay,
            "bias_correction": bias_correction,
            "decoupled_weight_decay": adamw_mode,
            **_TORCH_GROUP_DEFAULTS,
        }
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)  # fills the defaults; refuses duplicate params
        index = len(self.param_groups) - 1
        try:
            self._check_group(self.param_groups[index], index)
        except ValueError:
            self.param_groups.pop()  # a refused group leaves the optimizer as it was
            raise

    @staticmethod
    def _check_group(group: dict[str, Any], index: int) -> None:
        _check_hyper(group, f"param group {index}")
        for j, p in enumerate(group["params"]):
            if not (
                p.is_cpu
                and p.dtype is torch.float32
                and p.layout is torch.strided
                and p.is_contiguous()
            ):
                raise ValueError(
                    f"CPUAdam updates contiguous fp32 CPU tensors in place; param {j} of group {index} is a "
                    f"{'contiguous' if p.is_contiguous() else 'non-contiguous'} {p.dtype} tensor on {p.device}: "
                    f"keep fp32 master weights on the CPU (e.g. model.float().cpu()) and make them contiguous"
                )

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in _TORCH_GROUP_DEFAULTS.items():
                group.setdefault(key, value)
            group.setdefault("bias_correction", True)
            group.setdefault("decoupled_weight_decay", True)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict saved by CPUAdam, torch.optim.AdamW or torch.optim.Adam.

        A group without ``decoupled_weight_decay`` (older torch releases save none) or
        ``bias_correction`` (torch never does) keeps this optimizer's setting.
        """
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"the state dict has {len(saved_groups)} param groups, this optimizer {len(self.param_groups)}; "
                f"build the optimizer with the same param groups as the one that saved it"
            )
        groups = []
        for i, (saved, current) in enumerate(zip(saved_groups, self.param_groups, strict=True)):
            for key, advice in _UNSUPPORTED.items():
                if saved.get(key, False):
                    raise ValueError(
                        f"this state dict's param group {i} has {key}=True, which CPUAdam does not implement; {advice}"
                    )
            groups.append(
                {
                    "decoupled_weight_decay": current["decoupled_weight_decay"],
                    "bias_correction": current["bias_correction"],
                    **saved,
                }
            )
        super().load_state_dict({**state_dict, "param_groups": groups})
        # torch casts state to each param's dtype and device but keeps its strides.
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state and not state[key].is_contiguous():
                    state[key] = state[key].contiguous()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: dict[str, Any]) -> None:
        params, grads, exp_avgs, exp_avg_sqs, step_ptrs, step_is_double = [], [], [], [], [], []
        for p in group["params"]:
            grad = p.grad
            if grad is None:
                continue
            if grad.is_sparse:
                raise RuntimeError(
                    "CPUAdam does not support sparse gradients, please consider SparseAdam instead"
                )
            if not grad.is_contiguous():
                grad = grad.contiguous()  # read-only: a contiguous copy gives the same update
            state = self.state[p]
            if len(state) == 0:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            step = state["step"]
            if not (
                type(step) is torch.Tensor
                and step.is_cpu
                and step.dtype in _STEP_DTYPES
                and step.dim() == 0
            ):
                step = state["step"] = torch.tensor(
                    float(step), dtype=torch.float32
                )  # e.g. an int from an old checkpoint
            params.append(p)
            grads.append(grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            step_ptrs.append(step.data_ptr())
            step_is_double.append(step.dtype is torch.float64)
        if not params:
            return
        # [Note: step counts] torch keeps one 0-dim tensor per parameter; they
        # are read and bumped through their pointers (tensor ops on hundreds of
        # them cost more than a small model's whole step), after the kernel
        # succeeded. Tensors are stepped together when they are at the same
        # count: always, unless some parameter skipped steps without a gradient.
        buckets: dict[float, list[int]] = {}
        for i, done in enumerate(
            _adam.bump_step_counts(step_ptrs, is_double=step_is_double, increment=0.0)
        ):
            buckets.setdefault(done, []).append(i)
        beta1, beta2 = group["betas"]
        hyper = AdamHyper(
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            adamw=bool(group["decoupled_weight_decay"]),
            bias_correction=bool(group["bias_correction"]),
        )
        for done, idx in buckets.items():
            if len(buckets) == 1:
                ps, gs, ms, vs = params, grads, exp_avgs, exp_avg_sqs
            else:
                ps, gs, ms, vs = (
                    [seq[i] for i in idx] for seq in (params, grads, exp_avgs, exp_avg_sqs)
                )
            foreach_adam_step(ps, gs, ms, vs, hyper, step=done + 1, num_threads=self.num_threads)
        _adam.bump_step_counts(step_ptrs, is_double=step_is_double, increment=1.0)
        _bump_versions(params)
