"""The layer order of docs/architecture.md, enforced: each package imports only from lower layers,
packages of one layer never import each other, and no module import closes a circle. Every import
line counts, including imports inside functions and under TYPE_CHECKING (they are dependencies a
reader has to follow just the same)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

LAYERS: list[set[str]] = [
    {"tirl", "lifetime", "config", "plugins", "seeds", "devices", "linux", "http_guard", "ports"},  # L0 core
    {"sandbox", "reward", "data", "tiny_model", "model_import", "engines", "distributed"},  # L1 leaves
    {"agent"},  # L2
    {"runtime"},  # L3
    {"rl"},  # L4
    {"eval", "analysis", "view"},  # L5
    {"demo"},  # L6
    {"cli"},  # L7
]
LAYER = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / "tirl").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The tirl modules `name` imports (a `from package import module` names the module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target.startswith("tirl") and target != name:
                found.add(target)
    return found


def unit(module: str) -> str:
    """The layer unit of a module: its top-level package under tirl, or the core module's name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "tirl"


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_every_unit_has_a_layer(graph):
    assert {unit(m) for m in graph} <= set(LAYER), {unit(m) for m in graph} - set(LAYER)


def test_imports_go_down_the_layers(graph):
    bad = [
        f"{m} -> {t} (layer {LAYER[unit(m)]} -> {LAYER[unit(t)]})"
        for m, targets in graph.items()
        for t in targets
        if unit(m) != unit(t) and LAYER[unit(t)] >= LAYER[unit(m)] and LAYER[unit(m)] > 0
    ]
    assert not bad, "imports that go up a layer or across one:\n" + "\n".join(sorted(bad))


def test_core_modules_import_no_package(graph):
    bad = [f"{m} -> {t}" for m, ts in graph.items() for t in ts if LAYER[unit(m)] == 0 and LAYER[unit(t)] > 0]
    assert not bad, "\n".join(sorted(bad))


def test_no_import_circles(graph):
    """Tarjan's strongly connected components: any component of more than one module is a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_the_checker_sees_lazy_and_type_checking_imports(tmp_path):
    """The rule would be toothless if imports inside functions or under TYPE_CHECKING were missed."""
    pkg = tmp_path / "tirl"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tirl import b\n"
        "def f():\n    from .c import g\n"
    )
    (pkg / "b.py").write_text("")
    (pkg / "c.py").write_text("def g(): ...\n")
    known = {
        "tirl": pkg / "__init__.py",
        "tirl.a": pkg / "a.py",
        "tirl.b": pkg / "b.py",
        "tirl.c": pkg / "c.py",
    }
    assert imports("tirl.a", pkg / "a.py", known) == {"tirl.b", "tirl.c"}
