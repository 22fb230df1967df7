"""tools/pip_sources.py: pip's package sources as uv's flags (``make setup`` installs with uv,
which reads none of pip's configuration)."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import shlex
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("pip_sources", REPO / "tools" / "pip_sources.py")
pip_sources = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pip_sources)

# As `pip config list` prints this machine's: files first, then the PIP_* variables.
LISTING = """\
global.cert='/etc/ssl/certs/ca-certificates.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/opt/wheels'
download.find-links='/elsewhere'
:env:.default-timeout='180'
:env:.find-links='/opt/wheels /more/wheels'
not a setting
"""


def test_pip_settings_take_the_install_sections_and_the_later_source():
    s = pip_sources.pip_settings(LISTING)
    assert s["find-links"] == "/opt/wheels /more/wheels"  # the variable over the file; download.* not read
    assert s["constraint"] == "/etc/xdg/pip/constraints.txt"
    assert s["extra-index-url"] == "file:///opt/pypi/simple file:///opt/pypi-more/simple"
    assert "not a setting" not in " ".join(s)


def test_uv_args_carry_every_source_and_pips_way_of_comparing_indexes():
    args = pip_sources.uv_args(pip_sources.pip_settings(LISTING))
    pairs = list(zip(args, args[1:]))
    assert ("--find-links", "/opt/wheels") in pairs and ("--find-links", "/more/wheels") in pairs
    assert ("--extra-index-url", "file:///opt/pypi/simple") in pairs
    assert ("--extra-index-url", "file:///opt/pypi-more/simple") in pairs
    assert ("--constraint", "/etc/xdg/pip/constraints.txt") in pairs
    assert ("--index-strategy", "unsafe-best-match") in pairs
    assert not any("tls" in a or "cert" in a for a in args)  # no flag only some uv versions take
    # The torch step with its own TORCH_INDEX: pip's indexes left out, its wheels and caps kept.
    torch_step = pip_sources.uv_args(pip_sources.pip_settings(LISTING), with_indexes=False)
    assert "--extra-index-url" not in torch_step and "--index-strategy" not in torch_step
    assert "--find-links" in torch_step and "--constraint" in torch_step
    # A mirror as the main index, pip's no-index and trusted hosts.
    other = pip_sources.uv_args({"index-url": "https://mirror/simple", "no-index": "true", "trusted-host": "a b"})
    assert other == ["--index-url", "https://mirror/simple", "--allow-insecure-host", "a",
                     "--allow-insecure-host", "b", "--no-index"]


def test_no_pip_configuration_prints_nothing():
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull  # pip reads no file
    out = subprocess.run([sys.executable, str(REPO / "tools" / "pip_sources.py")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "", out


def test_the_printed_line_is_shell_words_and_the_makefile_falls_back_to_pip():
    out = subprocess.run([sys.executable, str(REPO / "tools" / "pip_sources.py")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    words = shlex.split(out.stdout)
    assert shlex.join(words) == out.stdout.strip() and all(not w.startswith("-") or w.startswith("--") for w in words)
    make = (REPO / "Makefile").read_text()
    recipe = make[make.index("$(STAMP): pyproject.toml"):make.index("touch $(STAMP)")]
    assert recipe.count("tools/pip_sources.py") == 2, "both uv steps install from pip's sources"
    assert re.search(r"\|\| \{.*pip-setup", recipe), "uv's failure falls back to pip"
    fallback = make[make.index("pip-setup:"):]
    assert "ensurepip" in fallback and '--no-compile -e ".[test]"' in fallback


def test_make_recipes_write_bytecode_where_the_environment_says_not_to():
    """uv compiles nothing ahead: the modules a recipe imports are compiled once, at their
    first import, only if the recipe's Python may write their bytecode."""
    out = subprocess.run(["make", "-s", "--eval", "probe: ; @echo [$$PYTHONDONTWRITEBYTECODE]", "probe"],
                         cwd=REPO, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out
