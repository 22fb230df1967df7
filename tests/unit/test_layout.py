"""The house rules, measured from the source (tests/layout_graph.py reads every import,
also those inside functions): every package on a floor, no import circles, at most two
imports up the floors, command-line code only in commands/ (and benchmarks/, cli.py), no
switch on a model family's name outside models/families, a short Trainer.__init__, and
docs/architecture.md's picture drawn from today's imports."""

from __future__ import annotations

import ast

import pytest

import layout_graph as lg

FAMILY_NAMES = {"flux", "wan", "mmdit", "qwen_image", "flux2"}
CLI_HOMES = ("knapray.commands", "knapray.benchmarks", "knapray.cli")
MAX_UPWARD = 2


@pytest.fixture(scope="module")
def mods():
    return lg.modules()


@pytest.fixture(scope="module")
def edges(mods):
    return lg.imports(mods)


def _where(e: lg.Import) -> str:
    return f"{e.source} -> {e.target} (line {e.line})"


def test_every_package_is_on_a_floor(mods):
    assert lg.unplaced(mods) == [], "add these to FLOORS in tests/layout_graph.py (and the docs' table)"


def test_no_import_circles_between_modules(edges):
    assert lg.circles(edges) == []


def test_no_import_circles_between_packages(edges):
    assert lg.circles(edges, level=lg.top) == []


def test_at_most_two_imports_run_up_the_floors(edges):
    up = lg.upward(edges)
    assert len(up) <= MAX_UPWARD, "\n".join(map(_where, up))


def test_the_analysis_finds_circles_and_upward_imports():
    """The measure itself: a made-up graph with one circle and one import up a floor."""
    made = [lg.Import("knapray.planning.a", "knapray.planning.b", 1),
            lg.Import("knapray.planning.b", "knapray.planning.a", 2),
            lg.Import("knapray.planning.a", "knapray.models.x", 3),
            lg.Import("knapray.commands.c", "knapray.planning.a", 4)]
    assert lg.circles(made) == [["knapray.planning.a", "knapray.planning.b"]]
    assert [e.line for e in lg.upward(made)] == [3]
    assert lg.circles(made, level=lg.top) == []


def _trees(mods):
    for name, path in mods.items():
        yield name, path, ast.parse(path.read_text(), str(path))


def test_command_line_code_lives_in_commands(mods):
    """No argparse import and no ``__main__`` block outside commands/, benchmarks/, cli.py."""
    found = []
    for name, path, tree in _trees(mods):
        if name.startswith(CLI_HOMES):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import) and any(a.name == "argparse" for a in node.names) or \
                    isinstance(node, ast.ImportFrom) and node.module == "argparse":
                found.append(f"{name}:{node.lineno} imports argparse")
            if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
                found.append(f"{name}:{node.lineno} has a __main__ block")
    assert found == []


def _family_switch(node: ast.AST) -> bool:
    if not isinstance(node, ast.Compare):
        return False
    for side in (node.left, *node.comparators):
        values = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
        if any(isinstance(v, ast.Constant) and v.value in FAMILY_NAMES for v in values):
            return True
    return False


def test_no_switch_on_a_family_name_outside_the_families(mods):
    """What a family does differently is declared on the family (models/families)."""
    found = [f"{name}:{node.lineno}: {ast.unparse(node)}"
             for name, path, tree in _trees(mods) if not name.startswith("knapray.models.families")
             for node in ast.walk(tree) if _family_switch(node)]
    assert found == []


def test_the_switch_finder_sees_a_switch():
    assert _family_switch(ast.parse('cfg.family == "wan"', mode="eval").body)
    assert _family_switch(ast.parse('family in ("flux", "mmdit")', mode="eval").body)
    assert not _family_switch(ast.parse('family == name', mode="eval").body)


def test_trainer_init_is_short(mods):
    tree = ast.parse(next(p for n, p in mods.items() if n.endswith(".trainer")).read_text())
    trainer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    init = next(n for n in trainer.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    assert init.end_lineno - init.lineno + 1 <= 70


def test_the_architecture_picture_is_drawn_from_todays_imports():
    doc = (lg.REPO / "docs" / "architecture.md").read_text()
    assert lg.picture_block() in doc, "redraw it: python tests/layout_graph.py, into docs/architecture.md"


def test_a_worker_that_never_compiles_never_loads_the_compiler():
    """Every gloo rank, Ray Train worker and the driver import the trainer; the compiler
    stack (dynamo, inductor: importing the trainer took 2.25 s with it, 1.8 s without) loads only when something
    compiles or asks about a CUDA kernel."""
    import subprocess
    import sys

    code = ("import sys, knapray.worker.trainer, knapray.driver.launch, knapray.commands.train; "
            "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


PLANNING_FLOORS = (("shapes",), ("costs",), ("balance",), ("search", "fitting"), ("inference", "simulation"))
"""planning/'s sub-packages, bottom up: a module imports its own sub-package and those on
lower floors only (siblings on one floor do not import each other); the package's
``__init__`` is its public face and may import any."""


PLANNING_FLOOR = {sub: i for i, subs in enumerate(PLANNING_FLOORS) for sub in subs}


def _planning_sub(name: str) -> str | None:
    """The planning sub-package of a module (``knapray.planning.balance.solver`` -> ``balance``)."""
    parts = name.split(".")
    return parts[2] if len(parts) > 3 and parts[1] == "planning" else None


def _planning_wrong(edges: list[lg.Import]) -> list[lg.Import]:
    """Imports between planning sub-packages that go up a floor or across one."""
    return [e for e in edges if _planning_sub(e.source) and _planning_sub(e.target)
            and _planning_sub(e.source) != _planning_sub(e.target)
            and PLANNING_FLOOR[_planning_sub(e.target)] >= PLANNING_FLOOR[_planning_sub(e.source)]]


def test_planning_shows_its_parts_with_no_import_running_up(mods, edges):
    flat = [m for m in mods if m.startswith("knapray.planning.") and m.count(".") == 2
            and m.split(".")[2] not in PLANNING_FLOOR]
    assert flat == [], "every planning module lives in a sub-package of PLANNING_FLOORS"
    assert set(PLANNING_FLOOR) == {m.split(".")[2] for m in mods if m.startswith("knapray.planning.")}
    for sub in PLANNING_FLOOR:  # each opens with a docstring a reader sees first
        tree = ast.parse(mods[f"knapray.planning.{sub}"].read_text())
        assert ast.get_docstring(tree) and len(ast.get_docstring(tree)) > 80, sub
    assert [_where(e) for e in _planning_wrong(edges)] == []


def test_the_planning_floor_check_sees_an_import_up_or_across():
    up = lg.Import("knapray.planning.shapes.mix", "knapray.planning.balance.solver", 1)
    across = lg.Import("knapray.planning.search.overlap", "knapray.planning.fitting.livefit", 2)
    down = lg.Import("knapray.planning.balance.solver", "knapray.planning.shapes.mix", 3)
    within = lg.Import("knapray.planning.balance.solver", "knapray.planning.balance.refine", 4)
    root = lg.Import("knapray.planning.simulation.sim", "knapray.planning", 5)
    assert _planning_wrong([up, across, down, within, root]) == [up, across]
