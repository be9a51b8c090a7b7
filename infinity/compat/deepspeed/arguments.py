"""``deepspeed.add_config_arguments(parser)``: DeepSpeed's command-line arguments, as DeepSpeed adds
them (a ``DeepSpeed`` argument group): ``--deepspeed`` (a flag for the script's own use),
``--deepspeed_config PATH`` (read by ``initialize(args=...)``), and their deprecated spellings
``--deepscale`` / ``--deepscale_config``."""

from __future__ import annotations

import argparse

__all__ = ["add_config_arguments"]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds DeepSpeed's arguments to ``parser``; returns it."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument(
        "--deepspeed",
        default=False,
        action="store_true",
        help="Enable DeepSpeed (a flag for user code; infinity's engine does not read it)",
    )
    group.add_argument(
        "--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file."
    )
    group.add_argument(
        "--deepscale",
        default=False,
        action="store_true",
        help="Deprecated spelling of --deepspeed",
    )
    group.add_argument(
        "--deepscale_config",
        default=None,
        type=str,
        help="Deprecated spelling of --deepspeed_config",
    )
    return parser
