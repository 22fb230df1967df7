"""Flags that mean the same thing in every ``knapray`` subcommand, defined once here so that
their names, types and choices cannot drift apart (``tests/unit/test_cli_dialect.py`` checks
every subcommand against each other):

- ``--config FILE`` / ``--set SECTION.KEY=VALUE``: a run config (``knapray.config.run``)
  and overrides of its values, wherever a run config applies;
- ``--dtype auto|fp32|bf16|fp16`` (``float32``/``bfloat16``/``float16`` are read as the short names);
- ``--device auto|cpu|cuda``;
- ``--ac [none|full|every_k|selective]`` (bare ``--ac``: full) and ``--ac-every K``;
- ``--fsdp none|full|hybrid``, ``--world-size N``, ``--gpus-per-node N``, ``--seed N``, ``--json``.

Numbers are parsed by functions whose ``__name__`` says what they accept (``int>=1``,
``int[1,1048576]``), so that a bad value is one line naming it and the bound; every number
that sizes an allocation or a loop has an upper bound (``knapray.limits``, docs/cli.md).
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable, Sequence

from knapray.limits import MAX_SEED, MAX_STEPS, MAX_TEXT_LENGTH, MAX_WORLD_SIZE
from knapray.config.parallel import FSDP_MODES
from knapray.planning.costs.checkpointing import AC_MODES


class Parser(argparse.ArgumentParser):
    """A bad argument is one line (``knapray plan: error: ...``) and exit code 2, as every
    other user error of the command. An argument the command does not take is refused by the
    command itself (``knapray train: error: unrecognized arguments: --steps 8; ...``: argparse
    leaves a subcommand's unknown arguments to ``knapray``, whose error named no command), with
    a hint: the run-config key a familiar flag stands for (``hints``), else the command's
    nearest flag."""

    def __init__(self, *args, hints: dict[str, str] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.hints: dict[str, str] = dict(hints or {})
        """Flag -> the run-config key a command that takes ``--set`` reads instead."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}{self._hint(extras)}")
        return namespace, extras

    def _hint(self, extras: list[str]) -> str:
        import difflib

        flags = [(i, e.split("=", 1)) for i, e in enumerate(extras) if e.startswith("--")]
        for i, (flag, *given) in flags:
            if flag in self.hints:
                value = given[0] if given else extras[i + 1] if i + 1 < len(extras) and \
                    not extras[i + 1].startswith("-") else None
                shown = value if value and re.fullmatch(r"[\w.+-]{1,40}", value) else "VALUE"
                return f"; {flag} is a run-config value here: --set {self.hints[flag]}={shown}"
        own = [o for o in self._option_string_actions if o.startswith("--")]
        for _, (flag, *_) in flags:
            near = difflib.get_close_matches(flag, own, n=1, cutoff=0.75)
            if near:
                return f"; did you mean {near[0]}?"
        return f"; {self.prog} --help lists its flags"


CONFIG_FLAG_HINTS = {"--steps": "run.max_steps", "--max-steps": "run.max_steps", "--epochs": "data.epochs",
                     "--lr": "optim.lr", "--name": "run.name", "--num-workers": "scaling.num_workers",
                     "--world-size": "scaling.num_workers", "--seed": "data.seed", "--batch-size": "data.global_batch"}
"""Flags other trainers take that a knapray run config holds (``--set KEY=VALUE``)."""


def int_at_least(low: int, most: int | None = None) -> Callable[[str], int]:
    """An integer >= ``low`` (and <= ``most``: a size or count that allocates or loops is
    bounded, see ``knapray.limits``)."""
    bound = f">= {low}" if most is None else f"in [{low}, {most}]"

    def parse(text: str) -> int:
        try:
            value = int(text) if len(text) <= 40 else None  # int() of thousands of digits is refused anyway
        except ValueError:
            value = None
        if value is None or value < low or (most is not None and value > most):
            raise argparse.ArgumentTypeError(f"expected an integer {bound}, got {_shown(text)}")
        return value

    parse.__name__ = f"int>={low}" if most is None else f"int[{low},{most}]"
    return parse


def _shown(text: str, width: int = 60) -> str:
    """``text`` quoted, cut to ``width`` characters (a 10,000-digit number stays one short line)."""
    return repr(text) if len(text) <= width else repr(text[: width - 3]) + f"... ({len(text)} characters)"


def float_in(*, ge: float | None = None, gt: float | None = None) -> Callable[[str], float]:
    bound = f">= {ge:g}" if ge is not None else f"> {gt:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or (ge is not None and value < ge) or (gt is not None and value <= gt):
            raise argparse.ArgumentTypeError(f"expected a finite number {bound}, got {text!r}")
        return value

    parse.__name__ = f"float{bound.replace(' ', '')}"
    return parse


def int_list(maximum: int) -> Callable[[str], list[int]]:
    """A flag type: ``"10000,1000000"`` -> ``[10000, 1000000]``, each value in [0, maximum]."""

    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",") if x.strip() and len(x.strip()) <= 19]
        except ValueError:
            values = []
        if not values or len(values) != len([x for x in text.split(",") if x.strip()]) or min(values) < 0:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 0, e.g. 10000,1000000; "
                                             f"got {text[:60]!r}")
        if max(values) > maximum:
            raise argparse.ArgumentTypeError(f"{max(values)} is more than {maximum}, the most this flag takes")
        return values

    return parse


# ---- run config -------------------------------------------------------------------------


