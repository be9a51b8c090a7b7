"""Integrity: a CRC32C per key of home "nvme", taken when its write home ends and checked when a read ends.

On by default (``DEFAULT``): a swap file zeroed, truncated or bit-flipped
behind the store's back must stop training, not change it. The runtime's
stores take it from the config (``offload_param.integrity``,
``offload_optimizer.integrity``). With it, a completed write records the CRC32C of
the bytes it wrote (``KeyRecord.crc``); a completed read computes the CRC32C
of what it read and fails the key's fetches with IntegrityError, naming the
key, the file and the offset, when the two differ. A key never written by
this store (``crc`` None) is not checked.

Threading: ``checksums`` runs without the store lock, by the thread that
claimed the op (the op's keys are READING or WRITING, so nothing else touches
their pool bytes until it completes them); ``verify`` runs under the lock.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from infinity.aio import crc32c
from infinity.memory import format_nbytes
from infinity.store.errors import IntegrityError
from infinity.store.futures import IoOp
from infinity.store.record import KeyRecord

if TYPE_CHECKING:
    from infinity.store.state import StoreState

DEFAULT = True
"""Whether a TieredStore checksums its keys when ``integrity`` is not given."""


def checksums(
    st: StoreState, op: IoOp, err: BaseException | None, *, caller: bool
) -> list[int] | None:
    """The CRC32C of each key of a read or write that succeeded, in ``op.recs`` order; None
    when integrity is off, the op failed, or it is not a read or write. ``caller``: the thread
    is a caller waiting on the op (not the reaper), for ``stats().checksum_caller_s``."""
    if not st.integrity or err is not None or op.kind not in ("read", "write"):
        return None
    t0 = time.thread_time()  # CPU time: what the checksums cost, whatever else runs on the machine
    crcs = [crc32c(r.slot.region.bytes_at(r.slot_offset, r.nbytes)) for r in op.recs]
    dt = time.thread_time() - t0
    with st.stats_lock:
        st.checksum_nbytes += sum(r.nbytes for r in op.recs)
        st.checksum_s += dt
        if caller:
            st.checksum_caller_s += dt
    return crcs


def verify(st: StoreState, rec: KeyRecord, crc: int) -> IntegrityError | None:
    """The error for a key read back with CRC32C ``crc``, or None if it matches what was written."""
    if rec.crc is None:
        return None
    st.counts["integrity_checks"] += 1
    if crc == rec.crc:
        return None
    where = st.swap_space().describe(rec.disk_extent().offset, rec.nbytes)
    return IntegrityError(
        f"checksum mismatch for key {rec.key!r} in store '{st.name}': read "
        f"{format_nbytes(rec.nbytes)} from {where} with CRC32C {crc:#010x}, but {rec.crc:#010x} "
        "was written; the swap file was changed behind the store's back or the drive returned "
        "bad data",
        key=rec.key,
    )
