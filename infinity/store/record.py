"""KeyRecord: one record per stored key, with its residency state and the transitions between states.

[Note: residency]
A key lives at rest in its *home* (an extent of the swap files for home
"nvme", its own host tensor for home "cpu") and is made resident for a while:

    AT_REST ──fetch──▶ READING ──read done──▶ IN_HOST ◀──────────┐
       ▲                  │ overwrite          │ mark_dirty       │ write done
       │                  ▼                    ▼                  │
       ├──evict─────── IN_HOST             DIRTY ──flush/evict──▶ WRITING
       └──────────────────────── write done (evicting) ───────────┘
    IN_HOST/DIRTY ──fetch(device), CUDA──▶ COPYING ──▶ ON_DEVICE ──last release──▶ IN_HOST/DIRTY

Home "cpu" keys stay AT_REST in host memory (their home is resident) and use
only COPYING / ON_DEVICE. ``holds`` counts fetches not yet released; a key
with holds cannot be evicted, written, flushed or unregistered. A resident key
with no holds is a cache entry (in the store's LRU) until the pool needs room.

Each ``to_*`` method asserts the states it may leave from and raises
StoreStateError naming the key and both states otherwise (the TrackedRecord
pattern, tracked.py); the store checks user-visible rules (holds, pending I/O)
before calling them.

Threading: records are only touched under their store's lock.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Literal

import torch

from infinity.store.errors import StoreStateError
from infinity.store.tracked import StateEnum, TrackedRecord

if TYPE_CHECKING:
    from infinity.memory import PoolRegion
    from infinity.store.futures import IoOp, StoreFuture
    from infinity.store.swapspace import Extent


class Residency(StateEnum):
    """Where a key's data is (see [Note: residency]); each member's ``__doc__`` says what it means."""

    AT_REST = (
        "at rest",
        'Only at home: an extent of the swap files (home "nvme") or its own host tensor (home "cpu"). '
        "Costs no pool memory.",
    )
    READING = (
        "reading",
        "Becoming resident in host memory: waiting for a pool region, then for the read. Fetches of it share it.",
    )
    IN_HOST = (
        "in host",
        "Resident in a pool region and equal to home; with no holds it is a clean cache entry.",
    )
    DIRTY = (
        "dirty",
        "Resident in a pool region and newer than home; written back before its memory is reused.",
    )
    WRITING = (
        "writing",
        "Its pool region is being written home (write, flush or write-back); the region is kept until the write ends.",
    )
    COPYING = ("copying", "A host-to-device copy is in flight (CUDA devices only).")
    ON_DEVICE = (
        "on device",
        "Also resident on the compute device (CUDA only; with a CPU device the host view is the device tier).",
    )


RESIDENT = (Residency.IN_HOST, Residency.DIRTY)
IN_IO = (Residency.READING, Residency.WRITING, Residency.COPYING)


@dataclasses.dataclass(frozen=True)
class KeySpec:
    """What ``TieredStore.spec(key)`` reports: the key's layout and its state now."""

    key: Any
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    home: str
    state: Residency
    holds: int
    dirty: bool


class Slot:
    """A pool region shared by the keys resident in it (one fetch_many packs several keys into one)."""

    __slots__ = ("region", "members")

    def __init__(self, region: PoolRegion):
        self.region = region
        self.members = 0  # records whose host view lies in this region


def key_label(recs: list[KeyRecord]) -> str:
    """How messages name a group of keys: the key, or how many and the first and last."""
    if len(recs) == 1:
        return f"key {recs[0].key!r}"
    return f"{len(recs)} keys {recs[0].key!r} … {recs[-1].key!r}"