def add_config(p: argparse.ArgumentParser, *, required: bool, what: str = "") -> None:
    """``--config FILE`` and ``--set SECTION.KEY=VALUE`` (repeatable; values read as YAML)."""
    p.add_argument("--config", required=required, metavar="FILE",
                   help=f"run config YAML (see jobs/configs/){what}")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a run config value, e.g. --set scaling.num_workers=8 (repeatable)")
    if isinstance(p, Parser):
        p.hints.update({f: k for f, k in CONFIG_FLAG_HINTS.items() if f not in p._option_string_actions})


def add_ray_interfaces(p: argparse.ArgumentParser) -> None:
    """``--ray-all-interfaces``: a Ray the command starts itself listens on every interface
    (Ray's default) instead of 127.0.0.1 only (``knapray.local_ray``)."""
    p.add_argument("--ray-all-interfaces", action="store_true",
                   help="the Ray this command starts (no --address, no $RAY_ADDRESS) listens on every interface, "
                   "as Ray's default does, instead of 127.0.0.1 only: for a machine whose Ray others must reach")


class _Removed(argparse.Action):
    """A spelling that was renamed: using it is one line naming the new one."""

    def __init__(self, option_strings, dest, *, instead: str, **kwargs) -> None:
        self.instead = instead
        super().__init__(option_strings, dest, nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} {values or ''}".rstrip() + f": {self.instead}")


def add_removed(p: argparse.ArgumentParser, option: str, instead: str) -> None:
    """``option`` is no longer accepted here; ``instead`` says what to write now."""
    p.add_argument(option, action=_Removed, instead=instead)


# ---- execution mode ---------------------------------------------------------------------

DTYPES = ("auto", "fp32", "bf16", "fp16")
_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
TORCH_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""Short name -> torch's name (``getattr(torch, name)``)."""


def dtype_name(text: str) -> str:
    """A dtype flag's value as its short name (``bfloat16`` -> ``bf16``)."""
    return _DTYPE_NAMES.get(text, text)


dtype_name.__name__ = "dtype"


def add_dtype(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--dtype", type=dtype_name, choices=DTYPES, default="auto",
                   help=f"{help} (auto|fp32|bf16|fp16; float32/bfloat16/float16 also read)")


DEVICES = ("auto", "cpu", "cuda")


def add_device(p: argparse.ArgumentParser, help: str = "where the models run (auto: cuda if present)") -> None:
    p.add_argument("--device", choices=DEVICES, default="auto", help=help)




def add_ac(p: argparse.ArgumentParser, *, default: str | None, help: str) -> None:
    """``--ac [none|full|every_k|selective]`` (bare ``--ac`` is full) and ``--ac-every K``."""
    p.add_argument("--ac", nargs="?", const="full", choices=AC_MODES, default=default,
                   help=f"activation checkpointing of the blocks: {help} (bare --ac: full; every_k: every "
                   "--ac-every-th block)")
    p.add_argument("--ac-every", type=int_at_least(1), default=None, metavar="K",
                   help="k of --ac every_k (default 2)")


def add_fsdp(p: argparse.ArgumentParser, *, default: str | None, help: str) -> None:
    p.add_argument("--fsdp", choices=FSDP_MODES, default=default,
                   help=f"FSDP2 sharding over the world (full) or within nodes (hybrid): {help}")


def add_compile(p: argparse.ArgumentParser, help: str, backends: Sequence[str] | None = None) -> None:
    p.add_argument("--compile", action="store_true", help=help)
    if backends:
        p.add_argument("--compile-backend", default=backends[0], choices=list(backends),
                       help=f"torch.compile backend (default {backends[0]})")


# ---- world ------------------------------------------------------------------------------


ranks = int_at_least(1, MAX_WORLD_SIZE)
"""A number of ranks (``--world-size``, ``--gpus-per-node``)."""

step_count = int_at_least(1, MAX_STEPS)
"""A number of steps (``--steps``: training, planning, simulated or sampling steps)."""

text_tokens = int_at_least(0, MAX_TEXT_LENGTH)
"""Text tokens of one sample (``--max-text-tokens``)."""


def add_world_size(p: argparse.ArgumentParser, *, default: int | None, help: str) -> None:
    p.add_argument("--world-size", type=ranks, default=default, metavar="N", help=help)


def check_local_processes(world: int, what: str) -> None:
    """``what`` starts ``world`` processes on this machine: at most ``MAX_LOCAL_PROCESSES``."""
    from knapray.limits import MAX_LOCAL_PROCESSES

    if world > MAX_LOCAL_PROCESSES:
        raise ValueError(f"--world-size {world}: {what} starts one process per rank on this machine; at most "
                         f"{MAX_LOCAL_PROCESSES}")


def gang_device(device: str, world: int, gpus: int, where: str) -> str:
    """``--device`` for ``world`` ranks that each take a GPU of their own, where ``where`` has
    ``gpus`` of them: ``auto`` is cuda where there are any. A rank on a GPU another rank holds
    (NCCL refuses it) or on none (a process that fails after it started, or a Ray actor that
    waits for good) is refused here, in one line (ValueError), before anything starts."""
    if device == "auto":
        device = "cuda" if gpus else "cpu"
    if device == "cuda" and not gpus:
        raise ValueError(f"--device cuda: {where} has no CUDA device that torch can use; --device cpu (or auto)")
    if device == "cuda" and world > gpus:
        raise ValueError(f"--world-size {world}: each rank takes a GPU of its own, and {where} has {gpus}; "
                         f"--world-size {gpus} or fewer, or --device cpu")
    return device


def add_gpus_per_node(p: argparse.ArgumentParser, *, help: str) -> None:
    p.add_argument("--gpus-per-node", type=ranks, default=None, metavar="N", help=help)


def add_seed(p: argparse.ArgumentParser, default: int = 0, help: str = "random seed") -> None:
    p.add_argument("--seed", type=int_at_least(0, MAX_SEED), default=default, help=f"{help} (default {default})")


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
