"""The keyword arguments that fill "auto": their names, HF's table, and how their values are read.

[Note: the argument table]
``initialize(model, config, **kwargs)`` and ``load_config(config, **kwargs)``
take the values that transformers' ``HfTrainerDeepSpeedConfig`` takes from a
``TrainingArguments`` (transformers 5.23, ``integrations/deepspeed.py``:
``trainer_config_process`` and ``trainer_config_finalize``), each under two
names: infinity's (the leaf name of the key it fills, as before this table)
and HF's (the ``TrainingArguments`` field).

| infinity         | HF (TrainingArguments)        | fills                                          | rule  |
|------------------|-------------------------------|------------------------------------------------|-------|
| train_micro_batch_size_per_gpu | per_device_train_batch_size | train_micro_batch_size_per_gpu         | match |
| gradient_accumulation_steps | gradient_accumulation_steps | gradient_accumulation_steps             | match |
| (batch arithmetic) | (world size x the two above) | train_batch_size (1)                          | match |
| gradient_clipping | max_grad_norm                | gradient_clipping                              | match |
| lr               | learning_rate                 | optimizer.params.lr, scheduler.params.warmup_max_lr | match |
| betas            | adam_beta1 + adam_beta2       | optimizer.params.betas                         | match |
| eps              | adam_epsilon                  | optimizer.params.eps                           | match |
| weight_decay     | weight_decay                  | optimizer.params.weight_decay                  | match |
| warmup_min_lr    | (none: HF writes 0)           | scheduler.params.warmup_min_lr                 | only  |
| total_num_steps  | num_training_steps (computed by the Trainer) | scheduler.params.total_num_steps | match |
| warmup_num_steps | warmup_steps                  | scheduler.params.warmup_num_steps              | match |
| fp16             | fp16, fp16_full_eval (either) | fp16.enabled                                   | match |
| bf16             | bf16, bf16_full_eval (either) | bf16.enabled                                   | match |
| hidden_size      | (the model's config)          | zero_optimization.reduce_bucket_size = h*h; at stage 3 also stage3_prefetch_bucket_size = int(0.9*h*h), stage3_param_persistence_threshold = 10*h | only |

(1) Where the config has train_batch_size, the two arguments above enter the
batch arithmetic even where their own keys are absent, as HF computes it
from them.

"match" (HF's ``fill_match``): an "auto" takes the value, and a value the
config writes must equal it (a disagreement is an error naming both). "only"
(``fill_only``): an "auto" takes the value; a written value stands. Value
rules, HF's: warmup_steps (either name) of 1 or more is int(value) steps, a
fraction below 1 is ceil(fraction x num_training_steps), and the result is at
least 1; adam_beta1 or adam_beta2 alone pairs with TrainingArguments' default
for the other (0.9, 0.999); fp16/bf16 and their ``*_full_eval`` are or-ed.
The hidden size is ``hidden_size=``, else read from the model as HF reads it
(``model_hidden_size``). Every other config key is an argument too, under its
leaf name (``stage=``, ``sub_group_size=``, ...): infinity's, not HF's.

Why HF's names are accepted as synonyms rather than refused with a hint: the
adapters (a transformers ``Trainer`` subclass, Accelerate, Lightning) hand
``TrainingArguments`` values over as HF names them
(``training_arguments_values``), through this one table, the one HF
documents; a refusal would force a second, private translation table in every
adapter, which drifts from HF's. The cost, two names for one setting, is
bounded: both given and disagreeing is an error, as for ``bf16=`` and
``bfloat16=``. TrainingArguments fields that HF's table does not read
(``max_steps``, ``num_train_epochs``, ``warmup_ratio``) are refused with the
argument that is read; any other unknown name is a TypeError naming the
closest known one, as Python refuses an unexpected keyword argument.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Mapping
from typing import Any

from infinity.config.errors import ConfigError
from infinity.config.schema import alias_paths, known_paths, subsection
from infinity.config.values import coerce

ENABLED_ARGS: dict[str, str] = {"fp16.enabled": "fp16", "bf16.enabled": "bf16"}
_NOT_ARGUMENTS = ("type", "params", "enabled")
# HF's name -> infinity's, where HF's is another name for one value.
HF_SYNONYMS: dict[str, str] = {
    "learning_rate": "lr",
    "max_grad_norm": "gradient_clipping",
    "per_device_train_batch_size": "train_micro_batch_size_per_gpu",
    "adam_epsilon": "eps",
    "warmup_steps": "warmup_num_steps",
    "num_training_steps": "total_num_steps",
}
# The two halves of betas, and TrainingArguments' default for each.
HF_BETAS: dict[str, float] = {"adam_beta1": 0.9, "adam_beta2": 0.999}
# Or-ed into a precision flag, as HF fills fp16.enabled with ``fp16 or fp16_full_eval``.
HF_EITHER: dict[str, str] = {"fp16_full_eval": "fp16", "bf16_full_eval": "bf16"}
# The TrainingArguments fields HF's table reads (num_training_steps is the Trainer's, not a field).
TRAINING_ARGUMENTS: tuple[str, ...] = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "max_grad_norm",
    "learning_rate",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "weight_decay",
    "warmup_steps",
    "fp16",
    "bf16",
    "fp16_full_eval",
    "bf16_full_eval",
)
# TrainingArguments fields people pass that HF's table does not read: what to pass instead.
NOT_READ: dict[str, str] = {
    "max_steps": "pass num_training_steps= (the Trainer derives it from max_steps or the epochs)",
    "num_train_epochs": "pass num_training_steps= (the Trainer derives it from max_steps or the epochs)",
    "warmup_ratio": "pass warmup_steps= with a fraction below 1 (transformers 5 reads the ratio "
    "that way) and num_training_steps=",
}
HIDDEN_SIZE = "hidden_size"
# Arguments the engine may always pass: never reported as filling nothing (auto.py).
FALLBACK_ARGS: tuple[str, ...] = ("nvme_path", "preflight")


def arg_name(path: str) -> str:
    """The (infinity) keyword argument named like the key at ``path``."""
    return ENABLED_ARGS.get(path, path.rsplit(".", 1)[-1])


def argument_names() -> dict[str, str]:
    """infinity's accepted argument names (canonical or a key alias) -> canonical name."""
    names: dict[str, str] = {HIDDEN_SIZE: HIDDEN_SIZE, "nvme_path": "nvme_path", "bfloat16": "bf16"}
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


