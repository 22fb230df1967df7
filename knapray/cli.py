"""The `knapray` command: a table of subcommands. Each one's arguments are defined next to
its code (``add_arguments(parser)``), shared flags in ``knapray.commands.flags``; a
subcommand's module is imported only when it runs."""

from __future__ import annotations

import sys

from knapray.commands.registry import Command

COMMANDS = (
    Command("train", "knapray.commands.train", "train on Ray (embedded local Ray, or --address for a cluster); "
            "--check: pre-flight only"),
    Command("synthetic", "knapray.commands.synthetic", "build a synthetic corpus from a mix of the paper's data codes"),
    Command("ingest", "knapray.commands.ingest", "encode a folder of images/videos into a corpus", run="cli"),
    Command("sample", "knapray.commands.sample", "sample images from a trained run's checkpoint (each at full "
            "resolution in a folder with a PNG grid, or the grid alone)", run="cli"),
    Command("serve", "knapray.commands.serve", "serve a trained run over HTTP on Ray Serve (POST /v1/generate)",
            run="cli"),
    Command("plan", "knapray.commands.plan", "plan steps of a data mix and report balance"),
    Command("parity", "knapray.commands.parity", "balanced vs unbalanced vs single-process reference (gloo)"),
    Command("bench", "knapray.benchmarks", "benchmarks (ratios measured side by side): planner, step, ledger, data, kernels, coordinator, rivals, sample, serve"),
    Command("simulate", "knapray.commands.simulate",
            "predicted step time per rank: unbalanced, greedy, knapray (cost model)"),
    Command("calibrate", "knapray.commands.calibrate", "time packed batches on this device, fit the cost model, write a "
            "profile; or --validate a profile on held-out batches", run="cli"),
    Command("memory", "knapray.commands.memory",
            "per-GPU memory of a run config and the largest token budget that fits"),
    Command("dryrun", "knapray.commands.dryrun",
            "one rank's training step of a run config at full scale on fake tensors (no GPU, no Ray)"),
    Command("reference", "knapray.commands.reference",
            "knapray's model against the reference implementation (diffusers), loaded from one checkpoint"),
    Command("export", "knapray.commands.export", "a run's trained weights as a diffusers checkpoint"),
)


def build_parser():
    from knapray.commands.flags import Parser
    from knapray.commands.registry import add_commands

    parser = Parser(prog="knapray", description="Workload-balanced DiT training on Ray")
    parser.add_argument("--version", action="version", version=f"knapray {_version()}")
    add_commands(parser, COMMANDS, dest="command")
    return parser


def subcommand_parsers(parser=None) -> dict:
    """Every (sub)subcommand's parser with its arguments, by its full name (``"bench step"``):
    what ``tests/unit/test_cli_dialect.py`` compares."""
    import argparse

    out: dict = {}

    def walk(p, prefix: str) -> None:
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    child.load()
                    full = f"{prefix} {name}".strip()
                    out[full] = child
                    walk(child, full)

    walk(parser or build_parser(), "")
    return out


def main(argv: list[str] | None = None) -> int:
    args = None
    try:
        args = build_parser().parse_args(argv)
        return args._run(args)
    except (ValueError, OSError) as e:  # bad input or an unreadable file: one line, exit 2
        what = f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.filename else str(e)
        print(f"knapray {getattr(args, 'command', '')}: error: {what}".replace("knapray : ", "knapray: "),
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C, also while a command's modules import: one line
        print("\nknapray: interrupted", file=sys.stderr)
        return 130


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("knapray")
    except PackageNotFoundError:
        return "unknown (not installed)"


def run() -> None:
    """The ``knapray`` command (pyproject's script): ``main`` as the process, which ends
    without the interpreter's teardown (``knapray.stopping.run_main``)."""
    from knapray.stopping import run_main

    run_main(main)


if __name__ == "__main__":
    run()
