"""TraceWindow: which optimizer steps an engine records on the timeline, and the file it writes.

[Note: the tracing window]
The ``trace`` section (or ``INFINITY_TRACE``, which overrides it) names the
steps: recording starts at the first forward of step ``first_step`` and
covers ``steps`` optimizer steps. Under stage 3 a step's Adam runs behind the
next forward (engine/overlap.py), so the window stays open past the last
recorded step until the engine next waits for that optimizer step
(``synchronize``, in the next backward, or ``close``): the file holds the
last step's sub-groups whole, and the first forward of the step after it,
which lies outside every recorded step's interval and is left out of the
figures. The file's ``infinity`` object records, beside the spans:
- ``steps``: each recorded step's interval [begin, end) on the trace's clock
  (end: the next step's first forward, or the engine's close), and the
  prefetch scheduler's own figures for its micro-steps (``stall_s``);
- ``counters``: the parameter and optimizer stores' bytes read and written at
  the window's opening and closing, taken under each store's lock in the same
  breath as the recording is switched, so the spans' bytes and the counters'
  differences describe exactly the same requests;
- ``plan``: where the plan put each state class, the host-memory budget, and
  (for a placement planned within a budget) the planner's plan for a budget
  that keeps the optimizer's state in memory, which ``infinity report`` reads.
Outside the window, while a ``torch.profiler`` runs, each forward switches the
spans to profiler ranges (``ProfilerRanges``) and off again once it stops:
one check per forward, nothing per span.

Threading: called from the thread that drives the engine.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from infinity.config import ConfigError, InfinityConfig, TraceConfig
from infinity.config.trace import ENV, parse_trace_env
from infinity.estimate.runtime_plan import PARAM, STATE_CLASSES, RuntimePlan
from infinity.estimate.traffic import expected_traffic
from infinity.store import TieredStore
from infinity.timeline import ProfilerRanges, Timeline, profiler_running, read_trace, write_trace
from infinity.timeline.advice import advise
from infinity.timeline.breakdown import PARTS, mean_breakdown, step_breakdowns

log = logging.getLogger("infinity.engine")

FORMAT = 1
"""The version of the ``infinity`` object in a trace file; ``infinity report`` checks it."""


def trace_settings(config: InfinityConfig, environ: dict[str, str] | None = None) -> TraceConfig:
    """The ``trace`` section in force: ``INFINITY_TRACE`` when set (it overrides the config)."""
    env = (os.environ if environ is None else environ).get(ENV, "")
    return parse_trace_env(env) if env else config.trace


def output_path(settings: TraceConfig, rank: int, world_size: int) -> Path:
    """The file this rank writes, refused (naming the key) where it cannot be written."""
    path = Path(settings.output_path).expanduser()
    if world_size > 1:
        path = path.with_name(f"{path.stem}.rank{rank}{path.suffix}")
    where = f"{ENV}" if os.environ.get(ENV) else "trace.output_path"
    folder = path.parent
    if path.is_dir():
        raise ConfigError(f"{where} = {str(path)!r} is a directory; name a file (e.g. trace.json)")
    if not folder.is_dir():
        raise ConfigError(
            f"{where} = {settings.output_path!r}: folder {str(folder)!r} does not exist; create "
            "it or name a file in an existing folder"
        )
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ConfigError(
            f"{where} = {settings.output_path!r}: {str(path)!r} cannot be written (permission "
            "denied); name a file in a folder this process may write"
        )
    return path


def _counted(stores: list[TieredStore], switch: Callable[[], object]) -> dict[str, dict[str, int]]:
    """Each store's bytes read and written, taken under all their locks while ``switch()`` runs."""
    if not stores:
        switch()
        return {}
    first, rest = stores[0], stores[1:]
    out: dict[str, dict[str, int]] = {}

    def inner() -> None:
        out.update(_counted(rest, switch))

    read, written = first.traffic_while(inner)
    out[first.name] = {"read_nbytes": read, "write_nbytes": written}
    return out


