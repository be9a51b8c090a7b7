"""The ``checkpoint`` section: where each node keeps its part of a checkpoint (DeepSpeed's keys).

``use_node_local_storage`` is acted on by infinity.engine.checkpoint (save.py,
[Note: node-local checkpoints] in nodes.py): each node writes its own ranks'
files and a checksummed node manifest into its own copy of the checkpoint
directory, and a checkpoint counts only once every node has made its part
durable. ``tag_validation`` and ``load_universal`` are accepted without effect
(support.py says why); ``parallel_write`` is kept verbatim.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from infinity.config.values import check_section, knob


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """``checkpoint``: how engine checkpoints are written."""

    PATH: ClassVar[str] = "checkpoint"

    use_node_local_storage: bool = knob(False)
    """Each node writes its own ranks' files (and a checksummed node manifest) into its own copy of
    the checkpoint directory, on storage no other node sees; loads fetch what a rank lacks from the
    node that holds it, on any number of nodes and ranks (docs/node-local-checkpoints.md). Off:
    the directory is one shared by every rank."""
    tag_validation: Literal["ignore", "warn", "fail"] = knob("warn", casefold=True)
    """DeepSpeed: check that every rank saves under the same tag."""
    load_universal: bool = knob(False)
    """DeepSpeed: load a checkpoint converted offline to its universal format."""

    def __post_init__(self) -> None:
        check_section(self)
