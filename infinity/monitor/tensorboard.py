"""TensorBoardFiles: the events as TensorBoard scalars in ``output_path/job_name``.

Written with torch's ``SummaryWriter`` (as DeepSpeed does), which needs the
``tensorboard`` package: the ``tensorboard`` extra. Imported here, when the
section is enabled, never by a run without it. Flushed after every step's
events, so a TensorBoard watching the directory sees each step as it ends.
"""

from __future__ import annotations

from pathlib import Path

from infinity.config import ConfigError
from infinity.monitor.events import Event


class TensorBoardFiles:
    def __init__(self, directory: Path):
        try:
            import tensorboard  # noqa: F401  (torch's writer needs it; say so by name)
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ConfigError(
                f"tensorboard.enabled is true but the tensorboard package cannot be imported ({e}); "
                "install it with pip install 'infinity[tensorboard]', or set tensorboard.enabled "
                "to false"
            ) from None
        self.directory = directory
        self._writer = SummaryWriter(log_dir=str(directory))

    def write_events(self, events: list[Event]) -> None:
        for name, value, step in events:
            self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
