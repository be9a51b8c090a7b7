"""Reading DeepSpeed's spelling: the raw JSON becomes a canonical tree of known keys.

The one place that knows how users write a config: aliases (``bfloat16``,
``stage3_gather_fp16_weights_on_model_save``, ``aio.intra_op_parallelism``,
the un-prefixed ``prefetch_bucket_size``...) are merged under the canonical
name (two spellings that disagree are an error), DeepSpeed's legacy forms are
translated (``"zero_optimization": true``, ``cpu_offload``,
``cpu_offload_param``), known sections this runtime does not read are set
aside verbatim, and every other key is collected as unknown, with a "did you
mean" suggestion or else the keys its section takes (the loader refuses
them, as DeepSpeed's pydantic sections do). Values are not checked here; the
sections do that.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import typing
from collections.abc import Iterator, Mapping
from typing import Any

from infinity.aio.config import AioConfig
from infinity.config.errors import ConfigError
from infinity.config.optim import (
    SCHEDULE_PARAMS,
    OptimizerConfig,
    SchedulerConfig,
    unsupported_scheduler,
)
from infinity.config.root import InfinityConfig
from infinity.config.support import OPAQUE
from infinity.config.values import AUTO, hints, is_internal, key_fields, section_type
from infinity.config.zero import ZeroConfig

# Keys DeepSpeed itself refuses, with its reason.
REFUSED: dict[str, str] = {
    "optimizer.params.max_grad_norm": (
        "optimizer.params.max_grad_norm is not supported as an optimizer parameter (DeepSpeed "
        'refuses it too): use the top-level "gradient_clipping" instead'
    ),
    **{
        f"weight_quantization.{key}": (
            f"weight_quantization.{key} (DeepSpeed's per-module quantisation after loading) is not "
            'supported: use "weight_quantization": {"quantized_initialization": {"num_bits": 4 or 8, '
            '"group_size": 64}}, which quantises every matrix parameter'
        )
        for key in ("post_init_quant", "post_init_quantization")
    },
}

# Keys other tools write that no runtime reads; the hint replaces difflib's guess.
HINTS: dict[str, str] = {
    "aio.num_threads": "aio.thread_count (DeepSpeed's ds_nvme_tune writes num_threads, "
    "which DeepSpeed's runtime never reads)",
}


def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def section_keys(cls: type) -> dict[str, str]:
    """Written key (canonical or alias) -> canonical field name, for one section class."""
    if cls is AioConfig:
        return {k: AioConfig.ALIASES.get(k, k) for k in AioConfig.KEYS}
    return {k: f.name for k, f in key_fields(cls).items()}


def field_info(cls: type, name: str) -> tuple[Any, Mapping[str, Any], Any]:
    """(annotated type, knob metadata, default or MISSING) of one field."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return hints(cls)[name], f.metadata, f.default


def subsection(cls: type, name: str, raw_section: Mapping[str, Any] | None = None) -> type | None:
    """The section class a field holds; scheduler params depend on the scheduler type."""
    if cls is AioConfig:
        return None
    if cls is SchedulerConfig and name == "params":
        t = (raw_section or {}).get("type")
        return SCHEDULE_PARAMS.get(t) if isinstance(t, str) else None
    return section_type(hints(cls)[name])


@functools.cache
def known_paths() -> dict[str, tuple[type, str]]:
    """Every canonical key path -> (section class, field name); scheduler params of every type."""
    out: dict[str, tuple[type, str]] = {}

    def visit(cls: type, path: str) -> None:
        names = (
            [f.name for f in dataclasses.fields(cls)]
            if cls is AioConfig
            else [f.name for f in dataclasses.fields(cls) if not is_internal(f)]
        )
        for name in names:
            p = join(path, name)
            if cls is SchedulerConfig and name == "params":
                out[p] = (cls, name)
                for pcls in SCHEDULE_PARAMS.values():
                    visit(pcls, p)
                continue
            out[p] = (cls, name)
            sub = subsection(cls, name)
            if sub is not None:
                visit(sub, p)

    visit(InfinityConfig, "")
    return out


