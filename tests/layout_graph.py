"""knapray's imports as a graph, read from the source (every import, also those inside
functions), and the house rules measured on it: the floors each package sits on, the
imports that run up the floors, the import circles between modules, and the picture of
docs/architecture.md (drawn from the graph: ``python tests/layout_graph.py`` prints it).

Floors, bottom to top: a package may import its own floor and the floors below.
"""

from __future__ import annotations

import ast
import pathlib
import sys
from collections import defaultdict
from dataclasses import dataclass

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = REPO / "knapray"

FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("attention", "file_errors", "files", "indexing", "limits", "local_ray", "nofollow", "progress",
              "quiet_imports", "run_files", "stopping", "transfer")),
    ("planning", ("planning",)),
    ("services", ("coordinator", "corpus", "distributed")),
    ("models", ("models",)),
    ("weights", ("weights",)),
    ("data", ("data", "inference")),
    ("config", ("config",)),
    ("worker", ("worker",)),
    ("driver", ("driver",)),
    ("tools", ("testing",)),
    ("commands", ("benchmarks", "cli", "commands")),
)
"""Each floor's top-level names under ``knapray`` (a package or a module)."""

FLOOR_OF = {name: i for i, (_, names) in enumerate(FLOORS) for name in names}


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    line: int


def imports(mods: dict[str, pathlib.Path] | None = None) -> list[Import]:
    """Every import of one knapray module by another (``from a import b`` where ``a.b`` is a
    module counts as importing ``a.b``; ``from . import x`` resolved against the package)."""
    mods = modules() if mods is None else mods
    out = []
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    where = ".".join(base + ([node.module] if node.module else []))
                else:
                    where = node.module or ""
                subs = [f"{where}.{a.name}" for a in node.names if f"{where}.{a.name}" in mods]
                targets = subs or [where]
            else:
                continue
            for target in targets:
                while target and target not in mods:  # `import a.b.c` of a module under a package
                    target = target.rpartition(".")[0]
                if target.startswith("knapray") and target != name and target != "knapray":
                    out.append(Import(name, target, node.lineno))
    return out


def top(name: str) -> str:
    """The top-level name under knapray (``knapray.planning.balance.solver`` -> ``planning``)."""
    return name.split(".")[1] if "." in name else name


def unplaced(mods: dict[str, pathlib.Path] | None = None) -> list[str]:
    mods = modules() if mods is None else mods
    return sorted({top(m) for m in mods if m != "knapray"} - set(FLOOR_OF))


def upward(edges: list[Import]) -> list[Import]:
    """Imports from a floor to one above it."""
    return [e for e in edges
            if top(e.source) in FLOOR_OF and top(e.target) in FLOOR_OF
            and FLOOR_OF[top(e.target)] > FLOOR_OF[top(e.source)]]


def circles(edges: list[Import], level=lambda m: m) -> list[list[str]]:
    """Strongly connected groups of more than one node (Tarjan), nodes mapped by ``level``
    (the module itself, or ``top`` for packages)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for e in edges:
        a, b = level(e.source), level(e.target)
        if a != b:
            graph[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def package_edges(edges: list[Import]) -> dict[tuple[str, str], int]:
    """(importer, imported) top-level names -> number of imports."""
    counts: dict[tuple[str, str], int] = defaultdict(int)
    for e in edges:
        a, b = top(e.source), top(e.target)
        if a != b:
            counts[a, b] += 1
    return dict(counts)


def picture(edges: list[Import] | None = None) -> str:
    """The floors and the imports between packages as a Mermaid flowchart (GitHub draws it):
    one box per floor, bottom floor last; an arrow per importing pair, its import count
    as the label; arrows to the base floor left out (everything may use it)."""
    edges = imports() if edges is None else edges
    counts = package_edges(edges)
    lines = ["flowchart TB"]
    for i, (floor, names) in reversed(list(enumerate(FLOORS))):
        lines.append(f'  subgraph F{i}["{i}: {floor}"]')
        lines.extend(f"    {n}" for n in names)
        lines.append("  end")
    for (a, b), n in sorted(counts.items()):
        if b in FLOOR_OF and FLOOR_OF[b] == 0:
            continue
        lines.append(f"  {a} -->|{n}| {b}")
    return "\n".join(lines)


PICTURE_BEGIN = "<!-- imports picture: python tests/layout_graph.py -->"
PICTURE_END = "<!-- end of imports picture -->"


def picture_block() -> str:
    return f"{PICTURE_BEGIN}\n```mermaid\n{picture()}\n```\n{PICTURE_END}"


if __name__ == "__main__":
    print(picture_block())
