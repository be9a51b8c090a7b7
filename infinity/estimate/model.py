"""ModelSpec: the model an estimate is for — a live nn.Module, a GPTConfig, or a bare parameter count.

A count alone stands for a GPT-shaped model of that size
(``GPTConfig.for_params``), built on the meta device: the unit structure (how
the engine cuts the model into fetch units, the largest unit that sizes the
pools) is then the engine's own, from infinity.zero.units, and nothing is
allocated. A live module is never modified; for one built under zero.Init,
whose parameters are empty placeholders, the shapes come from its init store
(as the engine's build_units takes them).

[Note: a model on the meta device]
A module whose parameters are all on the meta device holds no weights: it
describes the architecture (``from_config`` under ``torch.device("meta")``,
as ``infinity estimate --model-config`` builds it). Like a parameter count,
it is taken as the model the run will build under zero.Init at stage 3 —
its weights then exist only as zero.Init's shards, never whole in host
memory — unless the estimate is told otherwise (``zero_init=False``). At
stages 0-2 every weight must be materialised to train, so the model as built
(fp32) is counted there as for a count.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from infinity.models import GPT, GPTConfig
from infinity.zero import init as zero_init


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What the estimator knows of the model."""

    module: nn.Module
    """The model (on the meta device when built from a config or a count)."""
    num_params: int
    """Parameters (shared ones once)."""
    built_nbytes: int
    """Bytes of parameter data materialised in host memory now (0 for meta or zero.Init models)."""
    gpt: GPTConfig | None
    """The transformer's shape, when known: activations can then be estimated."""
    description: str
    """How the model was given, for the report."""
    live: bool = False
    """The user's own module (its forward can be traced); False for a stand-in built from a shape."""
    materialised: bool = True
    """Whether the weights exist (False for a count, a GPTConfig, or a module whose parameters are all on
    the meta device): [Note: a model on the meta device]."""

    def built_under_zero_init(self) -> bool:
        """Whether the model is (or, not materialised, is taken to be) built under zero.Init."""
        return (
            not self.materialised
            or zero_init.init_store_of(list(self.module.parameters())) is not None
        )


def _num_params(module: nn.Module) -> int:
    shapes = placeholder_shapes(module)
    return sum(
        shapes[p].numel() if p in shapes else p.numel() for p in dict.fromkeys(module.parameters())
    )


def _meta_gpt(cfg: GPTConfig) -> nn.Module:
    with torch.device("meta"):
        return GPT(cfg)


def describe_model(
    model: nn.Module | int | float | GPTConfig,
    *,
    model_config: GPTConfig | None = None,
    seq: int | None = None,
) -> ModelSpec:
    """A ModelSpec from a module, a GPTConfig, or a parameter count (``13e9``).

    ``model_config`` gives a count a shape; ``seq`` sizes the position embedding
    of a GPT-shaped stand-in (default: the config's seq_len).
    """
    if isinstance(model, nn.Module):
        placeholders = placeholder_shapes(model)
        built = sum(
            p.numel() * p.element_size()
            for p in dict.fromkeys(model.parameters())
            if p.device.type == "cpu" and p not in placeholders
        )
        gpt = model.cfg if isinstance(model, GPT) else model_config
        params = list(model.parameters())
        on_meta = bool(params) and all(p.device.type == "meta" for p in params)
        desc = f"{type(model).__name__} (module{', on the meta device' if on_meta else ''})"
        return ModelSpec(
            model, _num_params(model), built, gpt, desc, live=True, materialised=not on_meta
        )
    if isinstance(model, GPTConfig):
        cfg = model
        desc = "GPT (model config)"
    else:
        if isinstance(model, bool) or not isinstance(model, (int, float)) or not model >= 1:
            raise ValueError(
                f"the model must be an nn.Module, a GPTConfig or a parameter count >= 1; got {model!r}"
            )
        if model_config is not None:
            cfg = model_config
            desc = "GPT (model config)"
        else:
            cfg = GPTConfig.for_params(float(model), seq_len=seq or 2048)
            desc = (
                f"GPT-shaped stand-in for {_count(float(model))} parameters "
                f"(n_layer={cfg.n_layer}, d_model={cfg.d_model}, n_head={cfg.n_head}, vocab={cfg.vocab_size})"
            )
    if seq is not None and seq > cfg.seq_len:
        cfg = dataclasses.replace(cfg, seq_len=seq)
    module = _meta_gpt(cfg)
    return ModelSpec(module, _num_params(module), 0, cfg, desc, materialised=False)


def _count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def placeholder_shapes(module: nn.Module) -> dict[nn.Parameter, torch.Size]:
    """The true shapes of parameters zero.Init left as empty placeholders (its init store knows them)."""
    params = list(dict.fromkeys(module.parameters()))
    store = zero_init.init_store_of(params)
    if store is None:
        return {}
    return {p: store.shape(p) for p in params if p in store}
