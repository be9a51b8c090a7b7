"""DeviceTier: copies between a key's host view and the compute device.

With a CPU device there is nothing to copy: the host view is the device tier.
On CUDA, host-to-device copies run on a side stream from pinned pool memory
(non_blocking) and complete through an event the store polls like any other
request; device-to-host copies (dirty device copies at their last release)
are synchronous. Other accelerators use plain synchronous copies.

Threading: called under the store lock; CUDA work is stream ordered.
"""

from __future__ import annotations

import time

import torch


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
