"""WandbRun: the events logged to a Weights & Biases run.

``wandb.init(project=, group=, entity=team)`` as DeepSpeed calls it, the
resolved config attached; each optimizer step is one ``run.log`` of every
event at ``step`` = samples seen. wandb's own environment applies:
``WANDB_MODE=offline`` keeps the run on disk (``WANDB_DIR``, default
``./wandb``) with no network, ``wandb sync`` uploads it later. The package is
the ``wandb`` extra, imported only when the section is enabled.
"""

from __future__ import annotations

from typing import Any

from infinity.config import ConfigError, WandbConfig
from infinity.monitor.events import Event


class WandbRun:
    def __init__(self, section: WandbConfig, config: dict[str, Any]):
        try:
            import wandb
        except ImportError as e:
            raise ConfigError(
                f"wandb.enabled is true but the wandb package cannot be imported ({e}); install it "
                "with pip install 'infinity[wandb]', or set wandb.enabled to false"
            ) from None
        self.run = wandb.init(
            project=section.project, group=section.group, entity=section.team, config=config
        )

    def write_events(self, events: list[Event]) -> None:
        if events:
            self.run.log({name: value for name, value, _ in events}, step=events[0][2])

    def close(self) -> None:
        self.run.finish()
