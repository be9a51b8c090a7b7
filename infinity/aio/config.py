"""AioConfig: the DeepSpeed ``aio`` section, typed.

DeepSpeed's keys map one to one: block_size, queue_depth, thread_count
(``intra_op_parallelism`` is its current name and is accepted as an alias),
single_submit, overlap_events, use_gds. ``engine`` and ``o_direct`` are ours.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

EngineName = Literal["auto", "io_uring", "threads"]
ENGINES: tuple[str, ...] = ("auto", "io_uring", "threads")

# The queue depth DeepSpeed's config defaults to is 8; 32 measured faster on
# every disk here (and is what ds_io's sweep recommends), so it is ours.
DEFAULT_QUEUE_DEPTH = 32


# Inclusive ranges. A block_size below 4 KiB cannot be O_DIRECT; above 1 GiB a
# piece gains nothing (and io_uring caps a fixed buffer there).
_LIMITS = {"block_size": (4096, 1 << 30), "queue_depth": (1, 4096), "thread_count": (1, 256)}


def _as_int(key: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"aio.{key} must be an integer in [{lo}, {hi}], got {value!r}")
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"aio.{key} must be an integer in [{lo}, {hi}], got {value!r}")
    v = int(value)
    if key == "block_size" and 0 < v <= hi and v % 4096:
        # Say the useful thing: a small block_size is fine as long as it is aligned.
        raise ValueError(
            f"aio.block_size must be a multiple of 4096 bytes (O_DIRECT alignment), got {v}"
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
    """Settings of one AioHandle."""

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
    """io_uring, threads, or auto (io_uring, falling back to threads where refused)."""
    o_direct: bool = True
    """Bypass the page cache (falls back to buffered I/O where the file system refuses)."""
    use_gds: bool = False
    """GPUDirect Storage (DeepSpeed key). Not supported: reads bounce through host memory."""

    def __post_init__(self) -> None:
        _as_int("block_size", self.block_size, *_LIMITS["block_size"])
        _as_int("queue_depth", self.queue_depth, *_LIMITS["queue_depth"])
        _as_int("thread_count", self.thread_count, *_LIMITS["thread_count"])
        if self.engine not in ENGINES:
            raise ValueError(f"aio.engine must be one of {', '.join(ENGINES)}; got {self.engine!r}")

    KEYS = (
        "block_size",
        "queue_depth",
        "thread_count",
        "intra_op_parallelism",
        "single_submit",
        "overlap_events",
        "engine",
        "o_direct",
        "use_gds",
    )

    @classmethod
    def from_dict(cls, section: Mapping[str, Any] | None) -> AioConfig:
        """Parses a DeepSpeed ``aio`` section. Unknown keys raise, naming them."""
        section = dict(section or {})
        unknown = sorted(set(section) - set(cls.KEYS))
        if unknown:
            raise ValueError(
                f"unknown aio key(s) {', '.join(unknown)}; known keys: {', '.join(cls.KEYS)}"
            )
        if "intra_op_parallelism" in section and "thread_count" in section:
            a, b = section["intra_op_parallelism"], section["thread_count"]
            if a != b:
                raise ValueError(
                    f"aio.intra_op_parallelism ({a}) and aio.thread_count ({b}) are the same "
                    "setting and disagree; keep one"
                )
        kw: dict[str, Any] = {}
        for key in ("block_size", "queue_depth"):
            if key in section:
                kw[key] = _as_int(key, section[key], *_LIMITS[key])
        tc = section.get("intra_op_parallelism", section.get("thread_count"))
        if tc is not None:
            kw["thread_count"] = _as_int("thread_count", tc, *_LIMITS["thread_count"])
        for key in ("single_submit", "overlap_events", "o_direct", "use_gds"):
            if key in section:
                kw[key] = _as_bool(key, section[key])
        if "engine" in section:
            kw["engine"] = section["engine"]
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        """The ``aio`` section a DeepSpeed-style config would hold for these settings."""
        d = dataclasses.asdict(self)
        d["intra_op_parallelism"] = d.pop("thread_count")
        return d
