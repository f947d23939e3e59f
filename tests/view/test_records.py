"""What the viewer makes of stored trajectories (no browser): turns, tool calls, statuses, RoC, errors."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from typer.testing import CliRunner

from tirl.agent.trajectory import Trajectory, turn_token_counts
from tirl.cli import app
from tirl.rl.grpo import group_advantages
from tirl.rl.roc import penalties
from tirl.view import ViewError, load_source, view_record
from tirl.view.report import build_html

# The session fixtures (teach the tiny model, a real eval, a real training run) set up inside the first
# test that needs them; on a busy shared machine that alone can take minutes.
pytestmark = pytest.mark.timeout(900)


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_turn_token_counts_follow_the_loss_mask_runs():
    assert turn_token_counts([1, 1, 0, 0, 0, 1, 1, 1, 0, 1]) == [(2, 3), (3, 1), (1, 0)]
    assert turn_token_counts([]) == []


def test_eval_records_split_into_turns_with_their_calls(eval_dir):
    raws = _lines(eval_dir / "trajectories.jsonl")
    source = load_source(eval_dir)
    assert source.kind == "eval" and len(source.records) == len(raws) == 6
    views = [view_record(raw, i, source.agent) for i, raw in enumerate(raws)]
    seen_statuses = Counter()
    for raw, view in zip(raws, views, strict=True):
        traj = Trajectory.from_dict(raw)
        assert len(view["turns"]) == traj.turns
        # every response token is in exactly one turn, generated or tool response
        assert sum(t["gen"] + t["tool"] for t in view["turns"]) == len(raw["response_ids"]) == view["len"]
        assert view["gen"] == sum(raw["loss_mask"])
        calls = [p for t in view["turns"] for kind, p in t["parts"] if kind == "call"]
        executed = [c for c in calls if c["status"] != "not_run"]
        assert Counter(c["status"] for c in executed) == Counter(r["status"] for r in raw["tool_calls"])
        for c in executed:
            assert c["response"] is not None  # each executed call shows the tool's answer
        seen_statuses.update(c["status"] for c in executed)
        texts = [p for t in view["turns"] for kind, p in t["parts"] if kind == "text"]
        assert all(text in raw["response_text"] for text in texts)
        assert "<tool_response>" not in "".join(texts)  # tool responses are shown with their calls
        p = penalties(traj)
        assert (view["p_err"], view["p_format"], view["reward"]) == (p.p_err, p.p_format, raw["reward"])
        assert view["problem"] and view["reference"] == raw["reference"]
    # the taught model made a clean call, a malformed one and one that raised
    assert {"ok", "malformed", "runtime_error"} <= set(seen_statuses)
    fix = next(v for v in views if v["pid"] == "fix")
    first = next(p for kind, p in fix["turns"][0]["parts"] if kind == "call")
    assert first["status"] == "malformed" and "must be a JSON string" in first["parse_error"]
    raised = next(p for kind, p in fix["turns"][1]["parts"] if kind == "call")
    assert raised["code"] == "x = 1/0\nprint(x)" and "ZeroDivisionError" in raised["response"]


def test_training_run_writes_a_bounded_sample_with_roc(train_dir):
    rows = _lines(train_dir / "trajectories.jsonl")
    steps = Counter(r["step"] for r in rows)
    assert steps == {1: 4, 2: 4, 3: 4}  # 2 prompts x 2G = 8 rollouts per step, 4 written
    for r in rows:
        assert "response_ids" not in r and "logprobs" not in r  # small on disk
        roc = r["roc"]
        p = penalties(Trajectory.from_dict(r))
        assert (roc["p_err"], roc["p_format"], roc["p_total"]) == (p.p_err, p.p_format, p.p_total)
        assert roc["group_size"] == 4 and roc["group_kept"] == 2
        assert roc["kept"] == (roc["advantage"] is not None)
        assert sum(g + t for g, t in r["turn_tokens"]) <= 300
    # a group's kept members have the GRPO advantages of their rewards
    for members in _by_group(rows).values():
        kept = [m for m in members if m["roc"]["kept"]]
        if len(kept) == 2:
            assert [m["roc"]["advantage"] for m in kept] == pytest.approx(
                group_advantages([m["reward"] for m in kept])
            )
    metrics = _lines(train_dir / "metrics.jsonl")
    page = build_html(load_source(train_dir))
    assert page.count('"step":') >= len(rows) + len(metrics)


def _by_group(rows):
    groups = {}
    for r in rows:
        groups.setdefault((r["step"], r["roc"]["group"]), []).append(r)
    return groups


def test_page_escapes_text_that_would_close_its_script(tmp_path):
    traj = Trajectory("p", [1], [2], [1], [0.0], response_text="</script><script>alert(1)</script>", turns=1)
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(traj.to_dict()) + "\n")
    page = build_html(load_source(path))
    assert page.count("</script>") == 2  # the data block's and the code's own, none from the data


def test_bad_paths_are_one_clear_error(tmp_path):
    with pytest.raises(ViewError, match="no such file or directory"):
        load_source(tmp_path / "missing")
    with pytest.raises(ViewError, match=r"neither trajectories\.jsonl nor metrics\.jsonl"):
        load_source(tmp_path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem_id": "a", "prompt_ids": []}\nnot json\n')
    with pytest.raises(ViewError, match=r"bad.jsonl:2: not valid JSON"):
        load_source(bad)
    result = CliRunner().invoke(app, ["view", str(bad)])
    assert result.exit_code == 2 and result.output.startswith("error: ") and "bad.jsonl:2" in result.output
    assert not (tmp_path / "bad.html").exists()