def all_names() -> list[str]:
    """Every accepted argument name: infinity's and HF's."""
    return sorted(set(argument_names()) | set(HF_SYNONYMS) | set(HF_BETAS) | set(HF_EITHER))


def training_arguments_values(
    args: Any, *, num_training_steps: int | None = None
) -> dict[str, Any]:
    """The keyword arguments HF's table reads, from a transformers ``TrainingArguments``.

    ``args``: a ``TrainingArguments`` (or any object with its field names).
    ``num_training_steps``: the Trainer's count of optimizer steps, for
    ``total_num_steps`` and a fractional ``warmup_steps``. The result passed
    to ``initialize(model, config, **values)`` fills and checks the config as
    HF's ``HfTrainerDeepSpeedConfig`` does.
    """
    out = {name: getattr(args, name) for name in TRAINING_ARGUMENTS}
    if num_training_steps is not None:
        out["num_training_steps"] = num_training_steps
    return out


@dataclasses.dataclass(frozen=True)
class Arguments:
    """The caller's keyword arguments under infinity's canonical names."""

    values: dict[str, Any]
    """Canonical name -> value (adam_beta1/adam_beta2 paired into betas, *_full_eval or-ed in)."""
    labels: dict[str, str]
    """Canonical name -> how the caller wrote it (``learning_rate``, ``adam_beta1+adam_beta2``)."""

    def label(self, arg: str) -> str:
        return f"{self.labels.get(arg, arg)}="


