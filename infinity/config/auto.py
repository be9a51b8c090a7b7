"""Filling ``"auto"``: each one from an argument, a passed optimizer, a derived value or a default.

[Note: where an "auto" value comes from]
In order, the first that applies:
1. the keyword argument named like the key (``lr=`` fills optimizer.params.lr,
   ``bf16=`` fills bf16.enabled, ``fp16=`` fills fp16.enabled; an alias's
   name works too);
2. something derived from what was passed: optimizer.params.{lr, betas,
   eps, weight_decay} from a torch optimizer's first param group; the three
   ZeRO sizes from ``hidden_size=`` as HF transformers derives them
   (h*h, int(0.9*h*h), 10*h); scheduler.params.warmup_max_lr from the
   optimizer's lr (HF's rule), else each param group's own lr;
3. the batch sizes: left to the batch arithmetic (batch.py);
4. DeepSpeed's default for the key, where it has one (lr,
   total_num_steps and zero_optimization.stage have none that "auto" may
   fall back to: stage 0 would run with nothing partitioned or offloaded);
5. otherwise refused, naming the key and the argument that would fill it.
A whole section written "auto" takes its defaults, and its keys of rule 4's
exceptions become "auto" themselves (``"zero_optimization": "auto"`` needs
``stage=``).

Every argument must fill something: an "auto", or agree with the value the
config writes (a disagreement is an error, as in HF's trainer). An argument
that matches nothing -- a typo, or a key this config does not have -- is an
error too. Two arguments are fallbacks the engine may always pass, never
"unused": ``nvme_path=`` (its default swap folder) fills nvme_path where it is
"auto" or missing under an nvme or "auto" device; ``preflight=`` fills ``preflight``
where it is "auto" or missing (an explicit, different value is a mismatch).
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch

from infinity.config.errors import ConfigError
from infinity.config.schema import (
    alias_paths,
    field_info,
    iter_sections,
    join,
    known_paths,
    subsection,
)
from infinity.config.values import (
    AUTO,
    accepts_auto,
    coerce,
    describe,
    hints,
    is_internal,
    section_type,
)

ENABLED_ARGS: dict[str, str] = {"fp16.enabled": "fp16", "bf16.enabled": "bf16"}
HIDDEN_SIZE_KEYS: dict[str, Callable[[int], int]] = {
    "zero_optimization.reduce_bucket_size": lambda h: h * h,
    "zero_optimization.stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "zero_optimization.stage3_param_persistence_threshold": lambda h: 10 * h,
}
FROM_OPTIMIZER: dict[str, str] = {
    "optimizer.params.lr": "lr",
    "optimizer.params.betas": "betas",
    "optimizer.params.eps": "eps",
    "optimizer.params.weight_decay": "weight_decay",
}
BATCH_KEYS: tuple[str, ...] = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
)
WARMUP_MAX_LR = "scheduler.params.warmup_max_lr"
FALLBACK_ARGS: tuple[str, ...] = ("nvme_path", "preflight")
# Defaults that depend on other keys, in words.
DEFAULT_TEXT: dict[str, str] = {
    "optimizer.params.weight_decay": "(0.0; torch's 0.01 for AdamW with torch_adam)",
    "zero_optimization.overlap_comm": "(true at stage 3, else false)",
}
_NOT_ARGUMENTS = ("type", "params", "enabled")
# HF Trainer / torch names people reach for, and the argument they mean.
FAMILIAR_NAMES: dict[str, str] = {
    "learning_rate": "lr",
    "max_grad_norm": "gradient_clipping",
    "per_device_train_batch_size": "train_micro_batch_size_per_gpu",
    "warmup_steps": "warmup_num_steps",
    "num_training_steps": "total_num_steps",
}


def is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == AUTO


def arg_name(path: str) -> str:
    """The keyword argument that fills the key at ``path``."""
    return ENABLED_ARGS.get(path, path.rsplit(".", 1)[-1])


def argument_names() -> dict[str, str]:
    """Accepted keyword-argument name (canonical or alias) -> canonical name."""
    names: dict[str, str] = {
        "hidden_size": "hidden_size",
        "nvme_path": "nvme_path",
        "bfloat16": "bf16",
    }
    for path, (cls, name) in known_paths().items():
        leaf = path.rsplit(".", 1)[-1]
        if path in ENABLED_ARGS:
            names[ENABLED_ARGS[path]] = ENABLED_ARGS[path]
        elif leaf not in _NOT_ARGUMENTS and subsection(cls, name) is None:
            names[leaf] = leaf
    for alias, canon in alias_paths().items():
        leaf, canon_leaf = alias.rsplit(".", 1)[-1], canon.rsplit(".", 1)[-1]
        if canon_leaf in names:
            names[leaf] = canon_leaf
    return names


def targets(arg: str) -> list[str]:
    """The key paths a (canonical) argument fills."""
    if arg == "hidden_size":
        return list(HIDDEN_SIZE_KEYS)
    return [
        p
        for p, (cls, name) in known_paths().items()
        if arg_name(p) == arg and subsection(cls, name) is None and p.rsplit(".", 1)[-1] != "type"
    ]


@dataclasses.dataclass
class _Resolver:
    args: dict[str, Any]
    """Canonical argument name -> value."""
    written: dict[str, str]
    """Canonical argument name -> the name the caller used."""
    optimizer: torch.optim.Optimizer | None
    sources: dict[str, str] = dataclasses.field(default_factory=dict)
    used: set[str] = dataclasses.field(default_factory=set)
    problems: list[str] = dataclasses.field(default_factory=list)

    def label(self, arg: str) -> str:
        return f"{self.written.get(arg, arg)}="

    def fill(self, cls: type, node: dict[str, Any], name: str, path: str) -> None:
        tp, meta, default = field_info(cls, name)
        arg = arg_name(path)
        if path in ("fp16", "bf16") and arg in self.args:
            # a whole precision section written as "auto": the argument says whether it is on
            node[name] = {
                "enabled": coerce(self.args[arg], bool, f"{self.label(arg)} (for {path})", {})
            }
            self.used.add(arg)
            self.sources[f"{path}.enabled"] = self.label(arg)
            return
        if path in HIDDEN_SIZE_KEYS and "hidden_size" in self.args:
            self.used.add("hidden_size")
        if arg in self.args:
            node[name] = coerce(self.args[arg], tp, f"{self.label(arg)} (for {path})", meta)
            self.used.add(arg)
            self.sources[path] = self.label(arg)
            return
        if path in FROM_OPTIMIZER and self.optimizer is not None:
            value = _optimizer_value(self.optimizer, FROM_OPTIMIZER[path])
            if value is not None:
                node[name] = coerce(
                    value, tp, f"the optimizer's {FROM_OPTIMIZER[path]} (for {path})", meta
                )
                self.sources[path] = "the optimizer passed in"
                return
        if path in HIDDEN_SIZE_KEYS and "hidden_size" in self.args:
            h = coerce(self.args["hidden_size"], int, self.label("hidden_size"), {"ge": 1})
            node[name] = HIDDEN_SIZE_KEYS[path](h)
            self.sources[path] = f"hidden_size={h}"
            return
        if path in BATCH_KEYS:
            del node[name]
            self.sources[path] = "the batch arithmetic"
            return
        sub = subsection(cls, name, node)
        if sub is not None:
            # A section written "auto" takes its defaults, except for the keys whose "auto" has
            # none to fall back to: they become "auto" themselves, filled (or refused) in turn.
            needed = keys_without_auto_default(sub)
            if needed:
                node[name] = needed
            else:
                del node[name]
            self.sources[path] = "defaults"
            return
        if default is not dataclasses.MISSING and meta.get("auto_default", True):
            del node[name]
            self.sources[path] = "default " + DEFAULT_TEXT.get(path, repr(default))
            return
        reader = " (nor an optimizer to read it from)" if path in FROM_OPTIMIZER else ""
        value = describe(tp, meta) if typing.get_origin(tp) is Literal else "a value"
        self.problems.append(
            f'{path} is "auto" and no {arg}= was given to initialize(){reader}; '
            f"pass {arg}=..., or write {value} in the config"
        )

    def fill_warmup_max_lr(
        self, cls: type, node: dict[str, Any], name: str, tree: dict[str, Any]
    ) -> None:
        if arg_name(WARMUP_MAX_LR) in self.args:
            self.fill(cls, node, name, WARMUP_MAX_LR)
            return
        lr = (
            tree.get("optimizer", {}).get("params", {}).get("lr")
            if isinstance(tree.get("optimizer"), dict)
            else None
        )
        if lr is not None and not is_auto(lr):
            node[name] = lr
            self.sources[WARMUP_MAX_LR] = "optimizer.params.lr"
        elif self.optimizer is not None:
            lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
            node[name] = lrs[0] if len(set(lrs)) == 1 else tuple(lrs)
            self.sources[WARMUP_MAX_LR] = "the optimizer passed in"
        else:
            node[name] = None
            self.sources[WARMUP_MAX_LR] = "each param group's own lr"

    def compare(self, cls: type, name: str, path: str, value: Any) -> None:
        tp, meta, _ = field_info(cls, name)
        arg = arg_name(path)
        self.used.add(arg)
        given = coerce(self.args[arg], tp, f"{self.label(arg)} (for {path})", meta)
        try:
            written = coerce(value, tp, path, meta)
        except ConfigError:
            return  # the section reports the bad config value itself
        if given != written:
            self.problems.append(
                f"{self.label(arg)}{self.args[arg]!r} was given but the config sets {path} to "
                f'{value!r}; write "auto" there to take the argument, or drop the argument'
            )


def keys_without_auto_default(cls: type) -> dict[str, Any]:
    """The keys of section ``cls`` (nested) whose "auto" may not take the default, each as "auto"."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if is_internal(f):
            continue
        sub = section_type(hints(cls)[f.name])
        if sub is not None:
            nested = keys_without_auto_default(sub)
            if nested:
                out[f.name] = nested
        elif f.default is not dataclasses.MISSING and not f.metadata.get("auto_default", True):
            out[f.name] = AUTO
    return out


