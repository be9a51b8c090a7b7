"""Layer-major accumulation: the forwards of one optimizer step's micro-batches, interleaved unit by unit.

[Note: layer-major accumulation]
``engine.train_batch`` runs g micro-batches as one optimizer step, reading each
fetch unit once per step instead of 2g - 1 times:
- Forward: one thread per micro-batch, each running the whole model's
  forward, and a baton, so that exactly one runs at a time (the partitioner
  stays single-threaded in effect; its per-forward state is per thread,
  ``_ForwardState`` in infinity/zero/partitioner.py). The threads meet at
  every module that gathers units (a pre-hook put in front of the
  partitioner's): a *round* is every micro-batch running, in order, from one
  such point to the next. A unit gathered in a round gets one more hold
  (the partitioner's ``on_gather``), dropped when the round ends, so the
  unit is gathered by the first micro-batch and released after the last.
  Every micro-batch must reach the same point (the same module, or the end
  of forward) in each round; one that does not (a branch, a finished
  forward, a module called a different number of times) makes the rest of
  the step *micro-batch-major*: the round holds are dropped, each unfinished
  forward runs to its end in turn, each backward runs alone, and one warning
  says so. The numbers are the same either way (holds only keep memory);
  only the reads differ.
- What is thread-local in torch is carried into each thread: grad mode,
  autocast, the innermost saved-tensor hooks, context variables (the
  engine's checkpoint settings). Autograd numbers its nodes per thread: a
  fresh thread per micro-batch numbers the same forward the same way.
- Backward: one ``torch.autograd.backward`` of the g losses (each scaled
  by loss_scale / g, as the micro-batch loop's ``engine.backward`` scales
  it). The CPU ready queue runs the highest sequence number first, so the g
  graphs, numbered alike, are walked together, layer by layer: a unit is
  gathered for the first micro-batch's backward through it and, holding
  until its grads are reduced (GradHooks' ``on_unit_done``), serves the
  others. AccumulateGrad runs once per parameter with the sum over the g
  micro-batches: each gradient is reduced, and written, once. With 16-bit
  weights that sum is taken in the training dtype (the micro-batch loop
  sums the g gradients in fp32), a difference within the dtype's rounding.
- Heaps: glibc gives each thread its own heap (arena), and memory freed into
  one is reused only by the threads allocating from it. Each forward's
  activations come from its thread's heap, the backward (in the training
  thread) frees them there, and its own working set comes from another: left
  alone, the process keeps the forwards' transients and every freed
  activation besides what the backward allocates, and the block's peak grows
  with the model's width (1,519 MiB against 1,001 trimmed, 152M GPT at
  sequence 256, 2 micro-batches). So the free pages of every heap go back to
  the OS (``trim_heap``) when each forward ends, after each block's backward
  and, as the backward walks down, at the end of a unit near the peak
  (``HeapTrimmer``): a unit's end finds the resident set at most that peak,
  and the process's peak rises by about one unit's working set (1,005
  against 921 MiB on the 152M GPT at sequence 32, g = 8). Not at every
  unit's end: a trim also hands back the training thread's own free pages,
  and the next unit's gradients (g of them per weight, summed) fault them in
  again: 123 trims a step made that GPT's backward about 1.7 times longer
  than untrimmed.
- The prefetch trace records one step for the whole batch: forward and
  backward in layer-major order, the same every step, so it replays.
- Dropout draws from the one generator in the order the interleaving runs,
  so its masks differ from the micro-batch loop's (same distribution).
- An error in one micro-batch's forward cancels the others (each stops at
  its next meeting point, in turn, unwinding its partitioner frames) and is
  raised with a note naming the micro-batch.

Threading: ``LayerMajorForward.run`` is called by the training thread, which
waits while the micro-batch threads take turns; everything they share is
under one lock. Each waiter has its own condition on it: a move of the baton
wakes only the micro-batch it goes to, and the training thread only when a
forward finishes. (One condition woken with ``notify_all`` made all g threads
take the GIL at each of about 600 moves a step: the 152M GPT's forward at
sequence 32, g = 8, took 2.4 s instead of 1.3-1.5 s.)
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from infinity.aio.waits import wait_until
from infinity.engine.notes import add_note
from infinity.host import rss_nbytes
from infinity.memory import trim_heap
from infinity.zero.grad_hooks import GradHooks
from infinity.zero.partitioner import Stage3Partitioner
from infinity.zero.unit import ParamUnit

log = logging.getLogger("infinity.engine")

_END = "the end of its forward"
"""The meeting point a micro-batch reaches when its forward returns (or raises)."""


class _Cancelled(Exception):
    """Another micro-batch's forward failed (or the training thread was interrupted): stop here.
    An Exception, not a BaseException: modules run their always-called forward hooks (the
    partitioner's releases) only for an Exception."""


@dataclasses.dataclass
class _Runner:
    index: int
    batch: Any
    output: Any = None
    error: BaseException | None = None
    finished: bool = False
    at: Any = None  # the meeting point reached: a module, or _END


@dataclasses.dataclass
class ForwardResult:
    outputs: list[Any]
    diverged: str | None
    """Why the micro-batches stopped meeting (the step then ran micro-batch-major), or None."""


def call_module(module: Callable[..., Any], batch: Any) -> Any:
    """A micro-batch given to the model: a tuple or list as positional arguments, a mapping
    (a dict, a tokenizer's BatchEncoding) as keyword arguments, anything else as the one argument."""
    if isinstance(batch, (tuple, list)):
        return module(*batch)
    if isinstance(batch, dict) or (hasattr(batch, "keys") and hasattr(batch, "__getitem__")):
        return module(**batch)
    return module(batch)


class LayerMajorForward:
    """The forwards of ``batches`` through ``forward``, interleaved at the modules of ``meeting``
    ([Note: layer-major accumulation])."""

    def __init__(
        self,
        forward: Callable[[Any], Any],
        batches: Sequence[Any],
        *,
        meeting: Sequence[nn.Module],
        partitioner: Stage3Partitioner | None,
        first: int = 0,
        window: int | None = None,
    ):
        self.forward = forward
        self.first = first  # the window's index of batches[0] (a block of it), for errors
        self.window = window if window is not None else len(batches)
        # One lock; a condition per waiter, so that a move of the baton wakes only the micro-batch
        # it goes to (waking all g threads each time cost the forward more than its compute).
        lock = threading.Lock()
        self.runners = [_Runner(i, b) for i, b in enumerate(batches)]
        self._turns = [threading.Condition(lock) for _ in batches]  # micro-batch i's: its turn
        self.meeting = list(dict.fromkeys(meeting))
        self.partitioner = partitioner
        self._cv = threading.Condition(lock)  # the training thread's: a forward finished
        self._turn = 0
        self._leader = 0  # the runner whose point every other one must match in this round
        self._expected: Any = None
        self._round_held: list[ParamUnit] = []
        self._sequential: str | None = None  # set on divergence: why
        self._cancelled = False
        self._moves = 0  # times the baton changed hands (waits are cut at each)
        self._local = threading.local()  # .runner: the micro-batch this thread runs

    # -- the training thread -------------------------------------------------------

    def run(self) -> ForwardResult:
        handles = [m.register_forward_pre_hook(self._meet, prepend=True) for m in self.meeting]
        if self.partitioner is not None:
            self.partitioner.on_gather = self._hold_for_round
        threads = []
        try:
            for r in self.runners:
                t = threading.Thread(
                    target=self._work,
                    args=(r, _thread_state()),
                    name=f"infinity-microbatch-{r.index}",
                    daemon=True,
                )
                threads.append(t)
                t.start()
            try:
                self._wait(
                    lambda: all(r.finished for r in self.runners), "every micro-batch's forward"
                )
            except BaseException:  # Ctrl-C: each forward stops at its next meeting point
                with self._cv:
                    self._cancelled = True
                    for turn in self._turns:
                        turn.notify()
                self._wait(lambda: all(r.finished for r in self.runners), "the forwards to stop")
                raise
        finally:
            for t in threads:
                t.join()
            for h in handles:
                h.remove()
            if self.partitioner is not None:
                self.partitioner.on_gather = None
            self._drop_round_holds()
        for r in self.runners:
            if r.error is not None:
                add_note(
                    r.error,
                    f"infinity: raised by the forward of micro-batch {self.first + r.index} of "
                    f"{self.window} in engine.train_batch()",
                )
                raise r.error
        return ForwardResult([r.output for r in self.runners], self._sequential)

    def _wait(
        self, done: Callable[[], bool], what: str, cv: threading.Condition | None = None
    ) -> None:
        """Waits until ``done()``, one move of the baton at a time: only a micro-batch that holds
        the turn for long (one unit's compute, or a stall) makes the wait say so, not the g
        forwards' total ([Note: no silent waits])."""
        while True:
            with self._cv:
                if done():
                    return
                seen = self._moves

            def ready(slice_s: float, seen: int = seen) -> bool:
                with self._cv:
                    if self._moves == seen and not done():
                        (cv or self._cv).wait(slice_s)
                    return self._moves != seen or done()

            wait_until(
                ready,
                what=lambda: (
                    f"{what}: micro-batch {self._turn} holds the turn, running up to the "
                    "next unit it gathers"
                ),
                log=log,
            )

    # -- the micro-batch threads ----------------------------------------------------

    def _work(self, r: _Runner, start: _ThreadState) -> None:
        self._local.runner = r
        try:
            self._wait_turn(r)
            with start.applied():
                r.output = start.context.run(self.forward, r.batch)
        except _Cancelled:
            pass
        except BaseException as e:
            r.error = e
            with self._cv:
                self._cancelled = True
        finally:
            trim_heap()  # this thread's freed transients: no other thread reuses them (the note)
            self._arrive(r, _END)

    def _meet(self, module: nn.Module, args: Any) -> None:
        """A meeting point (a module that gathers units): hand the baton on, wait for it back."""
        r = getattr(self._local, "runner", None)
        if r is None or self._sequential is not None:
            return  # not a micro-batch thread (a nested engine call), or running to the end
        self._arrive(r, module)
        self._wait_turn(r)

    def _wait_turn(self, r: _Runner) -> None:
        self._wait(
            lambda: self._turn == r.index, f"micro-batch {r.index}'s turn", self._turns[r.index]
        )
        if self._cancelled:
            raise _Cancelled

    def _arrive(self, r: _Runner, point: Any) -> None:
        """``r`` reached ``point`` (and holds the baton): check it against the round, pass it on."""
        with self._cv:
            r.at = point
            if point is _END:
                r.finished = True
            if self._sequential is None and not self._cancelled:
                if r.index == self._leader:
                    self._expected = point
                elif point is not self._expected:
                    self._diverge(r, point)
            nxt = self._next_after(r.index)
            if nxt is not None and self._sequential is None and nxt <= r.index:
                self._end_round(nxt)
            if self._sequential is not None and not r.finished:
                nxt = r.index  # running to the end: keep the baton
            self._turn = -1 if nxt is None else nxt
            self._moves += 1
            if nxt is not None and nxt != r.index:
                self._turns[nxt].notify()
            if r.finished:
                self._cv.notify()

    def _next_after(self, index: int) -> int | None:
        n = len(self.runners)
        for k in range(1, n + 1):
            j = (index + k) % n
            if not self.runners[j].finished:
                return j
        return None

    def _end_round(self, leader: int) -> None:
        """Every unfinished micro-batch ran this round: its units may go."""
        self._drop_round_holds()
        self._leader = leader
        self._expected = None

    def _diverge(self, r: _Runner, point: Any) -> None:
        leader = self.runners[self._leader]
        self._sequential = (
            f"micro-batch {r.index} reached {_describe(point)} where micro-batch "
            f"{leader.index} reached {_describe(self._expected)}"
        )
        self._drop_round_holds()
        if self.partitioner is not None:
            self.partitioner.on_gather = None

    def _hold_for_round(self, unit: ParamUnit) -> None:
        if self._sequential is None and self.partitioner is not None:
            self.partitioner.hold(unit)
            self._round_held.append(unit)

    def _drop_round_holds(self) -> None:
        held, self._round_held = self._round_held, []
        if self.partitioner is not None:
            for unit in held:
                self.partitioner.unhold(unit)


class HeapTrimmer:
    """Trims the heaps as a block's backward walks down, only where they would raise the training's
    peak ([Note: layer-major accumulation]'s heaps): at a unit's end, when the resident set is
    within ``margin_nbytes`` of the peak. The peak is the highest resident set seen at a backward's
    start (every micro-batch's activations alive) or at a unit's end in the first backward, which
    trims the same way: later backwards do not raise it with what they keep untrimmed. Not at every
    unit: a trim also hands back the training thread's free pages, which its next unit's gradients
    fault in again (on the 152M GPT at sequence 32, 123 trims a step made the backward 1.7 times
    longer); the memory kept below the peak is reused by the backward and the next forward.

    Threading: used by the training thread only (the backward's hooks run in it)."""

    def __init__(self, margin_nbytes: int = 32 << 20) -> None:
        self.margin_nbytes = margin_nbytes
        self.peak_nbytes = 0
        """The highest resident set seen at a backward's start or a unit's end in the first one."""
        self.trims = 0
        self._backwards = 0

    @contextlib.contextmanager
    def during_backward(self, grad_hooks: GradHooks | None) -> Iterator[None]:
        """While a block's backward runs: the activations it frees into the forward threads' heaps
        leave the process (each time a unit's grads are reduced, near the peak) instead of staying
        beside the training thread's own working set."""
        if grad_hooks is None:
            yield
            return
        done = grad_hooks.on_unit_done
        self.peak_nbytes = max(self.peak_nbytes, rss_nbytes())
        first = self._backwards == 0
        self._backwards += 1

        def trimmed(unit: ParamUnit) -> None:
            if done is not None:
                done(unit)
            rss = rss_nbytes()
            if first:
                self.peak_nbytes = max(self.peak_nbytes, rss)
            if rss + self.margin_nbytes >= self.peak_nbytes:
                trim_heap()
                self.trims += 1

        grad_hooks.on_unit_done = trimmed
        try:
            yield
        finally:
            grad_hooks.on_unit_done = done


def _describe(point: Any) -> str:
    if point is _END or point is None:
        return _END
    return f"module {type(point).__name__}"


@dataclasses.dataclass
class _ThreadState:
    """What torch and Python keep per thread, as the training thread has it, for each micro-batch thread."""

    grad: bool
    autocast: list[tuple[str, torch.dtype]]
    saved_hooks: Any
    context: contextvars.Context

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(self.grad))
            for device_type, dtype in self.autocast:
                stack.enter_context(torch.autocast(device_type, dtype=dtype))
            if self.saved_hooks is not None:
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*self.saved_hooks))
            yield


def _thread_state() -> _ThreadState:
    autocast = [
        (d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)
    ]
    return _ThreadState(
        grad=torch.is_grad_enabled(),
        autocast=autocast,
        saved_hooks=torch._C._autograd._top_saved_tensors_default_hooks(False),
        context=contextvars.copy_context(),
    )
