"""What a reader of the viewer sees (headless Chromium): the problem column holds the problem's text,
the detail pane never shows a trajectory the filters exclude, and a malformed call's raw text is all
in view (wrapped), however long its one line of JSON. Also: a port in use is one `error:` line."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from tests.view.browser import Page
from typer.testing import CliRunner

from tirl.agent.trajectory import ToolCallRecord, Trajectory
from tirl.cli import app
from tirl.rl.trajectory_sample import compact

SRC = str(Path(__file__).parents[2] / "src")
LONG_JSON = '{"name": "python", "arguments": {"code": "' + "x = 1; " * 120 + '"'  # one line, unclosed
LONG_CALL = f"<tool_call>{LONG_JSON}</tool_call>"


def _write(tmp_path: Path) -> Path:
    rows = []
    for i in range(4):
        malformed = i == 3
        text = (LONG_CALL if malformed else "") + f" <answer>\\boxed{{{i}}}</answer><|im_end|>"
        calls = [ToolCallRecord(turn=0, status="malformed", code=LONG_JSON)] if malformed else []
        traj = Trajectory(
            problem_id=f"syn-950e5c{i}",
            prompt_ids=[0] * 8,
            response_ids=[1] * 20,
            loss_mask=[1] * 20,
            response_text=text,
            turns=1,
            tool_calls=calls,
            answer_blocks=1,
            finish_reason="answered",
            reward=float(i % 2),
            sample_index=0,
        )
        rows.append(
            {"problem": f"What is {i} + {i}? A long problem statement.", "reference": "1", **compact(traj)}
        )
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = CliRunner().invoke(app, ["view", str(path)])
    assert result.exit_code == 0, result.output
    return path.with_suffix(".html")


def test_problem_column_filters_and_malformed_calls_read_as_they_should(browser, tmp_path):
    page = Page(browser, _write(tmp_path).as_uri())
    cells = page.page.eval_on_selector_all(".row", "rows => rows.map(r => r.children[1].innerText)")
    assert cells[0].startswith("What is 0 + 0?") and not any(c.startswith("syn-") for c in cells), cells

    page.page.click('.row[data-id="0"]')  # wrong (reward 0); then show only the correct ones
    page.page.select_option("#f-correct", "1")
    page.wait_shown(2)
    assert "What is 1 + 1?" in page.page.inner_text("#detail")  # the first shown one, not #0
    page.page.fill("#q", "no such text")
    page.wait_shown(0)
    assert "no trajectory matches" in page.page.inner_text("#detail")

    page.page.click("#reset")
    page.wait_shown(4)
    page.page.click('.row[data-id="3"]')
    raw = page.page.locator("#detail pre.code.raw")
    assert raw.count() == 1 and "x = 1; x = 1;" in raw.inner_text()
    overflow = raw.evaluate("el => el.scrollWidth - el.clientWidth")
    assert overflow <= 1, f"the malformed call is cut off by {overflow} px"
    assert page.errors == []
    page.close()


def test_serving_on_a_port_in_use_is_one_error_line(tmp_path):
    page = _write(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "tirl.cli",
                "view",
                str(page.with_suffix(".jsonl")),
                "--serve",
                "--port",
                str(port),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": SRC},
        )
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        == f"error: --host 127.0.0.1 --port {port}: the port is in use: choose another --port (0 picks a free one)"
    )


def test_an_empty_curve_is_not_called_unlogged_and_the_headers_do_not_run_together(browser, tmp_path):
    """A metric logged as null at every step (no correct trajectory yet) reads 'empty', one absent from
    metrics.jsonl 'not logged'; every column header fits its column (answer and ref once ran together)."""
    run = tmp_path / "run"
    run.mkdir()
    rows = [json.loads(line) for line in _write(tmp_path).with_suffix(".jsonl").read_text().splitlines()]
    (run / "trajectories.jsonl").write_text("".join(json.dumps({**r, "step": 1}) + "\n" for r in rows))
    metrics = [{"step": s, "reward/mean": 0.1 * s, "tools/error_ratio_in_correct": None} for s in (1, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    result = CliRunner().invoke(app, ["view", str(run)])
    assert result.exit_code == 0, result.output
    page = Page(browser, (run / "view.html").as_uri())
    hints = page.page.eval_on_selector_all(
        "#curves .chart",
        "cs => cs.map(c => [c.querySelector('h3').innerText, c.querySelector('.hint')?.innerText])",
    )
    assert [h for _, h in hints] == [None, "empty at every step so far", "not logged"], hints
    cut = page.page.eval_on_selector_all(
        "#thead > div",
        "hs => hs.filter(h => h.scrollWidth > h.clientWidth).map(h => [h.innerText, h.scrollWidth, h.clientWidth])",
    )
    assert cut == [], f"headers wider than their columns: {cut}"
    assert page.errors == []
    page.close()