def alias_paths() -> dict[str, str]:
    """Alias key path -> canonical key path."""
    out: dict[str, str] = {}
    for path, (cls, name) in known_paths().items():
        parent = path.rsplit(".", 1)[0] if "." in path else ""
        for written, canon in section_keys(cls).items():
            if canon == name and written != name:
                out[join(parent, written)] = path
    return out


@dataclasses.dataclass
class Parsed:
    """A raw config read into canonical form, with what was set aside."""

    tree: dict[str, Any]
    """Canonical nested dict of known keys (values still raw: may be "auto")."""
    user_keys: set[str] = dataclasses.field(default_factory=set)
    """Canonical key paths the user wrote."""
    opaque: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Known-but-unread sections, verbatim."""
    unknown: list[str] = dataclasses.field(default_factory=list)
    """One line per key not in the schema: its path, its value, and a suggestion or the valid keys."""


def normalize(raw: Mapping[str, Any]) -> Parsed:
    """Reads a DeepSpeed-style dict (not modified) into canonical form."""
    parsed = Parsed(tree={})
    parsed.tree = _walk(InfinityConfig, raw, "", parsed)
    return parsed


def _walk(cls: type, section: Any, path: str, parsed: Parsed) -> dict[str, Any]:
    if not isinstance(section, Mapping):
        where = path or "the config"
        raise ConfigError(f"{where} must be a JSON object {{...}}; got {section!r}")
    keys = section_keys(cls)
    out: dict[str, Any] = {}
    written_as: dict[str, str] = {}
    for key, value in section.items():
        if not isinstance(key, str):
            raise ConfigError(f"{path or 'the config'} has a non-string key {key!r}")
        full = join(path, key)
        if cls is ZeroConfig and key in ("cpu_offload", "cpu_offload_param"):
            _legacy_offload(key, value, out, written_as, path, parsed)
            continue
        if key not in keys:
            if full in OPAQUE:
                parsed.opaque[full] = copy.deepcopy(value)
                parsed.user_keys.add(full)
            elif full in REFUSED:
                raise ConfigError(REFUSED[full])
            else:
                parsed.unknown.append(_unknown(cls, key, value, path, keys))
            continue
        canon = keys[key]
        value = _read_value(cls, canon, value, join(path, canon), parsed, section)
        if canon in written_as:
            if out[canon] != value:
                raise ConfigError(
                    f"{join(path, written_as[canon])} and {full} are the same setting and "
                    f"disagree ({out[canon]!r} vs {value!r}); keep one"
                )
            continue
        written_as[canon] = key
        out[canon] = value
        parsed.user_keys.add(join(path, canon))
    if cls is OptimizerConfig and "type" not in out:
        raise ConfigError(
            'optimizer.type is missing; DeepSpeed ignores an optimizer section without one: set "type": '
            '"AdamW" (or "Adam"), or drop the section'
        )
    if cls is SchedulerConfig:
        _check_scheduler(out)
    return out


def _read_value(
    cls: type, canon: str, value: Any, path: str, parsed: Parsed, section: Mapping[str, Any]
) -> Any:
    sub = subsection(cls, canon, section)
    if cls is InfinityConfig and canon == "zero_optimization" and isinstance(value, bool):
        parsed.user_keys.add(f"{path}.stage")
        return {"stage": 1 if value else 0}  # DeepSpeed's deprecated boolean form
    if cls is SchedulerConfig and canon == "params":
        if value is None:
            return {}
        if sub is None or isinstance(value, str) and value == AUTO:
            return value  # type missing or unsupported: reported by _check_scheduler
        return _walk_schedule_params(sub, value, path, parsed)
    if sub is None or isinstance(value, str) and value == AUTO:
        return value
    if value is None:
        if section_type(hints(cls)[canon]) is not None and _optional(cls, canon):
            return None
        raise ConfigError(f"{path} must be a JSON object {{...}}; got null")
    return _walk(sub, value, path, parsed)


def _optional(cls: type, name: str) -> bool:
    return type(None) in typing.get_args(hints(cls)[name])


def _walk_schedule_params(pcls: type, value: Any, path: str, parsed: Parsed) -> dict[str, Any]:
    if isinstance(value, Mapping):
        own = set(section_keys(pcls))
        for key in value:
            others = [
                t for t, c in SCHEDULE_PARAMS.items() if c is not pcls and key in section_keys(c)
            ]
            if key not in own and others:
                mine = next(t for t, c in SCHEDULE_PARAMS.items() if c is pcls)
                raise ConfigError(
                    f"{path}.{key} is not a parameter of {mine} (it takes "
                    f"{', '.join(sorted(own))}); {', '.join(others)} take it"
                )
    return _walk(pcls, value, path, parsed)


def _check_scheduler(out: dict[str, Any]) -> None:
    if "type" not in out:
        raise ConfigError(
            "scheduler.type is missing; DeepSpeed ignores a scheduler section without one: set "
            f"one of {', '.join(SCHEDULE_PARAMS)}, or drop the section"
        )
    if out["type"] not in SCHEDULE_PARAMS:
        raise unsupported_scheduler(out["type"])


def _legacy_offload(
    key: str, value: Any, out: dict[str, Any], written_as: dict[str, str], path: str, parsed: Parsed
) -> None:
    # DeepSpeed's deprecated booleans: cpu_offload -> offload_optimizer, cpu_offload_param
    # -> offload_param, each {"device": "cpu"} when true; both together with the new key is an error.
    target = "offload_optimizer" if key == "cpu_offload" else "offload_param"
    if not isinstance(value, bool):
        raise ConfigError(f"{join(path, key)} must be true or false; got {value!r}")
    parsed.user_keys.add(join(path, key))
    if target in out:
        raise ConfigError(
            f"{join(path, key)} (deprecated) and {join(path, target)} are both set; keep {target}"
        )
    if value:
        out[target] = {"device": "cpu"}
        written_as[target] = key
        parsed.user_keys.add(join(path, f"{target}.device"))


def _unknown(cls: type, key: str, value: Any, path: str, keys: Mapping[str, str]) -> str:
    """'<path> = <value> (did you mean <key>?)', or with the keys the section takes instead."""
    shown = repr(value)
    if len(shown) > 40:
        shown = shown[:37] + "..."
    where = f"{join(path, key)} = {shown}"
    hint = suggest(key, path, keys)
    if hint is not None:
        return f"{where} (did you mean {hint}?)"
    return f"{where} ({path or 'the top level'} takes {', '.join(valid_keys(cls, path))})"


def valid_keys(cls: type, path: str) -> list[str]:
    """The canonical keys a section takes, with the DeepSpeed sections under it kept unread."""
    names = set(section_keys(cls).values())
    names |= {p[len(path) + 1 :] if path else p for p in OPAQUE if _parent(p) == path}
    return sorted(names)


def suggest(key: str, path: str, keys_here: Mapping[str, str]) -> str | None:
    """A "did you mean" for an unknown key: the same key elsewhere, else the closest name here."""
    full = join(path, key)
    if full in HINTS:
        return HINTS[full]
    elsewhere = [p for p in known_paths() if p.rsplit(".", 1)[-1] == key]
    elsewhere += [p for p in OPAQUE if p.rsplit(".", 1)[-1] == key]
    if elsewhere:
        return sorted(elsewhere, key=lambda p: (p.count("."), p))[0]
    candidates = set(keys_here)
    candidates |= {p[len(path) + 1 :] if path else p for p in OPAQUE if _parent(p) == path}
    match = difflib.get_close_matches(key, sorted(candidates), n=1, cutoff=0.6)
    return join(path, match[0]) if match else None


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def iter_sections(tree: dict[str, Any]) -> Iterator[tuple[type, str, dict[str, Any]]]:
    """(section class, path, canonical sub-dict) for every section present, parents first."""

    def visit(
        cls: type, path: str, node: dict[str, Any]
    ) -> Iterator[tuple[type, str, dict[str, Any]]]:
        yield cls, path, node
        for name in list(node):
            sub = subsection(cls, name, node)
            if sub is not None and isinstance(node.get(name), dict):
                yield from visit(sub, join(path, name), node[name])

    yield from visit(InfinityConfig, "", tree)
