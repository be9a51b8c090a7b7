"""The monitor sections: ``tensorboard``, ``csv_monitor`` and ``wandb``, as DeepSpeed keys them.

Key names and defaults are DeepSpeed's (``deepspeed/monitor/config.py``):
``output_path`` "" and ``job_name`` "DeepSpeedJobName" put the files under
``./DeepSpeedJobName``, as DeepSpeed does; wandb's ``project`` defaults to
"deepspeed". infinity.monitor acts on them (writes the events at every
optimizer step); ``wall_clock_breakdown`` and ``steps_per_print`` are
top-level keys of the root section. Whether a writer's package is installed
and its directory writable is checked at ``initialize`` (infinity.monitor),
not here: the config stays a description of the run.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from infinity.config.values import check_section, knob


@dataclasses.dataclass(frozen=True)
class MonitorFilesConfig:
    """The keys of a monitor that writes files under ``output_path/job_name`` (DeepSpeed's
    ``TensorBoardConfig`` and ``CSVConfig`` have the same three); a section is one of its subclasses."""

    enabled: bool = knob(False)
    """Write the monitor's files."""
    output_path: str = knob("", empty=True)
    """Directory the job's directory is made in ("": the current directory)."""
    job_name: str = knob("DeepSpeedJobName")
    """The directory, inside ``output_path``, that holds this run's files."""

    def __post_init__(self) -> None:
        check_section(self)


@dataclasses.dataclass(frozen=True)
class TensorBoardConfig(MonitorFilesConfig):
    """``tensorboard``: event files for TensorBoard under ``output_path/job_name``."""

    PATH: ClassVar[str] = "tensorboard"

    enabled: bool = knob(False)  # redeclared for its docstring; it keeps its place, first
    """Write TensorBoard event files (needs the ``tensorboard`` extra)."""


@dataclasses.dataclass(frozen=True)
class CSVMonitorConfig(MonitorFilesConfig):
    """``csv_monitor``: one CSV file per event (``step,<name>`` rows) under ``output_path/job_name``."""

    PATH: ClassVar[str] = "csv_monitor"

    enabled: bool = knob(False)  # redeclared for its docstring; it keeps its place, first
    """Write CSV files (no extra package needed)."""


@dataclasses.dataclass(frozen=True)
class WandbConfig:
    """``wandb``: a Weights & Biases run (``WANDB_MODE=offline`` keeps it on disk, no network)."""

    PATH: ClassVar[str] = "wandb"

    enabled: bool = knob(False)
    """Log to a wandb run (needs the ``wandb`` extra)."""
    project: str = knob("deepspeed")
    """The wandb project."""
    group: str | None = knob(None)
    """The wandb group runs are gathered under."""
    team: str | None = knob(None)
    """The wandb team (entity)."""

    def __post_init__(self) -> None:
        check_section(self)
