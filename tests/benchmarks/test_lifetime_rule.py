"""Every benchmark script marks itself as a tirl command would (tirl.lifetime): a benchmark killed
mid-run, even by kill -9, takes the vLLM engine cores, sandboxes and workers it started along, instead
of leaving them to hold the cores and the memory the next run needs."""

from __future__ import annotations

import ast
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _main_block(tree: ast.Module) -> ast.If | None:
    for node in tree.body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            return node
    return None


def test_every_benchmark_script_makes_its_children_die_with_it():
    scripts = {p.name: ast.parse(p.read_text()) for p in sorted(BENCHMARKS.glob("*.py"))}
    entry = {name: block for name, tree in scripts.items() if (block := _main_block(tree))}
    assert len(entry) >= 10, sorted(entry)
    unmarked = []
    for name, block in entry.items():
        first = block.body[:2]  # before anything else runs: an import, then the call
        calls = [ast.unparse(s) for s in first if isinstance(s, ast.Expr)]
        if calls != ["children_die_with_me()"]:
            unmarked.append(name)
    assert not unmarked, f"these do not call tirl.lifetime.children_die_with_me() first: {unmarked}"
