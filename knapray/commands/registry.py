"""Subcommands as a table: each names the module that defines its arguments
(``add_arguments(parser)``) and the function that runs it (``run(args) -> exit code``).
A module is imported only when its subcommand is used (or its help shown), so that
``knapray plan`` does not pay for torch, and adding a subcommand is one table row."""

from __future__ import annotations

import argparse
import functools
import importlib
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    name: str
    module: str
    """Imported on use; defines ``add_arguments(parser)`` and the ``run`` function."""
    help: str
    run: str = "run"
    """Name of the module's function ``(argparse.Namespace) -> int``."""


@functools.cache
def _lazy_parser_class() -> type:
    """The parser class of a subcommand, defined on first use: importing this module (as
    ``knapray.cli`` does before its Ctrl-C handler is in place) stays as cheap as a table."""
    from .flags import Parser

    class _LazyParser(Parser):
        """A subcommand's parser that imports its module and adds its arguments when first
        parsed or asked for help."""

        def __init__(self, *args, command: Command, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.command = command
            self._loaded = False

        def load(self) -> "_LazyParser":
            if not self._loaded:
                self._loaded = True
                module = importlib.import_module(self.command.module)
                if self.description is None:
                    self.description = getattr(module, "DESCRIPTION", None) or self.command.help
                module.add_arguments(self)
                run = getattr(module, self.command.run, None)
                if run is not None:  # a group of subcommands (bench) leaves it to the one chosen
                    self.set_defaults(_run=run)
            return self

        def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
            self.load()
            return super().parse_known_args(args, namespace)

        def format_help(self) -> str:
            self.load()
            return super().format_help()

    return _LazyParser


def add_commands(parser: argparse.ArgumentParser, commands: Sequence[Command], dest: str) -> dict:
    """One subparser per command under ``parser``; returns them by name (``load()`` one
    to see its arguments without parsing)."""
    sub = parser.add_subparsers(dest=dest, required=True, parser_class=_lazy_parser_class(), metavar="{" + ",".join(
        c.name for c in commands) + "}")
    return {c.name: sub.add_parser(c.name, help=c.help, command=c) for c in commands}