class KeyRecord(TrackedRecord):
    """Everything the store knows about one key (see [Note: residency])."""

    transition_error = StoreStateError
    state: Residency  # narrows TrackedRecord.state: only Residency moves reach it

    __slots__ = (
        "shape",
        "dtype",
        "nbytes",
        "home",
        "holds",
        "dirty",
        "written",
        "extent",
        "home_tensor",
        "slot",
        "slot_offset",
        "host",
        "device",
        "device_dirty",
        "waiters",
        "pending_dirty",
        "evict_after_write",
        "write_future",
        "op",
        "crc",
        "error",
    )

    def __init__(
        self, key: Any, shape: tuple[int, ...], dtype: torch.dtype, nbytes: int, home: str
    ):
        super().__init__(key, Residency.AT_REST)
        self.shape = shape
        self.dtype = dtype
        self.nbytes = nbytes
        self.home = home
        self.holds = 0
        self.dirty = False  # the resident copy is newer than home
        self.written = (
            False  # home (or the resident copy) holds data: it was written or overwritten
        )
        self.extent: Extent | None = None  # home "nvme": where it lives in the swap space
        self.home_tensor: torch.Tensor | None = None  # home "cpu": its own host tensor
        self.slot: Slot | None = None  # the pool region it is resident in
        self.slot_offset = 0
        self.host: torch.Tensor | None = None  # typed view of the resident host copy
        self.device: torch.Tensor | None = None  # device copy (CUDA)
        self.device_dirty = False
        # (future, "host" | "device") of fetches resolved when the current transition ends
        self.waiters: list[tuple[StoreFuture, Literal["host", "device"]]] = []
        self.pending_dirty = False  # a fetch(overwrite=True) waits: become DIRTY when resident
        self.evict_after_write = False
        self.write_future: StoreFuture | None = None  # the future of the write in flight (WRITING)
        self.op: IoOp | None = None  # the I/O op in flight for this key
        self.crc: int | None = None  # CRC32C of the data at home (integrity mode)
        self.error: BaseException | None = None  # a failed write-back, raised by flush/close

    # -- queries -------------------------------------------------------------

    @property
    def idle(self) -> bool:
        """A cache entry: resident in host memory, not held, no I/O, no unreported error."""
        return (
            self.holds == 0
            and self.state in RESIDENT
            and self.error is None
            and self.home == "nvme"
        )

    def name(self) -> str:
        return repr(self.key)

    def write_in_flight(self) -> StoreFuture:
        """``write_future``, for a WRITING key: every move to WRITING sets it (write_path.py)."""
        assert self.write_future is not None, f"{self!r} has no write in flight"
        return self.write_future

    def disk_extent(self) -> Extent:
        """``extent``, for a key that rests in the swap files: register gives every key with
        home "nvme" and nbytes > 0 one, and only those keys are read, written or packed in slots."""
        assert self.extent is not None, f"key {self.key!r} (home {self.home!r}) has no swap extent"
        return self.extent

    def spec(self) -> KeySpec:
        return KeySpec(
            self.key,
            self.shape,
            self.dtype,
            self.nbytes,
            self.home,
            self.state,
            self.holds,
            self.dirty,
        )

    # -- transitions ---------------------------------------------------------

    def to_reading(self) -> None:
        self._move(Residency.READING, (Residency.AT_REST,))

    def to_in_host(self) -> None:
        self._move(Residency.IN_HOST, (Residency.READING, Residency.WRITING, Residency.ON_DEVICE))
        self.dirty = False

    def to_dirty(self) -> None:
        self._move(
            Residency.DIRTY,
            (
                Residency.READING,
                Residency.IN_HOST,
                Residency.DIRTY,
                Residency.WRITING,
                Residency.ON_DEVICE,
            ),
        )
        self.dirty = True
        self.written = True

    def to_writing(self) -> None:
        self._move(Residency.WRITING, (Residency.AT_REST, Residency.IN_HOST, Residency.DIRTY))

    def to_at_rest(self, *, discard: bool = False) -> None:
        """Back to home only. ``discard``: also from DIRTY, dropping the newer data (unregister)."""
        allowed: tuple[Residency, ...] = (Residency.READING, Residency.IN_HOST, Residency.WRITING)
        if discard:
            allowed += (Residency.DIRTY,)
        if self.home == "cpu":
            allowed = (Residency.AT_REST, Residency.COPYING, Residency.ON_DEVICE)
        self._move(Residency.AT_REST, allowed)
        self.dirty = False

    def to_copying(self) -> None:
        allowed = (Residency.AT_REST,) if self.home == "cpu" else RESIDENT
        self._move(Residency.COPYING, allowed)

    def to_on_device(self) -> None:
        self._move(Residency.ON_DEVICE, (Residency.COPYING,))

    def __repr__(self) -> str:
        return f"<KeyRecord {self.key!r} {self.state.value} holds={self.holds}{' dirty' if self.dirty else ''}>"
