"""build_monitors: the enabled monitor sections as writers, listening to an engine's steps.

Built on rank 0 only (DeepSpeed's monitors write on rank 0; other ranks' losses
are their own micro-batches' and are not gathered), by initialize before it builds the engine, so that a
missing package or an unwritable directory stops the run before anything is
allocated, naming the key; ``Monitors.attach`` then registers them with the
engine, closed with it. With no section enabled nothing is built, imported or made,
and the engine builds no step records ([Note: step records] in
infinity/engine/step_record.py).

Threading: the writers run in the engine's caller thread, inside ``step()``.
"""

from __future__ import annotations

from typing import Protocol

from infinity.config import InfinityConfig
from infinity.engine import Engine, StepRecord
from infinity.monitor.csv_files import CSVFiles
from infinity.monitor.directory import job_directory
from infinity.monitor.events import Event, step_events


class Writer(Protocol):
    def write_events(self, events: list[Event]) -> None: ...

    def close(self) -> None: ...


class Monitors:
    """The writers of one engine; called with each StepRecord."""

    def __init__(self, config: InfinityConfig, writers: list[Writer]):
        self.writers = writers
        self._fp16 = config.fp16.enabled
        self._breakdown = config.wall_clock_breakdown

    def __call__(self, record: StepRecord) -> None:
        events = step_events(record, fp16=self._fp16, wall_clock_breakdown=self._breakdown)
        for w in self.writers:
            w.write_events(events)

    def close(self) -> None:
        for w in self.writers:
            w.close()

    def attach(self, engine: Engine) -> None:
        """Writes every optimizer step of ``engine`` from now on; closed when the engine closes."""
        engine.add_step_listener(self, on_close=self.close)


def build_monitors(config: InfinityConfig, *, rank: int) -> Monitors | None:
    """The writers the config enables on this rank (None: none enabled, or not rank 0);
    directories made and packages imported now, each failure a ConfigError naming its key."""
    if rank != 0:
        return None
    writers: list[Writer] = []
    try:
        if config.csv_monitor.enabled:
            c = config.csv_monitor
            writers.append(CSVFiles(job_directory("csv_monitor", c.output_path, c.job_name)))
        if config.tensorboard.enabled:
            from infinity.monitor.tensorboard import TensorBoardFiles

            t = config.tensorboard
            writers.append(
                TensorBoardFiles(job_directory("tensorboard", t.output_path, t.job_name))
            )
        if config.wandb.enabled:
            from infinity.monitor.wandb_run import WandbRun

            writers.append(WandbRun(config.wandb, config.to_dict()))
    except BaseException:
        for w in writers:
            w.close()
        raise
    return Monitors(config, writers) if writers else None
