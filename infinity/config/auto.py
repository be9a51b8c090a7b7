"""Filling ``"auto"``: each one from an argument, a passed optimizer or model, a derived value or a default.

[Note: where an "auto" value comes from]
In order, the first that applies:
1. the keyword argument for the key: the one named like it (``lr=`` fills
   optimizer.params.lr, ``bf16=`` fills bf16.enabled; an alias of the key
   works too), or its name in HF's table (``learning_rate=``,
   ``max_grad_norm=``, ``warmup_steps=``...: [Note: the argument table] in
   arguments.py), or the argument HF's table fills it from although it is
   named after another key (``lr=`` fills scheduler.params.warmup_max_lr);
2. something derived from what was passed: optimizer.params.{lr, betas,
   eps, weight_decay} from a torch optimizer's first param group; the three
   ZeRO sizes from the hidden size (``hidden_size=``, else the model's
   config, read as HF reads it) as HF derives them: reduce_bucket_size = h*h,
   and at stage 3 stage3_prefetch_bucket_size = int(0.9*h*h) and
   stage3_param_persistence_threshold = 10*h; scheduler.params.warmup_max_lr
   from the config's optimizer lr, else the lr of the optimizer passed in,
   else each param group's own lr;
3. the batch sizes: left to the batch arithmetic (batch.py); where the
   config has train_batch_size, the micro-batch and accumulation arguments
   enter it even if their keys are absent (HF computes train_batch_size
   from them);
4. DeepSpeed's default for the key, where it has one (lr,
   total_num_steps and zero_optimization.stage have none that "auto" may
   fall back to: stage 0 would run with nothing partitioned or offloaded);
5. otherwise refused, naming the key and the argument that would fill it.
A whole section written "auto" takes its defaults, and its keys of rule 4's
exceptions become "auto" themselves (``"zero_optimization": "auto"`` needs
``stage=``).

Arguments are treated as HF's trainer treats ``TrainingArguments``, so that
one training script runs with many configs:
- a value the config writes must agree with the argument for its key (an
  error naming both otherwise: HF's ``fill_match`` mismatch);
- an argument that fills nothing in this config (its key absent, or written
  where the argument only fills "auto") is ignored; one info-level line on
  logger ``infinity.config`` lists them;
- a name that is no argument at all is a TypeError naming the closest one
  (HF's names are synonyms of infinity's, not refused: arguments.py says why);
- no ``optimizer`` section, no optimizer passed, and ``lr=`` given: the
  optimizer the HF Trainer builds for itself then. load_config writes the
  section (AdamW with lr=, betas=, eps=, weight_decay=; TrainingArguments'
  defaults (0.9, 0.999), 1e-8 and 0.0 where not given) and marks it
  ``hf_trainer_default``, and the engine exempts biases and normalisation
  weights from weight decay, as the Trainer's param groups do.
Two arguments are fallbacks the engine may always pass, never reported:
``nvme_path=`` (its default swap folder) fills nvme_path where it is "auto"
or missing under an nvme device; ``preflight=`` fills ``preflight`` where it
is "auto" or missing (an explicit, different value is a mismatch).

Where this differs from HF, on purpose: HF checks every key of its table
(a TrainingArguments always has a value for each); here only the arguments
passed are checked. HF refuses hidden-size "auto" keys for a model without a
hidden size; here they take DeepSpeed's defaults (rule 4), as infinity trains
models that are not HF's. Below stage 3 HF leaves the two stage3_* sizes
"auto" (no effect there); here they take the defaults as well. HF's table
spells keys one way (``bf16``), so it leaves DeepSpeed's aliases
(``bfloat16``) "auto"; here an alias is its key. tests/config/test_config_hf.py
holds the rest to HF's own code.
An offload ``device`` written "auto" is a value (the placement planner
decides), not a blank: it is kept as written.
"""

from __future__ import annotations

import dataclasses
import logging
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch

