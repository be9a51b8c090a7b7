"""``infinity <command>``: dispatches to the subcommand modules listed in SUBCOMMANDS.

Each module exposes ``add_parser(subparsers)`` (which sets ``run`` as the
parser's default) and ``run(args) -> int`` (the exit status).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

SUBCOMMANDS: tuple[str, ...] = ("infinity.cli.estimate",)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="infinity",
        description="Train PyTorch models whose state is larger than GPU and host memory.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    for name in SUBCOMMANDS:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
