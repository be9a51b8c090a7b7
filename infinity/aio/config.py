"""AioConfig: the DeepSpeed ``aio`` section, typed; what an AioHandle is built from.

DeepSpeed's keys map one to one: block_size, queue_depth, thread_count
(``intra_op_parallelism`` is its current name and is accepted as an alias),
single_submit, overlap_events, use_gds. ``engine`` and ``o_direct`` are ours.
The dataclass fields are the one list of these settings: validation, the
known keys (``AioConfig.KEYS``) and the DeepSpeed dict both derive from them,
and ``from_dict`` is the one place the aliases are resolved.

Threading: immutable; share freely.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar, Literal

from infinity.aio.buffers import DIRECT_ALIGNMENT

EngineName = Literal["auto", "io_uring", "threads"]
ENGINES: tuple[str, ...] = ("auto", "io_uring", "threads")

# The queue depth DeepSpeed's config defaults to is 8; 32 measured faster on
# every disk here (and is what ds_io's sweep recommends), so it is ours.
DEFAULT_QUEUE_DEPTH = 32


# Inclusive ranges. A block_size below 4 KiB cannot be O_DIRECT; above 1 GiB a
# piece gains nothing (and io_uring caps a fixed buffer there).
_LIMITS = {
    "block_size": (DIRECT_ALIGNMENT, 1 << 30),
    "queue_depth": (1, 4096),
    "thread_count": (1, 256),
}


def _as_int(key: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"aio.{key} must be an integer in [{lo}, {hi}], got {value!r}")
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"aio.{key} must be an integer in [{lo}, {hi}], got {value!r}")
    v = int(value)
    if key == "block_size" and 0 < v <= hi and v % DIRECT_ALIGNMENT:
        # Say the useful thing: a small block_size is fine as long as it is aligned.
        raise ValueError(
            f"aio.block_size must be a multiple of {DIRECT_ALIGNMENT} bytes (O_DIRECT alignment), got {v}"
        )
    if not lo <= v <= hi:
        raise ValueError(f"aio.{key} must be in [{lo}, {hi}], got {v}")
    return v


def _as_bool(key: str, value: Any) -> bool:
    # DeepSpeed's tuner writes booleans as strings ("false"); accept them.
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ValueError(f"aio.{key} must be true or false, got {value!r}")


@dataclasses.dataclass(frozen=True)
class AioConfig:
    """Settings of one AioHandle: the one list of the aio fields.

    Build one from keywords (``AioConfig(block_size=...)``, Python values) or
    from a DeepSpeed ``aio`` section (``from_dict``, which also takes
    DeepSpeed's aliases and its tuner's string booleans).
    """

    block_size: int = 1 << 20
    """Bytes per I/O request; large requests are split into pieces of this size."""
    queue_depth: int = DEFAULT_QUEUE_DEPTH
    """Pieces kept in flight per worker."""
    thread_count: int = 1
    """Workers sharing one request (DeepSpeed: intra_op_parallelism)."""
    single_submit: bool = False
    """Submit pieces one at a time instead of in batches."""
    overlap_events: bool = True
    """Refill the queue as completions arrive instead of batch by batch."""
    engine: EngineName = "auto"
    """infinity: io_uring, threads, or auto (io_uring, falling back to threads where refused)."""
    o_direct: bool = True
    """infinity: bypass the page cache (falls back to buffered I/O where the file system refuses)."""
    use_gds: bool = False
    """GPUDirect Storage (DeepSpeed key). Not supported: reads bounce through host memory."""

    ALIASES: ClassVar[Mapping[str, str]] = MappingProxyType(
        {"intra_op_parallelism": "thread_count"}
    )
    """DeepSpeed's other names for fields: alias -> field."""
    KEYS: ClassVar[tuple[str, ...]]
    """Every key an ``aio`` section may hold: the fields, each alias after its field."""

    def __post_init__(self) -> None:
        # Values are normalised here, so a JSON 4096.0 or the tuner's "false"
        # reaches the engine as 4096 or False whichever way the config was built.
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in _LIMITS:
                object.__setattr__(self, f.name, _as_int(f.name, value, *_LIMITS[f.name]))
            elif isinstance(f.default, bool):
                object.__setattr__(self, f.name, _as_bool(f.name, value))
        if self.engine not in ENGINES:
            raise ValueError(f"aio.engine must be one of {', '.join(ENGINES)}; got {self.engine!r}")

    @classmethod
    def from_dict(
        cls, section: Mapping[str, Any] | None, *, base: AioConfig | None = None
    ) -> AioConfig:
        """Parses a DeepSpeed ``aio`` section; keys it does not hold keep ``base``'s values (the defaults).

        The one place DeepSpeed's key names (``ALIASES``) map onto the fields.
        Unknown keys raise, naming them; so do an alias and its field given
        different values.
        """
        section = dict(section or {})
        unknown = sorted(set(section) - set(cls.KEYS))
        if unknown:
            raise ValueError(
                f"unknown aio key(s) {', '.join(unknown)}; known keys: {', '.join(cls.KEYS)}"
            )
        kw: dict[str, Any] = {}
        written: dict[str, str] = {}
        for key, value in section.items():
            name = cls.ALIASES.get(key, key)
            if name in kw and kw[name] != value:
                raise ValueError(
                    f"aio.{written[name]} and aio.{key} are the same setting and disagree "
                    f"({kw[name]} vs {value}); keep one"
                )
            kw[name], written[name] = value, key
        return dataclasses.replace(base or cls(), **kw)

    def to_dict(self) -> dict[str, Any]:
        """The ``aio`` section a DeepSpeed-style config would hold for these settings."""
        d = dataclasses.asdict(self)
        for alias, name in self.ALIASES.items():
            d[alias] = d.pop(name)
        return d


AioConfig.KEYS = tuple(
    key
    for f in dataclasses.fields(AioConfig)
    for key in (f.name, *(a for a, n in AioConfig.ALIASES.items() if n == f.name))
)
