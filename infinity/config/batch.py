"""The batch-size arithmetic: train_batch_size = micro x accumulation x world size.

Any two of the three keys determine the third; one alone is completed with
accumulation 1 (train_batch_size alone: micro = train_batch_size / world
size; gradient_accumulation_steps alone: micro 1); none gives micro 1 and
accumulation 1. Unlike DeepSpeed, which floors the divisions and then fails
an assert, a size that does not divide is refused with the arithmetic shown.
All three given must agree (InfinityConfig checks that, with the arithmetic).
"""

from __future__ import annotations

from typing import Any

from infinity.config.errors import ConfigError
from infinity.config.root import InfinityConfig
from infinity.config.values import coerce, hints

T, M, A = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"


def complete_batch(tree: dict[str, Any], world_size: int) -> dict[str, str]:
    """Writes the missing batch keys into ``tree``; returns key path -> how it was computed."""
    types = hints(InfinityConfig)
    given = {
        k: coerce(tree[k], types[k], k, {"ge": 1}) for k in (T, M, A) if tree.get(k) is not None
    }
    t, m, a, w = given.get(T), given.get(M), given.get(A), world_size
    if t is not None and m is not None and a is None:
        a = _divide(t, m * w, f"{T} ({t})", f"{M} x world_size = {m} x {w}", A)
    elif t is not None and a is not None and m is None:
        m = _divide(t, a * w, f"{T} ({t})", f"{A} x world_size = {a} x {w}", M)
    elif t is not None and m is None and a is None:
        a = 1
        m = _divide(t, w, f"{T} ({t})", f"world_size ({w})", M)
    else:
        m = 1 if m is None else m
        a = 1 if a is None else a
        t = m * a * w if t is None else t
    computed = {T: t, M: m, A: a}
    sources = {}
    for k, v in computed.items():
        if k not in given:
            tree[k] = v
            sources[k] = f"batch arithmetic: {t} = {m} (micro) x {a} (accumulation) x {w} (world)"
    return sources


def _divide(total: int, by: int, total_text: str, by_text: str, result_key: str) -> int:
    if total % by:
        raise ConfigError(
            f"{total_text} is not divisible by {by_text} = {by}, so {result_key} would not be "
            "a whole number; fix one of the batch sizes"
        )
    return total // by
