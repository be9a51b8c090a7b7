"""The optimizer step overlapped with the next forward.

After backward, the gradient norm is known and the step can start; it runs in
a background thread, unit by unit in forward order (each unit's state read
from NVMe, updated, written back), while the engine returns to the caller.
The next forward fetches a unit only once that unit's update is in place:
``GatedShardSource`` waits on the step's ``StepProgress`` before handing out
a shard. So the step's I/O — two thirds of a step's bytes with the optimizer
on NVMe — hides behind forward compute instead of adding to it.

Everything else that touches training state (backward, the next step,
checkpoints, close, a change made under GatheredParameters) first waits for the
whole step: ``synchronize()``.

[Note: why StepProgress is its own object]
Two parties watch the step and are built around it: the prefetch scheduler
asks whether a unit may be read (``is_done``) and must hear when one becomes
readable (``poke``), and the OverlappedStep tells it. The scheduler is built
with ``ready=progress.is_done``, then the OverlappedStep with
``on_unit_done=scheduler.poke``: each gets its callbacks at construction and
nothing is rewired afterwards.

Threading: one step thread at a time; ``wait_unit``/``synchronize`` from any
thread. An exception in the step thread is re-raised by the next wait.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable

import torch

from infinity.aio.waits import wait_until
from infinity.zero.masters import MasterCopy
from infinity.zero.partitioner import ShardSource

log = logging.getLogger("infinity.engine")


class StepProgress:
    """Which units the step in flight has updated, or the error that stopped it."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._done: set[int] = set()
        self._running = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._running

    def begin(self, thread: threading.Thread) -> None:
        """A step is about to run in ``thread`` (named in long waits; its death ends them)."""
        with self._cv:
            self._done.clear()
            self._running = True
            self._thread = thread

    def unit_done(self, index: int) -> None:
        with self._cv:
            self._done.add(index)
            self._cv.notify_all()

    def finish(self, error: BaseException | None) -> None:
        with self._cv:
            if error is not None:
                self._error = error
            self._running = False
            self._cv.notify_all()

    def is_done(self, index: int) -> bool:
        """Whether unit ``index`` may be read: no step in flight, or its update is in place."""
        with self._cv:
            return not self._running or index in self._done

    def wait_unit(self, index: int) -> None:
        self._wait(
            lambda: not self._running or index in self._done,
            f"the optimizer step to update unit {index}",
        )
        with self._cv:
            self._raise()

    def wait_all(self) -> None:
        self._wait(
            lambda: not self._running, "the optimizer step running in the background to finish"
        )
        with self._cv:
            self._raise()

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        """Waits until ``ready()``, logging every few seconds and raising if the step's thread died
        ([Note: no silent waits] in infinity/aio/waits.py)."""

        def wait(slice_s: float) -> bool:
            with self._cv:
                return self._cv.wait_for(ready, slice_s)

        wait_until(
            wait,
            what=lambda: f"{what} ({len(self._done)} unit(s) updated so far)",
            holder=self._thread_name,
            cause=self._died,
            log=log,
            kind="optimizer",
        )

    def _thread_name(self) -> str:
        t = self._thread
        return f"thread {t.name}" if t is not None else ""

    def _died(self) -> RuntimeError | None:
        t = self._thread
        with self._cv:
            running = self._running
        if running and t is not None and not t.is_alive():
            return RuntimeError(
                f"the optimizer step's thread {t.name} ended without finishing the step; the "
                "weights are partly updated: reload the last checkpoint"
            )
        return None

    def _raise(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(
                f"the optimizer step failed in its background thread: {err}"
            ) from err


class OverlappedStep:
    """Runs the optimizer step in a thread; ``on_unit_done()`` is called as each unit's update is in place."""

    def __init__(
        self,
        progress: StepProgress | None = None,
        *,
        on_unit_done: Callable[[], None] | None = None,
    ):
        self.progress = progress if progress is not None else StepProgress()
        self.on_unit_done = on_unit_done
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self.progress.running

    def start(self, step: Callable[[Callable[[int], None]], None]) -> None:
        """Runs ``step(unit_done)`` in a thread."""
        self.synchronize()

        def body() -> None:
            error = None
            try:
                step(self._unit_done)
            except BaseException as e:  # re-raised by the next wait
                error = e
            finally:
                self.progress.finish(error)

        self._thread = threading.Thread(target=body, name="infinity-optimizer-step", daemon=True)
        self.progress.begin(self._thread)
        self._thread.start()

    def _unit_done(self, index: int) -> None:
        self.progress.unit_done(index)
        if self.on_unit_done is not None:
            self.on_unit_done()  # e.g. the prefetch scheduler re-plans: the unit may now be read

    def synchronize(self) -> None:
        self.progress.wait_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


class GatedShardSource:
    """A ShardSource that hands out a unit's shard only once the step in flight has updated it."""

    def __init__(
        self, inner: ShardSource, progress: StepProgress, unit_of_key: dict[Hashable, int]
    ):
        self.inner = inner
        self.progress = progress
        self.unit_of_key = unit_of_key

    def acquire(self, key: Hashable) -> torch.Tensor:
        if self.progress.running:
            self.progress.wait_unit(self.unit_of_key[key])
        return self.inner.acquire(key)

    def release(self, key: Hashable) -> None:
        self.inner.release(key)

    def mark_dirty(self, key: Hashable) -> None:
        self.inner.mark_dirty(key)


class GatedMasters:
    """A MasterCopy that changes a master only once no step is in flight (the step thread reads and
    writes the optimizer state meanwhile)."""

    def __init__(self, inner: MasterCopy, step: OverlappedStep):
        self.inner = inner
        self.step = step

    def overwrite_master(self, index: int, values: torch.Tensor, changed: torch.Tensor) -> None:
        self.step.synchronize()
        self.inner.overwrite_master(index, values, changed)