def canonical_args(args: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Arguments under their canonical names; unknown names and conflicting aliases are errors."""
    names = argument_names()
    unknown = [a for a in args if a not in names]
    if unknown:
        parts = []
        for a in sorted(unknown):
            match = [FAMILIAR_NAMES[a]] if a in FAMILIAR_NAMES else []
            match = match or difflib.get_close_matches(a, sorted(names), n=1, cutoff=0.6)
            parts.append(f"{a}=" + (f" (did you mean {match[0]}=?)" if match else ""))
        raise ConfigError(
            f'unknown argument(s) {", ".join(parts)}: arguments fill "auto" config values and are '
            "named like the keys they fill (lr=, warmup_num_steps=, bf16=, ...)"
        )
    out: dict[str, Any] = {}
    written: dict[str, str] = {}
    for a, value in args.items():
        canon = names[a]
        if canon in out and out[canon] != value:
            raise ConfigError(
                f"{written[canon]}= and {a}= name the same setting and disagree "
                f"({out[canon]!r} vs {value!r}); pass one"
            )
        out[canon] = value
        written[canon] = a
    return out, written


def resolve(
    tree: dict[str, Any], args: Mapping[str, Any], optimizer: torch.optim.Optimizer | None
) -> dict[str, str]:
    """Fills every "auto" in the canonical ``tree`` in place; returns key path -> source."""
    if optimizer is not None and not hasattr(optimizer, "param_groups"):
        raise ConfigError(
            f"optimizer= must be a torch.optim.Optimizer; got {type(optimizer).__name__}"
        )
    canon, written = canonical_args(args)
    r = _Resolver(canon, written, optimizer)
    deferred = []
    for cls, path, node in iter_sections(tree):
        for name in list(node):
            sub = subsection(cls, name, node)
            if sub is not None and isinstance(node[name], dict):
                continue
            p = join(path, name)
            if is_auto(node[name]) and not accepts_auto(field_info(cls, name)[0]):
                if p == WARMUP_MAX_LR:
                    deferred.append((cls, node, name))
                else:
                    r.fill(cls, node, name, p)
            elif arg_name(p) in r.args and arg_name(p) != "nvme_path" and sub is None:
                r.compare(cls, name, p, node[name])
    for cls, node, name in deferred:
        r.fill_warmup_max_lr(cls, node, name, tree)
    _nvme_fallback(tree, r)
    if "preflight" in r.args and "preflight" not in tree:
        tree["preflight"] = coerce(r.args["preflight"], bool, r.label("preflight"), {})
        r.sources["preflight"] = r.label("preflight")
    for arg in sorted(set(r.args) - r.used - set(FALLBACK_ARGS)):
        where = ", ".join(targets(arg))
        if arg == "hidden_size":
            why = f'none of {where} is "auto" here'
        else:
            why = (
                f"{where} is not in this config"
                if "," not in where
                else f"none of {where} is in this config"
            )
        r.problems.append(
            f'{r.label(arg)} fills nothing: {why}; write "auto" there to take the value from '
            "the argument, or drop the argument"
        )
    if r.problems:
        raise ConfigError(
            "\n".join(r.problems)
            if len(r.problems) == 1
            else "config problems:\n  " + "\n  ".join(r.problems)
        )
    return r.sources


def _nvme_fallback(tree: dict[str, Any], r: _Resolver) -> None:
    if "nvme_path" not in r.args:
        return
    zero = tree.get("zero_optimization")
    if not isinstance(zero, dict):
        return
    for section in ("offload_param", "offload_optimizer"):
        node = zero.get(section)
        if (
            isinstance(node, dict)
            and node.get("device") in ("nvme", AUTO)
            and node.get("nvme_path") is None
        ):
            path = f"zero_optimization.{section}.nvme_path"
            node["nvme_path"] = coerce(
                r.args["nvme_path"], str, f"{r.label('nvme_path')} (for {path})", {}
            )
            r.sources[path] = r.label("nvme_path")


def _optimizer_value(optimizer: torch.optim.Optimizer, key: str) -> Any:
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    value = group.get(key, getattr(optimizer, "defaults", {}).get(key))
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, (tuple, list)):
        return tuple(v.item() if isinstance(v, torch.Tensor) else v for v in value)
    return value
