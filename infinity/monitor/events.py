"""The events one StepRecord becomes: DeepSpeed's names, then this runtime's own.

DeepSpeed's engine writes ``Train/Samples/train_loss``, ``Train/Samples/lr``,
``Train/Samples/loss_scale`` (fp16 only) and, under ``wall_clock_breakdown``,
``Train/Samples/elapsed_time_ms_{forward,backward,step}``, each at x = samples
seen (``global_samples``); the same here, so dashboards built for DeepSpeed
read these files. This runtime's own figures go under ``Infinity/``, at the
same x. An event is ``(name, value, samples)``, the tuple DeepSpeed's
``Monitor.write_events`` takes. A value the step does not have (no loss: no
backward in the window; no lr: nothing trains) is left out, never written as 0.
"""

from __future__ import annotations

from collections.abc import Callable

from infinity.engine import StepRecord

Event = tuple[str, float, int]

# name -> (what it is, how it is read off a record): the table docs/monitoring.md lists.
DEEPSPEED_EVENTS: dict[str, str] = {
    "Train/Samples/train_loss": "the mean loss of the step's micro-batches on rank 0",
    "Train/Samples/lr": "the learning rate the step applied (first param group)",
    "Train/Samples/loss_scale": "the loss scale (fp16 only)",
    "Train/Samples/elapsed_time_ms_forward": "ms in forward (wall_clock_breakdown)",
    "Train/Samples/elapsed_time_ms_backward": "ms in backward (wall_clock_breakdown)",
    "Train/Samples/elapsed_time_ms_step": "ms in step (wall_clock_breakdown)",
}

_RUNTIME: dict[str, tuple[str, Callable[[StepRecord], float]]] = {
    "Infinity/step_time_s": ("wall seconds of the step", lambda r: r.step_time_s),
    "Infinity/compute_s": (
        "the step's seconds not waiting for parameters",
        lambda r: r.compute_s,
    ),
    "Infinity/fetch_stall_s": (
        "seconds the training thread waited for parameter reads (exposed I/O)",
        lambda r: r.fetch_stall_s,
    ),
    "Infinity/io_wait_s": (
        "seconds any thread was blocked on NVMe reads and writes",
        lambda r: r.io_wait_s,
    ),
    "Infinity/nvme_read_bytes": ("bytes read from NVMe", lambda r: r.read_nbytes),
    "Infinity/nvme_write_bytes": ("bytes written to NVMe", lambda r: r.write_nbytes),
    "Infinity/nvme_read_GBps": ("read bytes / step time, GB/s", lambda r: r.read_gbps),
    "Infinity/nvme_write_GBps": ("written bytes / step time, GB/s", lambda r: r.write_gbps),
    "Infinity/prefetch_hits": ("fetches read ahead in time", lambda r: r.prefetch_hits),
    "Infinity/prefetch_late": ("fetches read ahead, still in flight", lambda r: r.late_prefetches),
    "Infinity/prefetch_on_demand": ("fetches nobody read ahead", lambda r: r.on_demand),
    "Infinity/pool_in_use_bytes": ("buffer pools' bytes in use", lambda r: r.pool_in_use_nbytes),
    "Infinity/pool_occupancy": (
        "buffer pools' peak use / capacity so far",
        lambda r: r.pool_peak_nbytes / r.pool_capacity_nbytes if r.pool_capacity_nbytes else 0.0,
    ),
    "Infinity/peak_host_bytes": ("the process's peak RSS so far", lambda r: r.peak_host_nbytes),
}

RUNTIME_EVENTS: dict[str, str] = {name: doc for name, (doc, _) in _RUNTIME.items()}


def step_events(record: StepRecord, *, fp16: bool, wall_clock_breakdown: bool) -> list[Event]:
    """The record as DeepSpeed-style events ``(name, value, samples)``."""
    x = record.samples
    out: list[Event] = []
    if record.loss is not None:
        out.append(("Train/Samples/train_loss", record.loss, x))
    if record.lr is not None:
        out.append(("Train/Samples/lr", record.lr, x))
    if fp16:
        out.append(("Train/Samples/loss_scale", record.loss_scale, x))
    if wall_clock_breakdown:
        out += [
            ("Train/Samples/elapsed_time_ms_forward", record.forward_s * 1e3, x),
            ("Train/Samples/elapsed_time_ms_backward", record.backward_s * 1e3, x),
            ("Train/Samples/elapsed_time_ms_step", record.optimizer_s * 1e3, x),
        ]
    out += [(name, float(read(record)), x) for name, (_, read) in _RUNTIME.items()]
    return out


def step_metrics(record: StepRecord, *, fp16: bool = False) -> dict[str, float]:
    """The record as one ``{name: value}`` dict (the adapters' loggers take this shape); the times
    of the breakdown are always in it."""
    return {
        name: value for name, value, _ in step_events(record, fp16=fp16, wall_clock_breakdown=True)
    }