class TraceWindow:
    """The recording of one engine's chosen steps (see [Note: the tracing window])."""

    def __init__(
        self,
        settings: TraceConfig | None,
        path: Path | None,
        *,
        stores: list[TieredStore],
        plan: RuntimePlan | None,
        predict: Callable[[], dict[str, Any] | None],
        scheduler_stats: Callable[[], Any] | None,
        rank: int,
    ):
        """``settings`` None: nothing is recorded; the spans only follow a torch.profiler."""
        self.settings = settings
        self.path = path
        self.first = settings.first_step if settings is not None else -1
        self.last = self.first + settings.steps - 1 if settings is not None else -1
        self._stores = stores
        self._plan = plan
        self._predict = predict
        self._scheduler_stats = scheduler_stats
        self._scheduler_seen = 0  # scheduler steps ended before the window's current step
        self._rank = rank
        self._timeline: Timeline | None = None
        self._profiler: ProfilerRanges | None = None
        self._steps: list[dict[str, Any]] = []
        self._counters: dict[str, Any] = {}
        self._ended = False  # the last recorded step has ended: close at the next synchronize
        self.written: Path | None = None

    @property
    def recording(self) -> bool:
        return self._timeline is not None

    def step_begins(self, step: int) -> None:
        """The first forward of optimizer step ``step`` is about to run (before its trace step)."""
        if self._timeline is not None:
            now = time.monotonic()
            self._steps[-1]["end"] = now
            if step > self.last:
                self._ended = True
            else:
                self._steps.append({"step": step, "begin": now})
            return
        if self.path is not None and self.written is None and self.first <= step <= self.last:
            self._open(step)
        else:
            self._follow_profiler()

    def step_ended(self) -> None:
        """The optimizer step's update was started: the step's micro-steps have all ended."""
        if self._timeline is None or not self._steps or "updated" in self._steps[-1]:
            return
        self._steps[-1]["updated"] = time.monotonic()
        self._steps[-1]["scheduler"] = self._scheduler_steps()

    def _scheduler_steps(self) -> list[dict[str, Any]]:
        """The prefetch scheduler's figures for its steps ended since the last call."""
        if self._scheduler_stats is None:
            return []
        st = self._scheduler_stats()
        new = [s for s in st.history if s.step >= self._scheduler_seen]
        self._scheduler_seen = st.steps
        return [{"step": s.step, "kind": s.kind, "stall_s": s.stall_s, "uses": s.uses} for s in new]

    def synchronized(self) -> None:
        """The engine has waited for its optimizer step: a finished window is written now."""
        if self._timeline is not None and self._ended:
            self._close()

    def close(self) -> None:
        """The engine closes (after waiting for its optimizer step): writes what was recorded."""
        if self._timeline is not None:
            if "end" not in self._steps[-1]:
                self._steps[-1]["end"] = time.monotonic()
            self._close()
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None

    # -- internals ----------------------------------------------------------------------

    def _follow_profiler(self) -> None:
        running = profiler_running()
        if running and self._profiler is None and Timeline.active is None:
            self._profiler = ProfilerRanges().start()
        elif not running and self._profiler is not None:
            self._profiler.stop()
            self._profiler = None

    def _open(self, step: int) -> None:
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None
        timeline = Timeline()
        if self._scheduler_stats is not None:
            self._scheduler_seen = self._scheduler_stats().steps
        self._counters["start"] = _counted(self._stores, timeline.start)
        self._timeline = timeline
        self._steps = [{"step": step, "begin": time.monotonic()}]
        log.info("recording the timeline of steps %d-%d into %s", self.first, self.last, self.path)

    def _close(self) -> None:
        timeline = self._timeline
        assert timeline is not None
        self._counters["end"] = _counted(self._stores, timeline.stop)
        self._timeline = None
        spans = timeline.spans()  # formatted now, outside the stores' locks
        origin = timeline.started
        steps = [
            {
                **s,
                "begin": (s["begin"] - origin) * 1e6,
                "end": (s["end"] - origin) * 1e6,
                "updated": (s.get("updated", s["end"]) - origin) * 1e6,
            }
            for s in self._steps
        ]
        try:
            prediction = self._predict()
        except Exception as e:  # the advice loses a figure; the trace is still written
            prediction = {"error": f"{type(e).__name__}: {e}"}
        extra = {
            "format": FORMAT,
            "rank": self._rank,
            "clock": "microseconds from the recording's start (time.monotonic)",
            "steps": steps,
            "counters": self._counters,
            "plan": plan_record(self._plan, prediction),
        }
        assert self.path is not None
        self.written = write_trace(self.path, spans, origin, extra)
        log.warning(
            "timeline of steps %d-%d written to %s (infinity report %s): %s",
            self.first,
            self.last,
            self.path,
            self.path,
            summary(self.written),
        )


