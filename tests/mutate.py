"""`make mutate`: mutmut 3.8.1 over one module at a time, each in its own snapshot of a commit.

    python tests/mutate.py [--rev REV] [--children N] SELECTOR...

A selector is a module (tirl.rl.losses) or a function of one in mutmut's names
(tirl.rl.losses.x_gspo_loss, tirl.sandbox.pool.xǁSandboxǁ_release). Per module: `git archive REV`
into mutants/MODULE/ (mutmut never sees the working tree others edit), its [tool.mutmut] narrowed to
the module's file and the module's own tests ([tool.mutmut.module_tests] in pyproject.toml),
`mutmut run` over the module's selectors, then one line of counts. A timeout is reported apart and
never counted as a kill: at nice 19 on a busy machine a mutant can be starved of CPU, not caught.
Survivors: `cd mutants/MODULE && mutmut results` (or `mutmut show NAME`)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MUTMUT = Path(sys.executable).parent / "mutmut"
FUNCTION = re.compile(r"\.x[_ǁ]")  # where mutmut's function part of a name starts


def module_of(selector: str) -> str:
    found = FUNCTION.search(selector)
    return selector[: found.start()] if found else selector


def by_module(selectors: list[str]) -> dict[str, list[str]]:
    """Selectors grouped by module, in first-seen order (one snapshot and one mutmut run each)."""
    groups: dict[str, list[str]] = {}
    for s in selectors:
        groups.setdefault(module_of(s), []).append(s)
    return groups


def snapshot(rev: str, dest: Path) -> None:
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    archive = ["git", "-C", str(ROOT), "archive", rev, "src", "tests", "pyproject.toml"]
    tar = subprocess.run(archive, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=tar, check=True)


def without_mutmut_tables(text: str) -> str:
    """pyproject.toml's text less every [tool.mutmut...] table (each ends at the next table header)."""
    kept, skipping = [], False
    for line in text.splitlines():
        if line.startswith("["):
            skipping = line.startswith("[tool.mutmut")
        if not skipping:
            kept.append(line)
    return "\n".join(kept) + "\n"


def narrow(dest: Path, module: str) -> None:
    """The snapshot's [tool.mutmut]: the settings, one source file, and the module's own tests."""
    path = dest / "pyproject.toml"
    text = path.read_text()
    config = tomllib.loads(text)["tool"]["mutmut"]
    tests = config.get("module_tests", {}).get(module)
    source = Path("src", *module.split(".")).with_suffix(".py")
    if tests is None:
        sys.exit(f"error: no tests listed for {module} in [tool.mutmut.module_tests] of pyproject.toml")
    if not (dest / source).is_file():
        sys.exit(f"error: {module} is not a module of the snapshot ({source} is missing)")
    settings = {k: v for k, v in config.items() if not isinstance(v, dict)}
    settings |= {"only_mutate": [str(source)], "pytest_add_cli_args_test_selection": tests}
    settings["use_git_change_detection"] = False  # a fresh snapshot, inside another repository's tree
    lines = ["[tool.mutmut]"] + [f"{k} = {json.dumps(v)}" for k, v in settings.items()]  # JSON is TOML here
    path.write_text(without_mutmut_tables(text) + "\n".join(lines) + "\n")


def counts(dest: Path, selectors: list[str]) -> Counter:
    """mutmut's verdict per mutant of these selectors, counted ("not checked": never run)."""
    out = subprocess.run(
        [str(MUTMUT), "results", "--all", "true"], cwd=dest, check=True, capture_output=True, text=True
    ).stdout
    verdicts: Counter = Counter()
    for line in out.splitlines():
        name, _, verdict = line.strip().rpartition(": ")
        if name and any(name.startswith(s) for s in selectors):
            verdicts[verdict] += 1
    return verdicts


def summary(module: str, v: Counter) -> str:
    ran = sum(v.values()) - v["not checked"]
    other = ran - v["killed"] - v["survived"] - v["timeout"]
    share = f"{100 * v['killed'] / ran:.1f}% killed" if ran else "none ran"
    return (
        f"{module:32} {v['killed']:4d} killed, {v['survived']:3d} survived, {v['timeout']:3d} timeouts, "
        f"{other:3d} other (no tests, suspicious, ...) of {ran:4d} run: {share}"
        + (f"; {v['not checked']} not run" if v["not checked"] else "")
    )


def mutate(rev: str, module: str, selectors: list[str], children: int) -> str:
    dest = ROOT / "mutants" / module
    snapshot(rev, dest)
    narrow(dest, module)
    env = os.environ | {
        "TIRL_TEST_CACHE": str(ROOT / "mutants" / ".test-cache"),  # the tiny and taught models, reused
        "TIRL_TEST_HANG_S": "60",  # a mutant that hangs the agent loop fails its hang guard in a minute
        "OMP_NUM_THREADS": "1",
    }
    run = [str(MUTMUT), "run", "--max-children", str(children), *(s + "*" for s in selectors)]
    with open(dest / "mutmut.log", "w") as log:
        done = subprocess.run(run, cwd=dest, env=env, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode:
        sys.exit(f"error: mutmut failed on {module} (exit {done.returncode}); see {dest / 'mutmut.log'}")
    return summary(module, counts(dest, selectors))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("selectors", nargs="+", help="modules, or mutmut function names of one")
    parser.add_argument("--rev", default="HEAD", help="the commit to snapshot (default HEAD)")
    parser.add_argument("--children", type=int, default=2, help="mutants run at once (default 2)")
    args = parser.parse_args()
    rev = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", args.rev], check=True, capture_output=True, text=True
    ).stdout.strip()
    print(f"snapshots of {rev} in {ROOT / 'mutants'}/MODULE; a timeout is not a kill", flush=True)
    for module, selectors in by_module(args.selectors).items():
        print(mutate(rev, module, selectors, args.children), flush=True)


if __name__ == "__main__":
    main()