def canonical_args(args: Mapping[str, Any]) -> Arguments:
    """Arguments under canonical names. An unknown name is a TypeError naming the closest known
    one; two names for one setting that disagree are a ConfigError."""
    names = argument_names()
    unknown = [
        a
        for a in args
        if a not in names and a not in HF_SYNONYMS and a not in HF_BETAS and a not in HF_EITHER
    ]
    if unknown:
        raise TypeError(_unknown_message(unknown))
    values: dict[str, Any] = {}
    labels: dict[str, str] = {}

    def put(canon: str, label: str, value: Any) -> None:
        if canon in values:
            if not _same(values[canon], value):
                raise ConfigError(
                    f"{labels[canon]}= and {label}= name the same setting and disagree "
                    f"({values[canon]!r} vs {value!r}); pass one"
                )
            return
        values[canon] = value
        labels[canon] = label

    for a, value in args.items():
        if a not in HF_BETAS and a not in HF_EITHER:
            put(names[a] if a in names else HF_SYNONYMS[a], a, value)
    halves = [a for a in HF_BETAS if a in args]
    if halves:
        put("betas", "+".join(halves), tuple(args.get(a, d) for a, d in HF_BETAS.items()))
    for a, canon in HF_EITHER.items():
        if a in args:
            on = coerce(args[a], bool, f"{a}=", {})
            if canon in values:
                before = coerce(values[canon], bool, f"{labels[canon]}=", {})
                values[canon] = before or on
                labels[canon] = f"{labels[canon]}|{a}"
            else:
                values[canon], labels[canon] = on, a
    return Arguments(values, labels)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _unknown_message(unknown: list[str]) -> str:
    known = all_names()
    parts = []
    for a in sorted(unknown):
        if a in NOT_READ:
            parts.append(f"{a}= (HF's table does not read it: {NOT_READ[a]})")
            continue
        match = difflib.get_close_matches(a, known, n=1, cutoff=0.6)
        parts.append(f"{a}=" + (f" (did you mean {match[0]}=?)" if match else ""))
    return (
        f'unexpected keyword argument(s) {", ".join(parts)}: keyword arguments fill "auto" '
        "config values and are named like the key they fill (lr=, warmup_num_steps=, bf16=, ...) "
        "or as HF's TrainingArguments names them (learning_rate=, warmup_steps=, ...); the table "
        "is in infinity/config/arguments.py"
    )


def warmup_steps(value: Any, label: str, num_training_steps: int | None) -> int:
    """warmup_num_steps from a warmup_steps/warmup_num_steps argument, by HF's rule.

    TrainingArguments.get_warmup_steps: a value of 1 or more is int(value)
    steps, one below 1 a fraction of num_training_steps (rounded up); then
    trainer_config_finalize keeps it at least 1.
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ConfigError(
            f"{label}{value!r} (for scheduler.params.warmup_num_steps) must be a number of steps, "
            "or a fraction below 1 of num_training_steps"
        )
    if value >= 1:
        steps = int(value)
    elif value == 0:
        steps = 0
    elif num_training_steps is None:
        raise ConfigError(
            f"{label}{value!r} is a fraction of the training steps (HF's rule for values below 1) "
            "and no num_training_steps= was given, nor a total_num_steps in the config: pass "
            "num_training_steps=, or a whole number of warmup steps"
        )
    else:
        steps = math.ceil(num_training_steps * value)
    return max(1, steps)


def model_hidden_size(model: Any) -> tuple[int, str] | None:
    """The model's hidden size and where it was read, as transformers 5.23 reads it.

    ``trainer_config_finalize``: ``model.config.hidden_size``, else the
    largest of ``model.config.hidden_sizes``, else the same two under
    ``model.config.text_config``. Configs that name it ``d_model`` (T5, BART)
    answer to ``hidden_size`` through their ``attribute_map``; HF reads
    nothing else, nor does this. None where the model has none of them.
    """
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None)
    for owner, where in ((config, "model.config"), (text, "model.config.text_config")):
        if owner is None:
            continue
        if hasattr(owner, "hidden_size"):
            return _size(owner.hidden_size, f"{where}.hidden_size")
        if hasattr(owner, "hidden_sizes"):
            return _size(max(owner.hidden_sizes), f"max({where}.hidden_sizes)")
    return None


def _size(value: Any, where: str) -> tuple[int, str] | None:
    if value is None:
        return None
    h = coerce(value, int, where, {"ge": 1})
    return h, f"{where}={h}"
