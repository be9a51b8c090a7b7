"""Entry point of the ``infinity`` console script.

Each subcommand lives in its own module exposing ``NAME``, ``HELP``, ``add_arguments(parser)`` and
``run(args) -> int``; adding a command is one line in ``COMMANDS``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import infinity
from infinity.cli import bench, demo, doctor, estimate, export, generate, report, tune

COMMANDS = [demo, bench, tune, estimate, doctor, export, generate, report]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="infinity",
        description="Train PyTorch models whose state is larger than GPU and host memory (NVMe offload).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {infinity.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for cmd in COMMANDS:
        p = sub.add_parser(cmd.NAME, help=cmd.HELP, description=cmd.HELP)
        cmd.add_arguments(p)
        p.set_defaults(run=cmd.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="infinity: %(message)s")
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
