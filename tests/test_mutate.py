"""`make mutate`'s driver (tests/mutate.py) and its configuration: every listed module has its own
tests, every test they name exists, the snapshot's config keeps only its module, and a timeout is
never counted as a kill."""

from __future__ import annotations

import re
import tomllib
from collections import Counter
from pathlib import Path

import pytest
from tests.mutate import ROOT, by_module, module_of, summary, without_mutmut_tables

CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]


def make_lists() -> list[str]:
    """The selectors of the Makefile's MUTATE_* lists (continuation lines joined)."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    lists = re.findall(r"^MUTATE_\w+ := (.*)$", text, flags=re.M)
    return [s for line in lists for s in line.split()]


def test_selectors_name_their_module():
    assert module_of("tirl.rl.losses") == "tirl.rl.losses"
    assert module_of("tirl.rl.losses.x_gspo_loss") == "tirl.rl.losses"
    assert module_of("tirl.distributed.weight_sync.x__pack") == "tirl.distributed.weight_sync"
    assert module_of("tirl.sandbox.pool.xǁSandboxǁ_release") == "tirl.sandbox.pool"
    assert by_module(["a.b.x_f", "c.d", "a.b.x_g"]) == {"a.b": ["a.b.x_f", "a.b.x_g"], "c.d": ["c.d"]}


def test_every_listed_module_has_its_own_existing_tests():
    selectors = make_lists()
    assert {"tirl.rl.plan", "tirl.rl.local_learner", "tirl.rl.ray_learner", "tirl.rl.lora"} <= set(selectors)
    for module in by_module(selectors):
        assert (ROOT / "src" / Path(*module.split("."))).with_suffix(".py").is_file(), module
        args = CONFIG["module_tests"].get(module)
        assert args, f"{module} has no tests in [tool.mutmut.module_tests]"
        paths = [a for a in args if a.startswith("tests/")]
        assert paths and all((ROOT / p.split("::")[0]).is_file() for p in paths), (module, paths)
        for node in (p for p in paths if "::" in p):  # a --deselect of a test that was renamed is silent
            file, name = node.split("::")
            assert re.search(rf"def {name}\(", (ROOT / file).read_text()), node


def test_the_snapshot_config_drops_every_mutmut_table_and_nothing_else():
    text = '[a]\nx = 1\n\n[tool.mutmut]\ny = 2\n\n[tool.mutmut.module_tests]\n"m" = ["t"]\n\n[b]\nz = 3\n'
    assert tomllib.loads(without_mutmut_tables(text)) == {"a": {"x": 1}, "b": {"z": 3}}


@pytest.mark.parametrize("timeouts", [0, 5])
def test_a_timeout_is_reported_apart_and_never_counted_as_a_kill(timeouts):
    verdicts = Counter({"killed": 90, "survived": 5, "timeout": timeouts, "no tests": 1, "not checked": 7})
    line = summary("tirl.m", verdicts)
    ran = 96 + timeouts
    assert f"90 killed,   5 survived,   {timeouts} timeouts,   1 other" in line
    assert f"of {ran:4d} run: {100 * 90 / ran:.1f}% killed; 7 not run" in line
