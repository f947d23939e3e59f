"""Records written by someone else, shown by `tirl view`: markup in every field a record or a run's
metrics can carry stays text in a real headless Chromium (no element of it is created, no script of it
runs), and hostile names, lone surrogates and bytes that are not UTF-8 render instead of a traceback."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from tests.jsonl import write_jsonl
from tests.view.browser import Page
from typer.testing import CliRunner

from tirl.agent import AgentConfig
from tirl.agent.protocol import tool_response_text
from tirl.agent.trajectory import ToolCallRecord, Trajectory
from tirl.cli import app
from tirl.rl.trajectory_sample import compact

pytestmark = pytest.mark.timeout(300)

# Markup that runs script wherever it lands unescaped: in text, and after closing an attribute.
PWN = '"\'><img class="pwn" src="x" onerror="window.__pwned = 1">'
PYTHON = "execute_python_code_with_standard_io"


def _hostile_record(i: int) -> dict:
    """A trajectory with the payload in every field the page shows, of the types a record may hold."""
    code = f"print('{PWN}')"
    call = json.dumps({"name": PYTHON, "arguments": {"code": code}})
    text = f"{PWN} <tool_call>{call}</tool_call>"
    text += tool_response_text([PWN], AgentConfig(), turn_closed=False)
    text += f"<answer>\\boxed{{{PWN}}}</answer><|im_end|>"
    traj = Trajectory(
        problem_id=PWN,
        prompt_ids=[],
        response_ids=[1] * 30,
        loss_mask=[1] * 10 + [0] * 10 + [1] * 10,
        response_text=text,
        turns=2,
        tool_calls=[ToolCallRecord(turn=0, status=PWN, code=code)],
        answer_blocks=1,
        finish_reason=PWN,
        reward=1.0,
        sample_index=PWN,  # type: ignore[arg-type]  (a hostile file holds any type)
        error=PWN,
    )
    roc = {"kept": True, "advantage": 0.5, "group_correct": PWN, "group_size": PWN, "group_kept": PWN}
    return {
        **compact(traj),
        "benchmark": f"{PWN}{i}",
        "problem": PWN,
        "reference": PWN,
        "answer": PWN,
        "step": PWN if i == 0 else 1,
        "prompt_tokens": PWN,
        "roc": roc,
    }


def _view(path: Path) -> Path:
    result = CliRunner().invoke(app, ["view", str(path)])
    assert result.exit_code == 0, result.output
    return path / "view.html" if path.is_dir() else path.with_suffix(".html")


def _assert_inert(page: Page) -> None:
    """No element of the payload exists and none of its script ran; its text is shown as text."""
    assert page.page.evaluate("document.querySelectorAll('.pwn').length") == 0
    assert page.page.evaluate("window.__pwned") is None
    assert page.errors == []


def _open_every_row(page: Page, n: int) -> None:
    for i in range(n):
        page.page.click(f'.row[data-id="{i}"]')
        _assert_inert(page)
        assert '<img class="pwn"' in page.page.inner_text("#detail")


def test_a_training_run_with_markup_in_every_field_runs_no_script(browser, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    write_jsonl(run / "trajectories.jsonl", [_hostile_record(i) for i in range(2)])
    write_jsonl(run / "metrics.jsonl", [{"step": PWN, "reward/mean": 0.5}, {"step": 1, "reward/mean": 0.7}])
    (run / "config.yaml").write_text(yaml.safe_dump({"agent": {"max_calls_per_turn": 4}}))
    page = Page(browser, _view(run).as_uri())
    assert page.shown() == 2
    _assert_inert(page)
    _open_every_row(page, 2)
    page.close()


def test_an_eval_summary_with_markup_runs_no_script(browser, tmp_path):
    out = tmp_path / "eval"
    out.mkdir()
    write_jsonl(out / "trajectories.jsonl", [_hostile_record(1)])
    summary = {PWN: {"samples": PWN, "pass1": PWN, "maj": 0.5, "tool_error_rate": PWN}}
    (out / "metrics.json").write_text(json.dumps({"benchmarks": summary, "config": {"agent": {}}}))
    page = Page(browser, _view(out).as_uri())
    _assert_inert(page)
    assert '<img class="pwn"' in page.page.inner_text("#summary")
    _open_every_row(page, 1)
    page.close()


def _surrogate_records(directory: Path) -> Path:
    """Lone surrogates as JSON escapes and as raw bytes (not UTF-8), and names holding the page's own
    template slots, in a directory whose name is not UTF-8 either."""
    name = os.fsdecode(b"run __DATA__ __JS__ <b>\xff")
    run = directory / name
    run.mkdir()
    row = {**_hostile_record(1), "problem_id": "p\ud800 __DATA__ __TITLE__", "problem": "x \udfff y"}
    raw = json.dumps(row).encode() + b"\n"
    raw += (
        json.dumps({**row, "problem": "LONE"}).encode().replace(b"LONE", b"bad \xed\xa0\x80 \xff bytes")
        + b"\n"
    )
    (run / "trajectories.jsonl").write_bytes(raw)
    return run


def test_lone_surrogates_and_hostile_names_render(browser, tmp_path):
    run = _surrogate_records(tmp_path)
    result = CliRunner().invoke(app, ["view", str(run)])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("wrote ") and "\ufffd" in result.output
    page = Page(browser, (run / "view.html").as_uri())
    assert page.shown() == 2
    page.page.click('.row[data-id="0"]')
    assert "p\ufffd __DATA__ __TITLE__" in page.page.inner_text("#detail h2")
    page.page.click('.row[data-id="1"]')
    assert "bad \ufffd" in page.page.inner_text("#detail")
    _assert_inert(page)
    page.close()


@pytest.mark.parametrize("dangling", [False, True])
def test_a_page_link_in_a_shared_run_is_not_written_through(tmp_path, dangling):
    """A shared run holding `view.html -> ~/.bashrc` (or a link to a file not there yet): viewing it
    wrote the page into that file. It is refused with one line, the linked file untouched."""
    run = tmp_path / "shared-run"
    run.mkdir()
    write_jsonl(run / "trajectories.jsonl", [_hostile_record(1)])
    victim = tmp_path / "home" / ".bashrc"
    victim.parent.mkdir()
    if not dangling:
        victim.write_text("export PATH=$HOME/bin:$PATH\n")
    (run / "view.html").symlink_to(victim)
    result = CliRunner().invoke(app, ["view", str(run)])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: ") and "is a symbolic link" in result.output
    assert len(result.output.strip().splitlines()) == 1
    if dangling:
        assert not victim.exists()
    else:
        assert victim.read_text() == "export PATH=$HOME/bin:$PATH\n"
    page = tmp_path / "page.html"  # --out names a file of the user's own: written
    assert CliRunner().invoke(app, ["view", str(run), "--out", str(page)]).exit_code == 0
    assert page.read_text().startswith("<!")


def test_a_record_of_the_wrong_shape_is_one_line_not_a_traceback(tmp_path):
    path = tmp_path / "t.jsonl"
    write_jsonl(path, [{**_hostile_record(1), "response_text": 7}])
    result = CliRunner().invoke(app, ["view", str(path)])
    assert result.exit_code == 2 and result.exception is not None and isinstance(result.exception, SystemExit)
    assert result.output.startswith("error: trajectory #1 is not a tirl trajectory record")
    assert len(result.output.strip().splitlines()) == 1