def summary(path: Path) -> str:
    """The end-of-window line: where the recorded steps went, and the advice
    ([Note: where the step went], [Note: advice from the figures])."""
    doc = read_trace(path)
    mean = mean_breakdown(step_breakdowns(doc))
    parts = ", ".join(f"{p} {mean.share(p):.0%}" for p in PARTS)
    return f"{mean.wall_s:.3f} s/step: {parts}. {advise(mean, doc['infinity'].get('plan', {}))}"


def plan_record(plan: RuntimePlan | None, prediction: dict[str, Any] | None) -> dict[str, Any]:
    """What ``infinity report`` needs of the plan: where each state class rests, the budget, the
    traffic the plan expects, and the planner's prediction for more budget (if it made one)."""
    if plan is None:
        return {}
    classes = [PARAM] if plan.stage == 3 else []
    if plan.optimizer is not None:
        classes += [c for c in STATE_CLASSES if c in plan.optimizer.state_keys]
    traffic = expected_traffic(plan)
    out: dict[str, Any] = {
        "stage": plan.stage,
        "gradient_accumulation_steps": plan.gradient_accumulation_steps,
        "state": {
            c: {
                "host_nbytes": plan.state_nbytes(c, "cpu"),
                "nvme_nbytes": plan.state_nbytes(c, "nvme"),
            }
            for c in classes
        },
        "optimizer_classes": [c for c in classes if c != PARAM],
        "expected_read_nbytes": traffic.read_nbytes,
        "expected_write_nbytes": traffic.write_nbytes,
        "planned": plan.chosen is not None,
    }
    if plan.chosen is not None:
        out["budget_nbytes"] = plan.chosen.budget_nbytes
        out["budget_source"] = plan.chosen.budget_source
        out["need_nbytes"] = plan.chosen.need_nbytes
    if prediction is not None:
        out["prediction"] = prediction
    return out


def predict_more_budget(
    model: Any, config: InfinityConfig, plan: RuntimePlan | None, group: Any
) -> dict[str, Any] | None:
    """The placement planner's plan for this run with ``host_memory_budget`` raised by the bytes of
    optimizer state the plan keeps on NVMe: where the state would rest and the traffic it expects.
    None where the plan was not made within a budget (no "auto" section) or keeps no optimizer
    state on NVMe."""
    if plan is None or plan.chosen is None or plan.optimizer is None:
        return None
    from infinity.estimate.context import run_context
    from infinity.estimate.placement import place_in_budget

    classes = [c for c in STATE_CLASSES if c in plan.optimizer.state_keys]
    on_nvme = sum(plan.state_nbytes(c, "nvme") for c in classes)
    if on_nvme == 0:
        return None
    budget = plan.chosen.budget_nbytes + on_nvme
    ctx = run_context(model, config, device=plan.device, world_size=group.world_size)
    more = place_in_budget(
        model,
        config,
        ctx,
        budget_nbytes=budget,
        budget_source="the trace's prediction",
        rank=group.rank,
        device=plan.device,
        unit_map=plan.unit_map,
    )
    traffic = expected_traffic(more)
    return {
        "budget_nbytes": budget,
        "optimizer_nvme_nbytes": sum(more.state_nbytes(c, "nvme") for c in classes),
        "param_nvme_nbytes": more.state_nbytes(PARAM, "nvme") if more.stage == 3 else 0,
        "expected_read_nbytes": traffic.read_nbytes,
        "expected_write_nbytes": traffic.write_nbytes,
    }
