"""The documentation stands alone and stays findable: README.md is short, every relative link of README.md
and docs/*.md reaches an existing file (and heading), every section the long README had is a heading of
the docs/ page it moved to, each measured fact of the demo is stated in docs/results.md only, every Python
block compiles, and nothing cites design notes that are not in the repository."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
# Pages other engineers are writing at the same time: a link to one is accepted while it does not exist
# yet, and checked like any other once it does.
PENDING = {DOCS / "sandbox-sessions.md"}

# Every section of the long README (before it was cut) and the page it now lives in, by heading.
MOVED = {
    "results.md": [
        "Code execution service (`benchmarks/sandbox_bench.py`)",
        "Rollout overlap (`benchmarks/rollout_overlap.py`)",
        "Reward",
        "Rollout scheduler (`benchmarks/scheduler_sim.py`, `benchmarks/scheduler_real.py`)",
        "Ray: weight sync and engine placement (`benchmarks/weight_sync.py`, "
        "`benchmarks/scheduler_sim.py --paper-layout`)",
        "Asynchronous GRPO-RoC (`benchmarks/async_sim.py`, `benchmarks/async_demo.py`)",
        "Evaluation with the model's own agent settings",
        "The tiny demo",
        "Training",
        "Trajectory viewer (`benchmarks/view_scale.py`)",
    ],
    "scaling.md": [
        "Scaling to GPUs and clusters",
        "On a Ray cluster (`cluster.backend: ray`)",
        "Asynchronous GRPO-RoC and off-policy correction",
        "What only a GPU run can confirm",
    ],
    "commands.md": [
        "`tirl demo` — the tiny experiment",
        "`tirl analyze` — high-entropy forking and reflection tokens (the paper's Section 7)",
        "`tirl model init`",
        "`tirl eval` — evaluate any Hugging Face model the paper's way",
        "`tirl chat`",
        "`tirl sft` and `tirl train`",
        "`tirl view` — read the trajectories in a browser",
        "`tirl data`",
    ],
    "sandbox.md": [
        "The code execution service (`tirl sandbox`)",
        "Threat model",
        "Hostile inputs it survives",
    ],
    "extending.md": [
        "Configuration",
        "Built-in tools",
        "Your own tool",
        "Your own loss or advantage",
        "RoC's reading of 1/p_total",
    ],
    "development.md": ["Development"],
}

# The demo's measured times and accuracies, each run once in docs/results.md or, superseded, in
# docs/lab-notebook.md (with its machine and date): no other page repeats them. The README states the one
# headline, as docs/results.md does.
DEMO_FACTS = [
    "10.7 min", "11.6 min", "12.1 min", "19.5 min", "23.3 min", "26.2 min", "39.9 min", "84 s",
    "83.6%", "88.8%", "84.1%", "66.2%", "70.0%", "87.8%", "72.1%", "65.8%", "93.0%", "67.9%", "89.7%", "12.5 min",
]  # fmt: skip
README_HEADLINE = "from SFT 67.9% to GRPO-RoC 89.7%"


def without_code(text: str) -> str:
    """The text with fenced code blocks blanked (a `# comment` in a shell block is not a heading)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (not `-` or `_`), spaces to `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(path: Path) -> list[str]:
    return re.findall(r"^#+ (.+)$", without_code(path.read_text()), flags=re.M)


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in headings(path):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    """Targets of the page's markdown links and images, outside code."""
    return re.findall(r"\]\(([^)\s]+)\)", without_code(path.read_text()))


def test_the_readme_is_short():
    size = len(README.read_text())
    assert size <= 20_000, f"README.md has {size} characters (at most 20,000): move detail into docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_reaches_a_file_and_heading(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # https:, mailto: (not checked: no network in tests)
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        if path in PENDING and not path.exists():
            continue
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no heading with that anchor in {path.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


@pytest.mark.parametrize("name", sorted(MOVED))
def test_every_section_of_the_long_readme_is_findable(name):
    present = set(headings(DOCS / name))
    missing = [h for h in MOVED[name] if h not in present]
    assert not missing, f"docs/{name} lost the headings {missing}"


RESULTS_PAGES = {"results.md", "lab-notebook.md"}  # the current numbers, and the history behind them


def test_each_demo_fact_is_stated_in_results_only():
    results = "".join((DOCS / name).read_text() for name in sorted(RESULTS_PAGES))
    assert all(fact in results for fact in DEMO_FACTS), [f for f in DEMO_FACTS if f not in results]
    for page in PAGES:
        if page.name in RESULTS_PAGES:
            continue
        text = page.read_text()
        if page == README:
            text = text.replace(README_HEADLINE, "")
        repeated = [fact for fact in DEMO_FACTS if fact in text]
        assert not repeated, f"{page.name} repeats {repeated}: link to docs/results.md instead"
    current = (DOCS / "results.md").read_text()
    assert README_HEADLINE.split("from ")[1].replace(" to ", " -> ") in current  # the headline as measured


def test_the_results_page_is_short_and_the_history_is_kept():
    """docs/results.md holds the current numbers, each with its run; the sittings behind them are in
    docs/lab-notebook.md, and the results page links there."""
    results = (DOCS / "results.md").read_text()
    assert len(results) <= 20_000, (
        f"docs/results.md has {len(results)} characters: move history to the notebook"
    )
    assert "(lab-notebook.md)" in results and len((DOCS / "lab-notebook.md").read_text()) > len(results)


def test_the_readme_tells_no_history():
    """The README is for users: no commit hashes, dates or issue numbers in its prose (docs/results.md and
    docs/lab-notebook.md hold each number with its run)."""
    prose = without_code(README.read_text())
    commit = r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b"  # hex with a letter and a digit
    found = re.findall(rf"{commit}|\b20\d\d-\d\d-\d\d\b|\bissue \d+", prose)
    assert not found, f"README.md tells history: {found}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_python_blocks_compile(page):
    for block in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S):
        compile(block, page.name, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


def test_nothing_cites_notes_outside_the_repository():
    """The design notes the code once cited (the spec, sandbox and architecture notes) are docs/ pages.
    (Code may name host paths such as /work/shared: the sandbox tests probe that they are invisible.)"""
    outside = re.compile(r"\b(SPEC|SANDBOX|ARCHITECTURE)\.md\b|\.\./shared")
    found = [f"{page.name}: /work/shared" for page in PAGES if "/work/shared" in page.read_text()]
    for top in ["src", "tests", "benchmarks", "docs"]:
        for path in (ROOT / top).rglob("*"):
            if path.is_file() and path.suffix in {".py", ".md", ".yaml", ".toml"} and path != Path(__file__):
                found += [
                    f"{path.relative_to(ROOT)}:{i}"
                    for i, line in enumerate(path.read_text().splitlines(), 1)
                    if outside.search(line)
                ]
    found += [
        f"README.md:{i}" for i, line in enumerate(README.read_text().splitlines(), 1) if outside.search(line)
    ]
    assert not found, found


def test_what_is_where_names_modules_that_exist():
    """The README's map from the paper's ideas to code: every path in its table is under src/tirl/."""
    text = README.read_text()
    start = text.index("## What is where")
    table = text[start : text.index("\n## ", start + 1)]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| paper")]
    paths = {p for row in rows for p in re.findall(r"`([a-z_]+/(?:[a-z_]+\.py)?)`", row.split(" | ", 1)[1])}
    assert len(paths) > 20, paths
    missing = sorted(p for p in paths if not (ROOT / "src" / "tirl" / p).exists())
    assert not missing, f"README's 'What is where' names paths that do not exist: {missing}"


def test_the_readme_lists_every_docs_page():
    """The README's documentation table names every page in docs/, so none is an orphan."""
    text = README.read_text()
    table = text[text.index("## Documentation") :]
    listed = set(re.findall(r"^\| \[docs/([\w.-]+\.md)\]", table, flags=re.M))
    missing = sorted(p.name for p in DOCS.glob("*.md") if p.name not in listed)
    assert not missing, f"README's documentation table does not list {missing}"
