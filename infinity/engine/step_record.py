"""StepRecord: what one optimizer step did, read from the counters the runtime already keeps.

The engine fills one record per optimizer step (at the accumulation
boundary) and hands it to the listeners registered with
``Engine.add_step_listener`` (the monitors of infinity.monitor, the framework
adapters, a trace). Nothing here counts anything itself except the engine's
own wall clocks: bytes come from the stores' ``stats()``, prefetch outcomes
from the scheduler's ``stats().total``, pool occupancy from the pools', peak
host memory from ``infinity.host`` -- each record holds the difference since
the previous one ([Note: step records]).

[Note: step records]
A record is built only when someone reads it: a listener is registered,
``steps_per_print`` prints this step, or ``wall_clock_breakdown`` is on. With
none of these the engine keeps its clocks (a few ``perf_counter`` calls per
micro-step) and builds nothing, so monitors off cost nothing measurable.
The first record's differences start at the engine's first forward; a record
spans every micro-step of its window. The times are host wall clocks; with
``wall_clock_breakdown`` the engine synchronises the CUDA device at each
boundary, as DeepSpeed's timers do, so that they include the device's work.
The stage-3 optimizer step runs behind the next forward (engine/overlap.py):
its background part shows in the next record's forward time, not in
``step_s``.

Threading: built and delivered in the caller's thread, inside ``engine.step()``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One optimizer step's figures (differences since the previous record unless said)."""

    step: int
    """Optimizer steps taken, this one included (``engine.global_steps`` after it)."""
    samples: int
    """Samples seen, this step included: ``step x train_batch_size`` (DeepSpeed's x-axis)."""
    loss: float | None
    """The mean of this rank's losses passed to ``backward()`` in the step's window (None: none)."""
    lr: float | None
    """The learning rate this step applied (first param group; None when nothing trains)."""
    loss_scale: float
    """The loss scale the step's backward used (1 unless fp16)."""
    grad_norm: float | None
    """``engine.last_grad_norm``: the global gradient norm (loss scale removed) of the last step
    that computed one (None before any did)."""
    skipped: bool
    """The update was skipped (fp16 overflow, or a non-finite step under skip_nonfinite_steps)."""
    step_time_s: float
    """Wall seconds since the previous record (the first: since the engine's first forward)."""
    forward_s: float
    """Seconds inside ``engine.forward`` (every micro-batch of the window)."""
    backward_s: float
    """Seconds inside ``engine.backward``."""
    optimizer_s: float
    """Seconds inside ``engine.step`` at the boundary (the foreground part of the update)."""
    io_wait_s: float
    """Seconds callers spent blocked on the stores' reads and writes (their ``wait_s``), in any
    thread: the stage-3 update's background thread included."""
    fetch_stall_s: float
    """Seconds the training thread spent waiting for parameters (the scheduler's ``stall_s``;
    0 without a scheduler): the exposed part of the parameter reads."""
    read_nbytes: int
    """Bytes read from NVMe by the parameter and optimizer stores."""
    write_nbytes: int
    """Bytes written to NVMe by them."""
    prefetch_hits: int
    """Parameter fetches the scheduler had already read ahead (stage 3; 0 without a scheduler)."""
    late_prefetches: int
    """Fetches read ahead but still in flight when needed: the caller waited."""
    on_demand: int
    """Fetches nobody read ahead: the caller's own read."""
    pool_in_use_nbytes: int
    """Bytes in live regions of the buffer pools now (after the step)."""
    pool_peak_nbytes: int
    """The pools' peak occupancy so far (a run's high-water mark, not a difference)."""
    pool_capacity_nbytes: int
    """The pools' capacity."""
    peak_host_nbytes: int
    """The process's peak resident set so far (VmHWM; 0 where the kernel does not say)."""

    @property
    def read_gbps(self) -> float:
        """NVMe read throughput over the step, GB/s (10^9 bytes)."""
        return self.read_nbytes / self.step_time_s / 1e9 if self.step_time_s > 0 else 0.0

    @property
    def write_gbps(self) -> float:
        return self.write_nbytes / self.step_time_s / 1e9 if self.step_time_s > 0 else 0.0

    @property
    def compute_s(self) -> float:
        """The step's time the training thread did not spend waiting for parameters."""
        return max(0.0, self.step_time_s - self.fetch_stall_s)

    def as_dict(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self),
            "read_gbps": self.read_gbps,
            "write_gbps": self.write_gbps,
            "compute_s": self.compute_s,
        }


@dataclasses.dataclass(frozen=True)
class Counters:
    """The runtime's cumulative counters at one instant; two of them make a record's differences."""

    read_nbytes: int = 0
    write_nbytes: int = 0
    io_wait_s: float = 0.0
    fetch_stall_s: float = 0.0
    prefetch_hits: int = 0
    late_prefetches: int = 0
    on_demand: int = 0


class StepClock:
    """The engine's wall clocks for the open window, and the counters at the previous record."""

    def __init__(self) -> None:
        self.started: float | None = None
        self.forward_s = 0.0
        self.backward_s = 0.0
        self.optimizer_s = 0.0
        self.previous = Counters()

    def start(self) -> None:
        if self.started is None:
            self.started = time.perf_counter()

    def close_window(self, now: float, counters: Counters) -> tuple[dict[str, float], Counters]:
        """The window's times and the counters' differences; opens the next window at ``now``."""
        times = {
            "step_time_s": now - (self.started if self.started is not None else now),
            "forward_s": self.forward_s,
            "backward_s": self.backward_s,
            "optimizer_s": self.optimizer_s,
        }
        p = self.previous
        delta = Counters(
            read_nbytes=counters.read_nbytes - p.read_nbytes,
            write_nbytes=counters.write_nbytes - p.write_nbytes,
            io_wait_s=counters.io_wait_s - p.io_wait_s,
            fetch_stall_s=counters.fetch_stall_s - p.fetch_stall_s,
            prefetch_hits=counters.prefetch_hits - p.prefetch_hits,
            late_prefetches=counters.late_prefetches - p.late_prefetches,
            on_demand=counters.on_demand - p.on_demand,
        )
        self.previous = counters
        self.started = now
        self.forward_s = self.backward_s = self.optimizer_s = 0.0
        return times, delta
