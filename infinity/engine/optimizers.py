"""Which optimizer an engine runs, from the config's ``optimizer`` section or a torch optimizer.

Offloaded and partitioned training (any stage >= 1, or any offload) runs Adam
or AdamW on the CPU Adam kernel over flat shards; a user's torch.optim.Adam /
AdamW (or infinity.optim.CPUAdam) is mapped onto it with its param groups —
the very dicts, so its lr scheduler keeps working. Anything else is refused
with the reason. Stage 0 without offload also accepts any torch optimizer,
which then steps the (all-reduced) gradients of the module's own parameters.

The config's section gives one param group of every trainable parameter, as
DeepSpeed builds it; a section load_config wrote from ``lr=``
(``hf_trainer_default``: the config had none) gives the HF Trainer's two, the
decay group and one with weight decay 0 for biases and normalisation weights
(``decay_parameter_names``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
from torch import nn

from infinity.config import InfinityConfig
from infinity.optim import CPUAdam


@dataclasses.dataclass
class OptimizerChoice:
    param_groups: list[dict[str, Any]]
    defaults: dict[str, Any]
    adamw: bool
    passthrough: torch.optim.Optimizer | None = (
        None  # stage 0, no offload: the user's optimizer as is
    )


def choose_optimizer(
    cfg: InfinityConfig, model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> OptimizerChoice:
    model_params = list(dict.fromkeys(model.parameters()))
    zero = cfg.zero_optimization
    offloaded = zero.offload_optimizer.device != "none" or zero.offload_param.device != "none"
    partitioned = zero.stage >= 1 or offloaded
    if optimizer is not None:
        if cfg.optimizer is not None:
            raise ValueError(
                "an optimizer was passed to initialize() and the config has an 'optimizer' section; "
                "keep one of them"
            )
        known = {id(p) for p in model_params}
        for g in optimizer.param_groups:
            for p in g["params"]:
                if id(p) not in known:
                    raise ValueError(
                        f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not in the model"
                    )
        adamw = _adam_kind(optimizer)
        if adamw is None:
            if not partitioned and not cfg.fp16.enabled and not cfg.bf16.enabled:
                return OptimizerChoice(
                    optimizer.param_groups, optimizer.defaults, False, passthrough=optimizer
                )
            raise ValueError(
                f"{type(optimizer).__name__} cannot run partitioned or offloaded: the optimizer step runs "
                "on flat CPU shards with the CPU Adam kernel, so only torch.optim.Adam, torch.optim.AdamW "
                "and infinity.optim.CPUAdam are accepted here (or use stage 0 without offload and fp32)"
            )
        for g in optimizer.param_groups:
            for flag in ("amsgrad", "maximize", "capturable", "differentiable"):
                if g.get(flag):
                    raise ValueError(
                        f"{type(optimizer).__name__}({flag}=True) is not supported by the CPU Adam kernel"
                    )
        return OptimizerChoice(optimizer.param_groups, optimizer.defaults, adamw)
    if cfg.optimizer is None:
        raise ValueError(
            "no optimizer: pass one to initialize(optimizer=...), add an 'optimizer' section to the config, "
            "or pass lr= (and betas=, eps=, weight_decay=) for the HF Trainer's default AdamW; a model that "
            "does not train needs none (set requires_grad=False on its parameters, or for inference from "
            "NVMe call infinity.initialize at zero_optimization.stage 3)"
        )
    oc = cfg.optimizer
    p = oc.params
    if p.amsgrad:
        raise ValueError("optimizer.params.amsgrad=true is not supported by the CPU Adam kernel")
    adamw = True if oc.type == "adamw" else bool(p.adam_w_mode)
    defaults = {
        "lr": float(p.lr),
        "betas": tuple(float(b) for b in p.betas),
        "eps": float(p.eps),
        "weight_decay": float(
            p.weight_decay if p.weight_decay is not None else (0.01 if adamw else 0.0)
        ),
    }
    if not oc.hf_trainer_default:
        group = dict(defaults)
        group["params"] = [q for q in model_params if q.requires_grad]
        return OptimizerChoice([group], defaults, adamw)
    decay = set(decay_parameter_names(model))
    named = [(n, q) for n, q in model.named_parameters() if q.requires_grad]
    groups = [
        {**defaults, "params": [q for n, q in named if n in decay]},
        {**defaults, "weight_decay": 0.0, "params": [q for n, q in named if n not in decay]},
    ]
    # The Trainer keeps an empty group; dropping it changes no update.
    return OptimizerChoice([g for g in groups if g["params"]], defaults, adamw)


# transformers 5.23, Trainer.get_decay_parameter_names: parameter names (lower-cased) that get no
# weight decay, besides every parameter of an nn.LayerNorm.
NO_DECAY_PATTERNS = tuple(
    re.compile(p)
    for p in (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")
)


def decay_parameter_names(model: nn.Module) -> list[str]:
    """The names of the parameters the HF Trainer's default AdamW decays.

    transformers' ``get_parameter_names(model, [nn.LayerNorm], patterns)``:
    every parameter not inside an nn.LayerNorm whose name matches none of
    ``NO_DECAY_PATTERNS``; the patterns are tested on the name relative to
    each module on the way down, as HF does.
    """
    out: list[str] = []
    for child_name, child in model.named_children():
        if isinstance(child, nn.LayerNorm):
            continue
        for n in decay_parameter_names(child):
            full = f"{child_name}.{n}"
            if not any(p.search(full.lower()) for p in NO_DECAY_PATTERNS):
                out.append(full)
    out += [k for k in model._parameters if not any(p.search(k.lower()) for p in NO_DECAY_PATTERNS)]
    return out


def _adam_kind(optimizer: torch.optim.Optimizer) -> bool | None:
    """True for AdamW semantics, False for Adam (L2), None for anything else."""
    if isinstance(optimizer, CPUAdam):  # CPUAdam keeps adamw_mode under torch's name
        return bool(optimizer.defaults.get("decoupled_weight_decay", True))
    if type(optimizer) is torch.optim.AdamW:
        return True
    if type(optimizer) is torch.optim.Adam:
        return bool(optimizer.defaults.get("decoupled_weight_decay", False))
    return None