from infinity.config.arguments import (
    FALLBACK_ARGS,
    HIDDEN_SIZE,
    Arguments,
    arg_name,
    canonical_args,
    model_hidden_size,
    warmup_steps,
)
from infinity.config.errors import ConfigError
from infinity.config.schema import field_info, iter_sections, join, known_paths, subsection
from infinity.config.values import (
    AUTO,
    accepts_auto,
    coerce,
    describe,
    hints,
    is_internal,
    section_type,
)
from infinity.config.zero import NvmePath

logger = logging.getLogger("infinity.config")

HIDDEN_SIZE_KEYS: dict[str, Callable[[int], int]] = {
    "zero_optimization.reduce_bucket_size": lambda h: h * h,
    "zero_optimization.stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "zero_optimization.stage3_param_persistence_threshold": lambda h: 10 * h,
}
STAGE3_ONLY: frozenset[str] = frozenset(
    {
        "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.stage3_param_persistence_threshold",
    }
)
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
WARMUP_NUM_STEPS = "scheduler.params.warmup_num_steps"
# HF's table fills these keys from an argument named after another key.
ALSO_FROM: dict[str, str] = {WARMUP_MAX_LR: "lr"}
# The default optimizer's values where no argument gives them: TrainingArguments' adam_beta1,
# adam_beta2, adam_epsilon and weight_decay.
TRAINER_DEFAULTS: dict[str, Any] = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
# Defaults that depend on other keys, in words.
DEFAULT_TEXT: dict[str, str] = {
    "optimizer.params.weight_decay": "(0.0; torch's 0.01 for AdamW with torch_adam)",
    "zero_optimization.overlap_comm": "(true at stage 3, else false)",
}


def is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == AUTO


def targets(arg: str) -> list[str]:
    """The key paths a (canonical) argument fills."""
    if arg == HIDDEN_SIZE:
        return list(HIDDEN_SIZE_KEYS)
    out = [
        p
        for p, (cls, name) in known_paths().items()
        if arg_name(p) == arg and subsection(cls, name) is None and p.rsplit(".", 1)[-1] != "type"
    ]
    return out + [p for p, a in ALSO_FROM.items() if a == arg]


@dataclasses.dataclass(frozen=True)
class Resolved:
    """What ``resolve`` did besides filling the tree."""

    sources: dict[str, str]
    """Key path -> where its value came from."""
    ignored: list[str]
    """Canonical names of the arguments that filled nothing."""
    trainer_optimizer: bool
    """The optimizer section was written from lr= etc., as the HF Trainer builds its default."""


