"""The docs a new user reads say what holds now and what a reader can follow: no issue
numbers (a reader has no tracker), extras quoted as a shell needs them, every Makefile
variable a doc names defined in the Makefile, every page in both indexes, TensorBoard's
command where the run directory is explained. Outputs of commands: test_doc_outputs.py."""

from __future__ import annotations

import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md", REPO / "datasets" / "README.md",
                                                 REPO / "tests" / "README.md"]


def _names(paths: list[pathlib.Path]) -> list[str]:
    return [str(p.relative_to(REPO)) for p in paths]


@pytest.mark.parametrize("doc", DOCS, ids=_names(DOCS))
def test_no_doc_cites_an_issue_number(doc):
    text = doc.read_text()
    cited = re.findall(r"(?i)\bissues? \d+|\bthe issue's\b|\bissue \d+'s\b", text)
    assert not cited, f"{doc.name}: say what it was, not {cited}"


@pytest.mark.parametrize("doc", DOCS, ids=_names(DOCS))
def test_extras_are_quoted_for_the_shell(doc):
    """``pip install -e .[gpu]`` is a glob to zsh ("no matches found")."""
    bare = re.findall(r"pip install [^`\n]*?(?<!['\"])\.\[[a-z,]+\](?!['\"])", doc.read_text())
    assert not bare, f"{doc.name}: quote the extras: {bare}"


def test_make_variables_in_the_docs_are_the_makefiles():
    defined = set(re.findall(r"^([A-Z_]+) *[?:]?=", (REPO / "Makefile").read_text(), re.M))
    for doc in DOCS:
        for line in re.findall(r"\bmake [a-z-]+(?: +[A-Z_]+=\S+)+", doc.read_text()):
            for name in re.findall(r"\b([A-Z_]+)=", line):
                assert name in defined, f"{doc.name}: `{line}` sets {name}, which the Makefile does not define"
    readme = (REPO / "README.md").read_text()
    assert re.search(r"make setup [^`\n]*TORCH_INDEX=", readme), "README: the CUDA wheel index as a make variable"


def test_every_page_is_in_both_indexes():
    pages = {p.name for p in (REPO / "docs").glob("*.md")} - {"README.md"}
    index = (REPO / "docs" / "README.md").read_text()
    readme = (REPO / "README.md").read_text().split("## Documentation", 1)[1]
    for page in sorted(pages):
        assert f"]({page})" in index, f"docs/README.md does not list {page}"
        assert f"](docs/{page}" in readme, f"README.md's Documentation does not list {page}"


def test_the_run_directory_says_how_to_open_tensorboard():
    text = (REPO / "docs" / "training.md").read_text()
    section = text.split("## The run directory", 1)[1].split("\n## ", 1)[0]
    assert "tensorboard --logdir runs/" in section
