"""The viewer in a real headless Chromium: pages written by `tirl view` from a real eval, a real
training run and 10,000 synthetic trajectories; `--serve` on localhost. Every wait is on the page's
own state (no sleeps, no wall-clock asserts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.jsonl import read_jsonl
from tests.view.browser import Page
from typer.testing import CliRunner

from tirl.agent import AgentConfig
from tirl.agent.protocol import tool_response_text
from tirl.agent.trajectory import ToolCallRecord, Trajectory
from tirl.cli import app
from tirl.rl.trajectory_sample import compact

SRC = str(Path(__file__).parents[2] / "src")
STATUSES = ["ok", "ok", "runtime_error", "timeout", "malformed"]

# The session fixtures (teach the tiny model, a real eval, a real training run) set up inside the first
# test that needs them; on a busy shared machine that alone can take minutes.
pytestmark = pytest.mark.timeout(900)


def _view(path: Path) -> Path:
    result = CliRunner().invoke(app, ["view", str(path)])
    assert result.exit_code == 0, result.output
    page = path / "view.html" if path.is_dir() else path.with_suffix(".html")
    assert f"wrote {page}" in result.output
    return page


def test_eval_page_lists_filters_and_opens_trajectories(browser, eval_dir):
    records = read_jsonl(eval_dir / "trajectories.jsonl")
    page = Page(browser, _view(eval_dir).as_uri())
    assert page.shown() == len(records) == len(page.row_ids())
    assert "avg@2 pass@1" in page.page.inner_text("#summary")

    correct = sum(r["reward"] > 0.5 for r in records)
    assert 0 < correct < len(records)
    page.page.select_option("#f-correct", "1")
    page.wait_shown(correct)
    page.page.select_option("#f-correct", "")
    page.wait_shown(len(records))

    # search in code only: the call that divides by zero
    in_code = sum(any("1/0" in c["code"] for c in r["tool_calls"]) for r in records)
    page.page.select_option("#scope", "code")
    page.page.fill("#q", "1/0")
    page.wait_shown(in_code)
    assert 0 < in_code < len(records)

    # open it: its calls, their statuses and the tool's answers, and the reward
    page.page.click(".row >> nth=0")
    opened = records[page.row_ids()[0]]
    detail = page.page.locator("#detail")
    assert detail.locator(".call").count() >= len(opened["tool_calls"]) > 0
    statuses = page.page.eval_on_selector_all("#detail .call .status", "els => els.map(e => e.className)")
    assert sum("st-runtime_error" in s for s in statuses) == sum(
        c["status"] == "runtime_error" for c in opened["tool_calls"]
    )
    assert "ZeroDivisionError" in detail.locator("pre.response.st-runtime_error").first.inner_text()
    assert detail.locator("pre.code .numl").count() > 0  # the code is highlighted (1 and 0 are numbers)
    assert f"reward {opened['reward']:.1f}" in page.page.inner_text("#reward")
    assert opened["reference"] in page.page.inner_text("#detail .badges")
    assert "p_err" in page.page.inner_text("#roc")
    assert page.errors == []
    page.close()


def test_training_page_curves_jump_to_a_step(browser, train_dir):
    records = read_jsonl(train_dir / "trajectories.jsonl")
    page = Page(browser, _view(train_dir).as_uri())
    assert page.shown() == len(records)
    assert page.page.locator("#curves .chart").count() == 3
    # click step 2 on the reward curve: the table shows that step's trajectories only
    page.page.click("#curves .chart[data-key=reward] circle.hit >> nth=1", force=True)
    at_step_2 = [i for i, r in enumerate(records) if r["step"] == 2]
    page.wait_shown(len(at_step_2))
    assert sorted(page.row_ids()) == at_step_2
    assert page.page.inner_text("#step-label") == "step 2"
    # the slider moves to another step
    page.page.fill("#f-step", "2")
    page.page.dispatch_event("#f-step", "input")
    page.wait_shown(sum(r["step"] == 3 for r in records))
    # RoC's view of a dropped and of a kept trajectory
    page.page.select_option("#f-kept", "0")
    page.page.click(".row >> nth=0")
    assert "dropped" in page.page.inner_text("#roc")
    page.page.select_option("#f-kept", "1")
    page.page.click(".row >> nth=0")
    roc = page.page.inner_text("#roc")
    kept = records[page.row_ids()[0]]
    assert "kept" in roc and f"{kept['roc']['advantage']:.3f}" in roc and "p_total" in roc
    if os.environ.get("TIRL_VIEWER_SCREENSHOT"):  # the README's picture: make it with this harness
        page.page.click("#reset")
        page.page.click(".row >> nth=1")
        page.page.screenshot(path=os.environ["TIRL_VIEWER_SCREENSHOT"])
    assert page.errors == []
    page.close()


def _synthetic(n: int) -> list[dict]:
    """n trajectories shaped like real ones: turns with tool calls, tool responses, answers."""
    rows = []
    for i in range(n):
        calls, text = [], ""
        for turn in range(i % 4):
            status = STATUSES[(i + turn) % len(STATUSES)]
            code = f"n = {i}\nprint(sum(k * k for k in range(n)))  # case {i}"
            call = json.dumps({"name": "execute_python_code_with_standard_io", "arguments": {"code": code}})
            text += f"step {turn}: compute it <tool_call>{call}</tool_call>"
            response = "Traceback ... ValueError" if status == "runtime_error" else str(i * turn)
            text += tool_response_text([response], AgentConfig(), turn_closed=False)
            calls.append(ToolCallRecord(turn=turn, status=status, code=code))
        text += f"so the answer is <answer>\\boxed{{{i % 7}}}</answer><|im_end|>"
        traj = Trajectory(
            problem_id=f"p{i // 8}",
            prompt_ids=[0] * 40,
            response_ids=[1] * (20 + i % 300),
            loss_mask=[1] * (20 + i % 300),
            response_text=text,
            turns=i % 4 + 1,
            tool_calls=calls,
            answer_blocks=1,
            finish_reason="length" if i % 10 == 0 else "answered",
            reward=float(i % 7 == 3),
            sample_index=i % 8,
        )
        rows.append(
            {"benchmark": f"bench{i % 3}", "problem": f"Problem {i}", "reference": "3", **compact(traj)}
        )
    return rows


def test_ten_thousand_trajectories_open_and_filter(browser, tmp_path):
    rows = _synthetic(10_000)
    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = Page(browser, _view(path).as_uri())
    assert page.shown() == 10_000
    assert len(page.row_ids()) < 100  # virtualised: only the rows in sight exist
    page.page.select_option("#f-finish", "length")
    page.wait_shown(1000)
    page.page.select_option("#f-bench", "bench1")
    page.wait_shown(sum(i % 10 == 0 and i % 3 == 1 for i in range(10_000)))
    page.page.click("#reset")
    page.wait_shown(10_000)
    page.page.fill("#q", "# case 777")  # in the code of 777 and 7770-7779, where they made calls
    page.wait_shown(sum(i % 4 > 0 and f"# case {i}".startswith("# case 777") for i in range(10_000)))
    page.page.click("#reset")
    page.page.select_option("#f-tools", "timeout")
    with_timeout = sum(any(STATUSES[(i + t) % 5] == "timeout" for t in range(i % 4)) for i in range(10_000))
    page.wait_shown(with_timeout)
    # scroll to the end: the last rows are rendered on demand
    page.page.click("#reset")
    page.page.eval_on_selector("#scroll", "el => el.scrollTop = el.scrollHeight")
    page.page.wait_for_selector('.row[data-id="9999"]')
    page.page.click('.row[data-id="9999"]')
    assert "Problem 9999" in page.page.inner_text("#detail")
    assert page.errors == []
    page.close()


def test_serve_serves_the_page_on_localhost(browser, eval_dir, tmp_path):
    out = tmp_path / "served.html"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tirl.cli",
            "view",
            str(eval_dir),
            "--out",
            str(out),
            "--serve",
            "--port",
            "0",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": SRC},
    )
    try:
        assert proc.stdout.readline().startswith(f"wrote {out}")
        line = proc.stdout.readline()
        assert line.startswith("serving http://127.0.0.1:"), line
        url = line.split()[1]
        page = Page(browser, url)
        assert page.shown() == len(read_jsonl(eval_dir / "trajectories.jsonl"))
        assert page.errors == []
        page.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