@dataclasses.dataclass
class _Resolver:
    args: Arguments
    optimizer: torch.optim.Optimizer | None
    model: Any
    tree: dict[str, Any]
    sources: dict[str, str] = dataclasses.field(default_factory=dict)
    used: set[str] = dataclasses.field(default_factory=set)
    problems: list[str] = dataclasses.field(default_factory=list)

    def given(self, path: str) -> str | None:
        """The argument passed for the key at ``path``: its own, else the one HF's table uses."""
        own = arg_name(path)
        if own in self.args.values:
            return own
        other = ALSO_FROM.get(path)
        return other if other is not None and other in self.args.values else None

    def value(self, arg: str, path: str) -> Any:
        raw = self.args.values[arg]
        if path == WARMUP_NUM_STEPS:
            return warmup_steps(raw, self.args.label(arg), self.total_num_steps())
        return raw

    def total_num_steps(self) -> int | None:
        """The training length a fractional warmup_steps is taken of: the argument, else the config's."""
        if "total_num_steps" in self.args.values:
            self.used.add("total_num_steps")
            label = f"{self.args.label('total_num_steps')} (for scheduler.params.total_num_steps)"
            return coerce(self.args.values["total_num_steps"], int, label, {"ge": 1})
        scheduler = self.tree.get("scheduler")
        params = scheduler.get("params") if isinstance(scheduler, dict) else None
        total = params.get("total_num_steps") if isinstance(params, dict) else None
        try:
            return None if total is None else coerce(total, int, "", {"ge": 1})
        except ConfigError:
            return None  # the section reports the bad value itself

    def fill(self, cls: type, node: dict[str, Any], name: str, path: str) -> None:
        tp, meta, default = field_info(cls, name)
        arg = arg_name(path)
        if path in ("fp16", "bf16") and arg in self.args.values:
            # a whole precision section written as "auto": the argument says whether it is on
            label = self.args.label(arg)
            node[name] = {
                "enabled": coerce(self.args.values[arg], bool, f"{label} (for {path})", {})
            }
            self.used.add(arg)
            self.sources[f"{path}.enabled"] = label
            return
        given = self.given(path)
        if given is not None:
            label = self.args.label(given)
            node[name] = coerce(self.value(given, path), tp, f"{label} (for {path})", meta)
            self.used.add(given)
            self.sources[path] = label
            return
        if path in FROM_OPTIMIZER and self.optimizer is not None:
            value = _optimizer_value(self.optimizer, FROM_OPTIMIZER[path])
            if value is not None:
                node[name] = coerce(
                    value, tp, f"the optimizer's {FROM_OPTIMIZER[path]} (for {path})", meta
                )
                self.sources[path] = "the optimizer passed in"
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

    def fill_hidden_size_key(self, cls: type, node: dict[str, Any], name: str, path: str) -> None:
        """One of the three ZeRO sizes: its own argument, else HF's rule from the hidden size."""
        if self.given(path) is None and (path not in STAGE3_ONLY or _stage(self.tree) == 3):
            hidden = self.hidden_size()
            if hidden is not None:
                h, where = hidden
                node[name] = HIDDEN_SIZE_KEYS[path](h)
                self.sources[path] = where
                return
        self.fill(cls, node, name, path)

    def hidden_size(self) -> tuple[int, str] | None:
        if HIDDEN_SIZE in self.args.values:
            label = self.args.label(HIDDEN_SIZE)
            h = coerce(self.args.values[HIDDEN_SIZE], int, label, {"ge": 1})
            self.used.add(HIDDEN_SIZE)
            return h, f"{label}{h}"
        return model_hidden_size(self.model) if self.model is not None else None

    def fill_warmup_max_lr(self, cls: type, node: dict[str, Any], name: str) -> None:
        if self.given(WARMUP_MAX_LR) is not None:
            self.fill(cls, node, name, WARMUP_MAX_LR)
            return
        optimizer = self.tree.get("optimizer")
        lr = optimizer.get("params", {}).get("lr") if isinstance(optimizer, dict) else None
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
        """HF's fill_match for a value the config writes: the argument for it must agree."""
        arg = self.given(path)
        if arg is None or value is None:
            return  # HF: a null is not a value to check
        tp, meta, _ = field_info(cls, name)
        self.used.add(arg)
        label = self.args.label(arg)
        given = coerce(self.value(arg, path), tp, f"{label} (for {path})", meta)
        try:
            written = coerce(value, tp, path, meta)
        except ConfigError:
            return  # the section reports the bad config value itself
        if given != written:
            raw = self.args.values[arg]
            shown = f"{raw!r}" if given == raw else f"{raw!r} (that is {given!r})"
            self.problems.append(
                f"{label}{shown} was given but the config sets {path} to {value!r}; write "
                '"auto" there to take the argument, or drop the argument'
            )

    def batch_arguments(self) -> None:
        """HF fills train_batch_size with world size x micro-batch x accumulation, its arguments:
        where the config has train_batch_size but not the key of such an argument, the argument
        enters the batch arithmetic as that key's value."""
        if "train_batch_size" not in self.tree:
            return
        for key in BATCH_KEYS[1:]:
            if key not in self.tree and key in self.args.values:
                self.tree[key] = AUTO  # filled from the argument with the other "auto"s

    def trainer_optimizer(self) -> bool:
        """No optimizer section, none passed, and lr= given: the HF Trainer's AdamW, as a section."""
        if "optimizer" in self.tree or self.optimizer is not None or "lr" not in self.args.values:
            return False
        params: dict[str, Any] = {"lr": AUTO}
        for key, default in TRAINER_DEFAULTS.items():
            if key in self.args.values:
                params[key] = AUTO
            else:
                params[key] = default
                self.sources[f"optimizer.params.{key}"] = f"TrainingArguments' default {default!r}"
        self.tree["optimizer"] = {"type": "adamw", "params": params}
        self.sources["optimizer"] = (
            "no optimizer section and none passed: AdamW as the HF Trainer builds it "
            "(no weight decay on biases and normalisation weights)"
        )
        return True


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


