"""Where pip installs from here, as arguments for ``uv pip install`` (one line, shell words).

``make setup`` installs with uv (a few times faster than pip: it unpacks wheels in parallel),
and uv reads none of pip's configuration. A machine that serves torch from a local wheel
folder (pip's ``find-links``), a mirror (``index-url``, ``extra-index-url``) or caps versions
(``constraint``) would have uv fetch something else, such as the multi-GB CUDA wheels from
PyPI instead of a CPU build on disk. This prints those of pip's settings (its configuration
files and ``PIP_*`` variables, as ``pip config list`` shows them, the later source winning)
as uv's flags. With extra indexes uv is told to compare every index's versions, as pip does.
pip's ``cert`` has no flag every uv takes (``--native-tls``, renamed ``--system-certs``): where
uv cannot reach an index over TLS, the Makefile installs with pip.

Usage: ``python tools/pip_sources.py [--no-index-url]``; ``--no-index-url`` leaves out pip's
indexes (the Makefile's torch step with its own ``TORCH_INDEX``). Exit 0 always: where pip
has no configuration it prints nothing, and uv uses PyPI as pip would.
"""

from __future__ import annotations

import ast
import shlex
import subprocess
import sys

# pip's option -> uv's flag, and whether the value is a list of whitespace-separated values.
FLAGS = {
    "index-url": ("--index-url", False),
    "extra-index-url": ("--extra-index-url", True),
    "find-links": ("--find-links", True),
    "constraint": ("--constraint", True),
    "trusted-host": ("--allow-insecure-host", True),
}
SECTIONS = ("global", "install", ":env:")
INDEXES = ("index-url", "extra-index-url")


def pip_settings(listing: str) -> dict[str, str]:
    """``pip config list`` lines (``section.key='value'``) -> {key: value} for the sections
    ``pip install`` reads, a later line winning (pip lists its files, then its variables)."""
    out: dict[str, str] = {}
    for line in listing.splitlines():
        name, eq, value = line.partition("=")
        section, dot, key = name.rpartition(".")
        if not (eq and dot) or section not in SECTIONS:
            continue
        try:
            out[key] = str(ast.literal_eval(value))
        except (ValueError, SyntaxError):
            continue
    return out


def uv_args(settings: dict[str, str], with_indexes: bool = True) -> list[str]:
    args: list[str] = []
    for key, (flag, many) in FLAGS.items():
        if key not in settings or (key in INDEXES and not with_indexes):
            continue
        for value in settings[key].split() if many else [settings[key]]:
            args += [flag, value]
    if with_indexes and "extra-index-url" in settings:
        args += ["--index-strategy", "unsafe-best-match"]
    if settings.get("no-index", "").lower() in ("1", "true", "yes", "on"):
        args.append("--no-index")
    return args


def main(argv: list[str]) -> int:
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                             capture_output=True, text=True, check=False).stdout
    print(shlex.join(uv_args(pip_settings(listing), with_indexes="--no-index-url" not in argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
