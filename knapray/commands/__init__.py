"""``knapray`` subcommands, one module each: ``NAME``, ``HELP``, ``add_arguments(parser)``
and ``run(args) -> exit code``; ``register`` adds one to the command's subparsers."""

from __future__ import annotations

import argparse
from types import ModuleType


def register(subparsers: argparse._SubParsersAction, command: ModuleType) -> None:
    parser = subparsers.add_parser(command.NAME, help=command.HELP, description=command.HELP)
    command.add_arguments(parser)
    parser.set_defaults(func=command.run)