def resolve(
    tree: dict[str, Any],
    args: Mapping[str, Any],
    optimizer: torch.optim.Optimizer | None,
    model: Any = None,
) -> Resolved:
    """Fills every "auto" in the canonical ``tree`` in place.

    ``model``: the module being trained, for its hidden size (HF's rule).
    Raises TypeError for an argument name that is none, ConfigError for
    values that cannot be filled or disagree.
    """
    if optimizer is not None and not hasattr(optimizer, "param_groups"):
        raise ConfigError(
            f"optimizer= must be a torch.optim.Optimizer; got {type(optimizer).__name__}"
        )
    r = _Resolver(canonical_args(args), optimizer, model, tree)
    trainer_optimizer = r.trainer_optimizer()
    r.batch_arguments()
    deferred = []
    for cls, path, node in iter_sections(tree):
        for name in list(node):
            sub = subsection(cls, name, node)
            if sub is not None and isinstance(node[name], dict):
                continue
            p = join(path, name)
            if is_auto(node[name]) and not accepts_auto(field_info(cls, name)[0]):
                if p == WARMUP_MAX_LR or p in HIDDEN_SIZE_KEYS:
                    deferred.append((cls, node, name, p))  # after the stage and the lr are known
                else:
                    r.fill(cls, node, name, p)
            elif sub is None and arg_name(p) != "nvme_path":
                r.compare(cls, name, p, node[name])
    for cls, node, name, p in deferred:
        if p == WARMUP_MAX_LR:
            r.fill_warmup_max_lr(cls, node, name)
        else:
            r.fill_hidden_size_key(cls, node, name, p)
    _nvme_fallback(tree, r)
    if "preflight" in r.args.values and "preflight" not in tree:
        label = r.args.label("preflight")
        tree["preflight"] = coerce(r.args.values["preflight"], bool, label, {})
        r.sources["preflight"] = label
    if r.problems:
        raise ConfigError(
            "\n".join(r.problems)
            if len(r.problems) == 1
            else "config problems:\n  " + "\n  ".join(r.problems)
        )
    ignored = sorted(set(r.args.values) - r.used - set(FALLBACK_ARGS))
    if ignored:
        logger.info(
            "arguments with nothing to fill in this config, ignored: %s",
            "; ".join(f"{r.args.label(a)} (for {', '.join(targets(a))})" for a in ignored),
        )
    return Resolved(r.sources, ignored, trainer_optimizer)


def _stage(tree: dict[str, Any]) -> int | None:
    zero = tree.get("zero_optimization")
    stage = zero.get("stage") if isinstance(zero, dict) else None
    try:
        return None if stage is None else coerce(stage, int, "", {})
    except ConfigError:
        return None  # "auto" left unfilled or a bad value: reported elsewhere


def _nvme_fallback(tree: dict[str, Any], r: _Resolver) -> None:
    if "nvme_path" not in r.args.values:
        return
    zero = tree.get("zero_optimization")
    if not isinstance(zero, dict):
        return
    label = r.args.label("nvme_path")
    for section in ("offload_param", "offload_optimizer"):
        node = zero.get(section)
        if (
            isinstance(node, dict)
            and node.get("device") in ("nvme", AUTO)
            and node.get("nvme_path") is None
        ):
            path = f"zero_optimization.{section}.nvme_path"
            node["nvme_path"] = coerce(
                r.args.values["nvme_path"], NvmePath, f"{label} (for {path})", {}
            )
            r.sources[path] = label


def _optimizer_value(optimizer: torch.optim.Optimizer, key: str) -> Any:
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    value = group.get(key, getattr(optimizer, "defaults", {}).get(key))
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, (tuple, list)):
        return tuple(v.item() if isinstance(v, torch.Tensor) else v for v in value)
    return value
