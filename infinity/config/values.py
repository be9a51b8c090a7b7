"""Typed keys: how one config key is declared, coerced and checked.

A section is a frozen dataclass whose fields are declared with ``knob()``.
The field name is the DeepSpeed key as users write it; ``knob`` adds the
key's aliases, its range and whether ``"auto"`` may fall back to the default.
``check_section(self)`` in ``__post_init__`` coerces every field to its
annotated type (JSON gives ``1e9`` as a float; element counts are ints) and
raises ConfigError naming the key path, the value and what is accepted. So a
section is valid however it was made: parsed from JSON or built in code.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union

from infinity.config.errors import ConfigError

AUTO = "auto"


def knob(
    default: Any = dataclasses.MISSING,
    *,
    aliases: tuple[str, ...] = (),
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    auto_default: bool = True,
    casefold: bool = False,
    empty: bool = False,
) -> Any:
    """A config key. ``auto_default=False``: ``"auto"`` with nothing to fill it is refused.
    ``empty=True``: a string key that may be "" (DeepSpeed's "here" for a directory)."""
    meta = {
        "empty": empty,
        "aliases": aliases,
        "ge": ge,
        "gt": gt,
        "le": le,
        "lt": lt,
        "auto_default": auto_default,
        "casefold": casefold,
    }
    return dataclasses.field(default=default, metadata=meta)


def internal(
    default: Any = dataclasses.MISSING,
    *,
    default_factory: Any = dataclasses.MISSING,
    compare: bool = False,
) -> Any:
    """A field that is not a DeepSpeed key: never parsed from or written to the JSON."""
    return dataclasses.field(
        default=default,
        default_factory=default_factory,
        compare=compare,
        hash=False,
        repr=False,
        metadata={"internal": True},
    )


def is_internal(f: dataclasses.Field) -> bool:
    return bool(f.metadata.get("internal"))


_HINTS: dict[type, dict[str, Any]] = {}


def hints(cls: type) -> dict[str, Any]:
    """The resolved annotations of a section class (cached)."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def key_path(cls_or_obj: Any, key: str) -> str:
    prefix = getattr(cls_or_obj, "PATH", "")
    return f"{prefix}.{key}" if prefix else key


def _range_text(meta: Mapping[str, Any]) -> str:
    ge, gt, le, lt = meta.get("ge"), meta.get("gt"), meta.get("le"), meta.get("lt")
    lo = ge if ge is not None else gt
    hi = le if le is not None else lt
    if lo is not None and hi is not None:
        return f" in {'[' if ge is not None else '('}{_num(lo)}, {_num(hi)}{']' if le is not None else ')'}"
    if lo is not None:
        return f" {'>=' if ge is not None else '>'} {_num(lo)}"
    if hi is not None:
        return f" {'<=' if le is not None else '<'} {_num(hi)}"
    return ""


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def _in_range(v: float, meta: Mapping[str, Any]) -> bool:
    ge, gt, le, lt = meta.get("ge"), meta.get("gt"), meta.get("le"), meta.get("lt")
    return (
        (ge is None or v >= ge)
        and (gt is None or v > gt)
        and (le is None or v <= le)
        and (lt is None or v < lt)
    )


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def describe(tp: Any, meta: Mapping[str, Any]) -> str:
    """What a key accepts, in words: 'an integer >= 1', "one of 'cpu', 'nvme'"..."""
    if _is_union(tp):
        arms = [a for a in typing.get_args(tp) if a is not type(None)]
        text = " or ".join(describe(a, meta) for a in arms)
        return f"{text} or null" if type(None) in typing.get_args(tp) else text
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(c) for c in typing.get_args(tp))
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            if args[0] is str:
                return "a list of non-empty strings"
            return f"a list of numbers{_range_text(meta)} (one per param group)"
        return f"a list of {len(args)} numbers{_range_text(meta)}"
    if tp is bool:
        return "true or false"
    if tp is int:
        return f"an integer{_range_text(meta)}"
    if tp is float:
        return f"a number{_range_text(meta)}"
    if tp is str:
        return "a string" if meta.get("empty") else "a non-empty string"
    return getattr(tp, "__name__", str(tp))


def accepts_auto(tp: Any) -> bool:
    """Whether "auto" is one of the values a key of type ``tp`` takes (offload devices: the placement
    planner decides), rather than a blank for load_config() to fill."""
    if _is_union(tp):
        return any(accepts_auto(a) for a in typing.get_args(tp))
    return typing.get_origin(tp) is Literal and AUTO in typing.get_args(tp)


def coerce(value: Any, tp: Any, path: str, meta: Mapping[str, Any]) -> Any:
    """``value`` as type ``tp`` (within the range in ``meta``), or ConfigError naming ``path``."""
    if isinstance(value, str) and value == AUTO and tp is not str and not accepts_auto(tp):
        raise ConfigError(
            f'{path} is "auto"; "auto" values are filled by load_config()/initialize() '
            "from their keyword arguments, not by building a section by hand"
        )
    out = _coerce(value, tp, meta)
    if out is _BAD:
        raise ConfigError(f"{path} must be {describe(tp, meta)}; got {value!r}")
    return out


_BAD = object()


def _coerce(value: Any, tp: Any, meta: Mapping[str, Any]) -> Any:
    if _is_union(tp):
        args = typing.get_args(tp)
        if value is None:
            return None if type(None) in args else _BAD
        for arm in args:
            if arm is type(None):
                continue
            out = _coerce(value, arm, meta)
            if out is not _BAD:
                return out
        return _BAD
    origin = typing.get_origin(tp)
    if origin is Literal:
        return _choice(value, typing.get_args(tp), meta)
    if origin is tuple:
        return _tuple(value, typing.get_args(tp), meta)
    if tp is bool:
        # DeepSpeed's tuner writes booleans as strings ("false"); pydantic accepts them too.
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        return _BAD
    if tp is int:
        # Element counts arrive as 1e9 (a float) from JSON; integral floats are ints.
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return _BAD
        if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
            return _BAD
        n = int(value)
        return n if _in_range(n, meta) else _BAD
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return _BAD
        x = float(value)
        return x if math.isfinite(x) and _in_range(x, meta) else _BAD
    if tp is str:
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        return value if isinstance(value, str) and (value or meta.get("empty")) else _BAD
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return value if isinstance(value, tp) else _BAD
    raise TypeError(f"no coercion for type {tp!r}")  # a section declared with an unsupported type


def _choice(value: Any, choices: tuple[Any, ...], meta: Mapping[str, Any]) -> Any:
    if isinstance(value, str) and meta.get("casefold"):
        for c in choices:
            if isinstance(c, str) and c.lower() == value.lower():
                return c
        return _BAD
    for c in choices:
        if isinstance(c, int) and not isinstance(c, bool):
            if not isinstance(value, bool) and isinstance(value, (int, float)) and value == c:
                return c
        elif value == c and type(value) is type(c):
            return c
    return _BAD


def _tuple(value: Any, args: tuple[Any, ...], meta: Mapping[str, Any]) -> Any:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        return _BAD
    if len(args) == 2 and args[1] is Ellipsis:
        arms = [args[0]] * len(value)
        if not value:
            return _BAD
    else:
        if len(value) != len(args):
            return _BAD
        arms = list(args)
    out = []
    for v, arm in zip(value, arms, strict=True):
        c = _coerce(v, arm, meta)
        if c is _BAD:
            return _BAD
        out.append(c)
    return tuple(out)


def check_section(obj: Any) -> None:
    """Coerces every key field of a frozen section in place; raises naming the first bad key."""
    h = hints(type(obj))
    for f in dataclasses.fields(obj):
        if is_internal(f):
            continue
        value = getattr(obj, f.name)
        coerced = coerce(value, h[f.name], key_path(obj, f.name), f.metadata)
        if coerced is not value:
            object.__setattr__(obj, f.name, coerced)


def key_fields(cls: type) -> dict[str, dataclasses.Field]:
    """DeepSpeed key (and every alias) -> field, for one section class."""
    out: dict[str, dataclasses.Field] = {}
    for f in dataclasses.fields(cls):
        if is_internal(f):
            continue
        out[f.name] = f
        for a in f.metadata.get("aliases", ()):
            out[a] = f
    return out


def section_type(tp: Any) -> type | None:
    """The section dataclass a field holds (``X`` or ``X | None``), else None."""
    if _is_union(tp):
        arms = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = arms[0] if len(arms) == 1 else None
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None
