"""`tirl view` reads only the files a run holds (round 5, item 5): a shared run whose
`trajectories.jsonl` (or `metrics.jsonl`, `config.yaml`, `metrics.json`) is a link to a file outside it
put that file's records into the page the user then shares. It is refused with one line; a link
inside the run, and the run directory given as a link, still view."""

from __future__ import annotations

import json

import pytest
from tests.jsonl import write_jsonl
from tests.view.test_hostile_records import _hostile_record
from typer.testing import CliRunner

from tirl.cli import app

SECRET = "private-notes-0b5e"


def _victim(tmp_path):
    """A file of the user's own, outside any run, holding records that must not reach a page."""
    victim = tmp_path / "home" / "notes.jsonl"
    victim.parent.mkdir()
    record = _hostile_record(1)
    record["problem_id"] = SECRET
    write_jsonl(victim, [record])
    return victim


@pytest.mark.parametrize("linked", ["trajectories.jsonl", "metrics.jsonl"])
def test_a_run_file_linking_outside_the_run_is_refused(tmp_path, linked):
    victim = _victim(tmp_path)
    run = tmp_path / "shared-run"
    run.mkdir()
    if linked == "metrics.jsonl":  # a training run whose metrics are someone's file
        write_jsonl(run / "trajectories.jsonl", [_hostile_record(2)])
    (run / linked).symlink_to(victim)
    page = tmp_path / "page.html"
    result = CliRunner().invoke(app, ["view", str(run), "--out", str(page)])
    assert result.exit_code == 2, result.output
    assert result.output == (
        f"error: {run / linked} is a symbolic link to {victim.resolve()}, outside the run: tirl view reads "
        "only the files a run holds (replace the link by the file it should be, or view that file itself)\n"
    )
    assert not page.exists() or SECRET not in page.read_text()


def test_links_inside_the_run_and_a_linked_run_still_view(tmp_path):
    real = tmp_path / "real-run"
    (real / "data").mkdir(parents=True)
    write_jsonl(real / "data" / "t.jsonl", [_hostile_record(3)])
    (real / "trajectories.jsonl").symlink_to(real / "data" / "t.jsonl")
    (real / "metrics.json").write_text(json.dumps({"benchmarks": {}}))
    alias = tmp_path / "alias"
    alias.symlink_to(real)
    for run in (real, alias):
        page = tmp_path / f"{run.name}.html"
        result = CliRunner().invoke(app, ["view", str(run), "--out", str(page)])
        assert result.exit_code == 0, result.output
        assert page.read_text().startswith("<!")
