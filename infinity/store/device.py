"""The device tier: how a fetch gets the view it asked for, and the copies between host and device.

A fetch is served once its key's data is in host memory (``serve``): a fetch
for tier "host" gets the host view; one for tier "device" gets the device
copy, starting it if there is none (IN_HOST/DIRTY → COPYING → ON_DEVICE, or
AT_REST → COPYING → ON_DEVICE for home "cpu"; see [Note: residency]). The
device copy is dropped at the key's last release, written back into the host
view first if a holder changed it (``device_dirty``).

With a CPU device there is nothing to copy: the host view is the device tier
(``DeviceTier.separate`` is False). On CUDA, host-to-device copies run on a
side stream from pinned pool memory (non_blocking) and complete through an
event the store polls like any other request (an "h2d" IoOp, completed by
``complete_copy_in``); device-to-host copies are synchronous. Other
accelerators use plain synchronous copies.

Threading: every function here is called with the store lock held; CUDA work
is stream ordered.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Literal

import torch

from infinity.store.futures import IoOp, Outcome, Settlement, StoreFuture
from infinity.store.record import KeyRecord, Residency

if TYPE_CHECKING:
    from infinity.store.state import StoreState

Tier = Literal["host", "device"]
"""Where a fetch makes a key resident: pool memory on the host, or the device as well."""


class _Ready:
    """An already-finished request."""

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> None:
        return None


class _EventRequest:
    """A CUDA event as a request: done() polls it, wait() synchronises (with a timeout)."""

    def __init__(self, event: torch.cuda.Event):
        self._event = event

    def done(self) -> bool:
        return self._event.query()

    def wait(self, timeout: float | None = None) -> None:
        if timeout is None:
            self._event.synchronize()
            return
        deadline = time.monotonic() + timeout
        while not self._event.query():
            if time.monotonic() >= deadline:
                raise TimeoutError(f"host-to-device copy not done after {timeout} s")
            time.sleep(50e-6)


class DeviceTier:
    """The compute device and, on CUDA, the side stream host-to-device copies run on."""

    def __init__(self, device: torch.device):
        self.device = device
        self.separate = device.type != "cpu"
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def copy_in(self, host: torch.Tensor):
        """(device tensor, request) for a copy of ``host`` to the device."""
        if self._stream is None:
            return host.to(self.device), _Ready()
        current = torch.cuda.current_stream(self.device)
        dev = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            dev.copy_(host, non_blocking=True)
        dev.record_stream(self._stream)
        event = torch.cuda.Event()
        event.record(self._stream)
        return dev, _EventRequest(event)

    def copy_out(self, dev: torch.Tensor, host: torch.Tensor) -> None:
        """Copies a (dirty) device tensor back into its host view; returns when done."""
        host.copy_(dev)


# -- serving fetches -----------------------------------------------------------


def serve(
    st: StoreState, rec: KeyRecord, fut: StoreFuture, tier: Tier, res: list[Settlement]
) -> None:
    """Resolves a fetch of a key whose data is in host memory (or starts its device copy)."""
    if tier == "host" or not st.device.separate:
        res.append((fut, rec.host, None))
    elif rec.state is Residency.ON_DEVICE:
        res.append((fut, rec.device, None))
    elif rec.state is Residency.COPYING:
        rec.waiters.append((fut, tier))
    else:
        rec.waiters.append((fut, tier))
        start_copy_in(st, rec)


def serve_waiters(st: StoreState, rec: KeyRecord, res: list[Settlement]) -> None:
    """Serves the fetches that waited for ``rec``'s transition to end."""
    waiters, rec.waiters = rec.waiters, []
    for fut, tier in waiters:
        serve(st, rec, fut, tier, res)


# -- copies --------------------------------------------------------------------


def start_copy_in(st: StoreState, rec: KeyRecord) -> None:
    rec.to_copying()
    # Copies start from a resident key or a home "cpu" key: both have a host view.
    assert rec.host is not None, f"{rec!r} has no host view to copy in"
    dev, req = st.device.copy_in(rec.host)
    rec.device = dev
    op = IoOp("h2d", req, [rec], rec.nbytes)
    st.track(op, st.h2d)
    st.reaper.add(op)


def complete_copy_in(st: StoreState, op: IoOp, ended: Outcome, res: list[Settlement]) -> None:
    """A host-to-device copy ended (under the lock): its fetches get their views, or its error;
    the copy stays only while the key is held."""
    err = ended.error
    rec = op.recs[0]
    rec.op = None
    rec.to_on_device()
    waiters, rec.waiters = rec.waiters, []
    if err is None:
        res.extend((f, rec.device if tier == "device" else rec.host, None) for f, tier in waiters)
    else:
        res.extend((f, None, err) for f, _t in waiters)
    if rec.holds == 0 or err is not None:
        drop_device(st, rec)


def drop_device(st: StoreState, rec: KeyRecord) -> None:
    """Drops the device copy (copying it back first if a holder changed it): ON_DEVICE → host."""
    if rec.device_dirty:
        # A holder changed the device copy of a key ON_DEVICE: both copies exist.
        assert rec.device is not None and rec.host is not None, rec
        st.d2h.start()
        st.device.copy_out(rec.device, rec.host)
        st.d2h.end(rec.nbytes)
    dirty = rec.dirty or (rec.device_dirty and rec.home_tensor is None)
    rec.device = None
    rec.device_dirty = False
    if rec.home_tensor is not None:
        rec.to_at_rest()
    elif dirty:
        rec.to_dirty()
    else:
        rec.to_in_host()
