"""Documentation blocks that print a command's numbers are that command's output now.

Each entry: a doc, the line that introduces the block, the command that prints it. The
block after that line must equal the command's output (paths of this checkout and of the
test's temporary folders written as the docs write them). A change that moves a number
fails here until the doc is regenerated (``KNAPRAY_REGENERATE_DOCS=1`` rewrites the blocks).
Blocks that cannot be recomputed here (a GPU's, a 6-minute dry run's) carry their date and
commit instead (docs/results.md, docs/gpu.md).
"""

from __future__ import annotations

import os
import pathlib
import re

import pytest

from knapray.cli import main

REPO = pathlib.Path(__file__).resolve().parents[2]
CHECKOUT = "/home/me/knapray"
"""How the docs write the path of the checkout a command ran in."""


def _block_after(doc: pathlib.Path, marker: str) -> tuple[int, int, list[str]]:
    """(first, end) line indexes of the fenced block after the line holding ``marker``, and its lines."""
    lines = doc.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if marker in line)
    start = next(i for i in range(at + 1, len(lines)) if lines[i].startswith("```")) + 1
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("```"))
    return start, end, lines[start:end]


def _compare(doc: pathlib.Path, marker: str, produced: list[str]) -> None:
    start, end, block = _block_after(doc, marker)
    if os.environ.get("KNAPRAY_REGENERATE_DOCS") == "1":
        lines = doc.read_text().splitlines()
        doc.write_text("\n".join(lines[:start] + produced + lines[end:]) + "\n")
        return
    assert block == produced, f"{doc.name}: the block after {marker!r} is stale; now:\n" + "\n".join(produced)


def _run(argv: list[str], capsys) -> tuple[int, list[str], list[str]]:
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out.rstrip("\n").splitlines(), out.err.rstrip("\n").splitlines()


def test_the_memory_block_of_the_flux_fine_tune(capsys):
    code, out, err = _run(["memory", "--config", "jobs/configs/flux_dev_finetune.yaml"], capsys)
    assert code == 0, err
    _compare(REPO / "docs" / "models.md", "`knapray memory --config jobs/configs/flux_dev_finetune.yaml`", out)


@pytest.fixture(scope="module")
def demo_checkout(tmp_path_factory):
    """The demo corpus where `make run` builds it, in a folder standing for the checkout."""
    from knapray.corpus.synthetic import DEMO, build_synthetic

    root = tmp_path_factory.mktemp("checkout")
    build_synthetic(DEMO, root / "datasets" / "generated" / "demo", progress=False)
    return root


def test_the_pre_flight_blocks_of_the_cli_page(demo_checkout, capsys, monkeypatch):
    monkeypatch.chdir(demo_checkout)
    config = str(REPO / "jobs" / "configs" / "demo.yaml")
    code, out, err = _run(["train", "--config", config, "--check"], capsys)
    assert code == 0, err
    shown = ["$ knapray train --config jobs/configs/demo.yaml --check"] + [
        line.replace(config, "jobs/configs/demo.yaml").replace(str(demo_checkout), CHECKOUT) for line in out]
    _compare(REPO / "docs" / "cli.md", "With the demo corpus (`make run` builds it)", shown)
    code, out, err = _run(["train", "--config", config, "--set", "model.text_dim=4096", "--check"], capsys)
    assert code == 2 and len(err) == 1
    shown = ["$ knapray train --config jobs/configs/demo.yaml --set model.text_dim=4096 --check",
             re.sub(re.escape(str(demo_checkout)), CHECKOUT, err[0])]
    _compare(REPO / "docs" / "cli.md", "that pins widths the corpus does not have", shown)
