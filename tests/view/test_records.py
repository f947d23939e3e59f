"""What the viewer makes of stored trajectories (no browser): turns, tool calls, statuses, RoC, errors;
then the records of hand-built trajectories, no model (see docs/mutation.md)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import yaml
from tests.jsonl import read_jsonl, write_jsonl
from typer.testing import CliRunner

from tirl.agent import AgentConfig
from tirl.agent.protocol import tool_response_text
from tirl.agent.trajectory import ToolCallRecord, Trajectory, turn_token_counts
from tirl.cli import app
from tirl.rl.grpo import group_advantages
from tirl.rl.roc import penalties
from tirl.view import ViewError, load_source, view_record
from tirl.view.records import (
    _CLOSE,
    _HEAD,
    UNPLACED_NOTE,
    Source,
    _gaps,
    _is_segment,
    _prefill,
    _read_yaml,
    _segment_responses,
    place_turns,
    split_turns,
    view_turns,
)
from tirl.view.report import build_html

# The session fixtures (teach the tiny model, a real eval, a real training run) set up inside the first
# test that needs them; on a busy shared machine that alone can take minutes.
pytestmark = pytest.mark.timeout(900)


def test_turn_token_counts_follow_the_loss_mask_runs():
    assert turn_token_counts([1, 1, 0, 0, 0, 1, 1, 1, 0, 1]) == [(2, 3), (3, 1), (1, 0)]
    assert turn_token_counts([]) == []


def test_eval_records_split_into_turns_with_their_calls(eval_dir):
    raws = read_jsonl(eval_dir / "trajectories.jsonl")
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
    rows = read_jsonl(train_dir / "trajectories.jsonl")
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
    metrics = read_jsonl(train_dir / "metrics.jsonl")
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


# ---- from hand-built trajectories, no model: turns split at the tool-response segments the agent
# writes, each parsed call paired with its own record (by turn, by malformed-or-not, by code; records
# arrive out of order), responses in order, the counts and penalties shown, and what load_source reads
# from each kind of path ----

NAME = "execute_python_code_with_standard_io"
CFG = AgentConfig()


def call(code: str, stdin: str | None = None) -> str:
    args = {"code": code} if stdin is None else {"code": code, "input": stdin}
    return f"<tool_call>{json.dumps({'name': NAME, 'arguments': args})}</tool_call>"


def segment(*responses: str, closed: bool = False) -> str:
    return tool_response_text(list(responses), CFG, turn_closed=closed)


def traj(text: str, calls: list[ToolCallRecord], mask=None, **kw) -> Trajectory:
    mask = mask if mask is not None else [1, 1, 0, 1]
    return Trajectory("p1", [1, 2, 3], [7] * len(mask), mask, response_text=text, tool_calls=calls, **kw)


def parts_of(turn: dict, kind: str) -> list:
    return [p for k, p in turn["parts"] if k == kind]


def test_turns_split_at_each_segment_and_calls_pair_with_their_records():
    text = (
        "think "
        + call("print(1)")
        + " mid "
        + call("print(2)", "x")
        + segment("1", "2")
        + "again "
        + call("print(3)")
        + segment("boom", closed=True)
        + "done <answer>\\boxed{3}</answer>"
    )
    records = [  # appended as calls finished: not in the text's order
        ToolCallRecord(turn=0, status="runtime_error", code="print(2)", wall_ms=5.0),
        ToolCallRecord(turn=1, status="timeout", code="print(3)", wall_ms=9.0),
        ToolCallRecord(turn=0, status="ok", code="print(1)", wall_ms=3.0),
    ]
    t = traj(text, records, mask=[1, 1, 0, 0, 1, 0, 1, 1, 1])
    turns = split_turns(t, [(2, 2), (1, 1), (3, 0)], {})
    assert [(x["gen"], x["tool"]) for x in turns] == [(2, 2), (1, 1), (3, 0)]
    first, second, third = turns
    assert first["parts"][0] == ["text", "think "]
    assert parts_of(first, "text") == ["think ", " mid "]
    c1, c2 = parts_of(first, "call")
    assert c1 == {"status": "ok", "wall_ms": 3.0, "response": "1", "code": "print(1)", "input": ""}
    assert c2 == {
        "status": "runtime_error",
        "wall_ms": 5.0,
        "response": "2",
        "code": "print(2)",
        "input": "x",
    }
    assert second["parts"][0] == ["text", CFG.prefill + "again "]
    [c3] = parts_of(second, "call")
    assert (c3["status"], c3["wall_ms"], c3["response"]) == ("timeout", 9.0, "boom")
    assert second["parts"][-1][0] == "call"  # nothing after the call in that turn
    assert third["parts"] == [["text", CFG.prefill + "done <answer>\\boxed{3}</answer>"]]


def test_turns_beyond_the_token_counts_and_responses_show_unknowns():
    text = call("print(1)") + segment("1") + call("print(2)")
    t = traj(text, [ToolCallRecord(turn=0, status="ok", code="print(1)")])
    turns = split_turns(t, [(3, 1)], {})
    assert (turns[1]["gen"], turns[1]["tool"]) == (None, None)
    [c] = parts_of(turns[1], "call")
    assert c["status"] == "not_run" and c["wall_ms"] is None and c["response"] is None


def test_same_code_twice_takes_records_in_order_and_other_turns_are_not_borrowed():
    text = call("x") + call("x") + segment("a", "b") + call("x")
    records = [
        ToolCallRecord(turn=1, status="ok", code="x", wall_ms=30.0),
        ToolCallRecord(turn=0, status="ok", code="x", wall_ms=10.0),
        ToolCallRecord(turn=0, status="runtime_error", code="x", wall_ms=20.0),
    ]
    turns = split_turns(traj(text, records), [(1, 1), (1, 0)], {})
    assert [c["wall_ms"] for c in parts_of(turns[0], "call")] == [10.0, 20.0]
    assert [c["wall_ms"] for c in parts_of(turns[1], "call")] == [30.0]


def test_a_call_without_an_exact_code_match_takes_a_record_of_its_turn():
    text = call("print(1)")
    records = [ToolCallRecord(turn=0, status="malformed", code="junk"), ToolCallRecord(0, "ok", "other", 4.0)]
    [c] = parts_of(split_turns(traj(text, records), [(1, 0)], {})[0], "call")
    assert (c["status"], c["wall_ms"], c["code"]) == ("ok", 4.0, "print(1)")


def test_malformed_calls_pair_with_malformed_records_only():
    bad = "<tool_call>{oops}</tool_call>"
    text = "a " + bad + " b " + call("print(1)")
    records = [
        ToolCallRecord(turn=0, status="ok", code="print(1)", wall_ms=2.0),
        ToolCallRecord(turn=0, status="malformed", code="{oops}", wall_ms=0.0),
    ]
    turn = split_turns(traj(text, records), [(1, 0)], {})[0]
    m, ok = parts_of(turn, "call")
    assert m["status"] == "malformed" and m["code"] == "{oops}" and "invalid JSON" in m["parse_error"]
    assert "input" not in m
    assert ok["status"] == "ok" and "parse_error" not in ok
    assert parts_of(turn, "text") == ["a ", " b "]
    # without its record, a malformed call shows its own text and is not_run
    [alone] = parts_of(split_turns(traj(bad, []), [(1, 0)], {})[0], "call")
    assert alone["status"] == "not_run" and alone["code"] == bad


def test_the_agent_config_limits_and_schemas_are_the_ones_parsed_with():
    text = call("print(1)") + call("print(2)")
    records = [ToolCallRecord(0, "ok", "print(1)"), ToolCallRecord(0, "malformed", "")]
    turn = split_turns(traj(text, records), [(1, 0)], {"max_calls_per_turn": 1})[0]
    first, second = parts_of(turn, "call")
    assert first["status"] == "ok" and second["status"] == "malformed"
    assert "only 1 tool call(s) per turn" in second["parse_error"]
    schema = {"type": "function", "function": {"name": "calc", "parameters": {"properties": {"e": {}}}}}
    own = '<tool_call>{"name": "calc", "arguments": {"e": "1+1"}}</tool_call>'
    [c] = parts_of(split_turns(traj(own, []), [(1, 0)], {"tool_schema": schema})[0], "call")
    assert "parse_error" not in c and c["code"] == json.dumps({"e": "1+1"})


def test_view_record_fields():
    own = [call("print(1)"), "<answer>\\boxed{1}</answer><answer>2</answer>"]
    text = own[0] + segment("1") + own[1]
    records = [ToolCallRecord(0, "runtime_error", "print(1)", 1.0), ToolCallRecord(0, "ok", "y", 2.0)]
    raw = traj(
        text,
        records,
        model_turns=own,
        mask=[1, 1, 0, 1, 1],
        turns=2,
        answer_blocks=2,
        reward=1.0,
        error="e",
        finish_reason="answered",
        gen_seconds=1.23456,
        tool_wait_seconds=0.98765,
        sample_index=3,
    ).to_dict()
    raw |= {"benchmark": "aime", "step": 4, "problem": "P?", "reference": "1", "roc": {"no_tool_p_err": 0.2}}
    v = view_record(raw, 5)
    assert (v["id"], v["bench"], v["step"], v["pid"], v["sample"]) == (5, "aime", 4, "p1", 3)
    assert (v["problem"], v["reference"], v["answer"], v["reward"]) == ("P?", "1", "1", 1.0)
    assert (v["finish"], v["error"], v["ncalls"], v["nerr"]) == ("answered", "e", 2, 1)
    assert v["statuses"] == {"runtime_error": 1, "ok": 1}
    assert (v["len"], v["gen"], v["prompt_len"]) == (5, 4, 3)
    assert (v["p_err"], v["p_format"], v["p_total"]) == (0.5, 0.5, 1.0)
    assert (v["gen_s"], v["tool_s"], v["roc"]) == (1.235, 0.988, {"no_tool_p_err": 0.2})
    assert len(v["turns"]) == 2 and (v["turns"][0]["gen"], v["turns"][0]["tool"]) == (2, 1)


def test_view_record_defaults_and_stored_values():
    raw = traj("no tools, no answer", [], mask=[1, 1], turns=1, answer_blocks=1).to_dict()
    raw |= {"prompt_ids": [], "prompt_tokens": 17, "turn_tokens": [[5, 0]], "answer": "stored"}
    v = view_record(raw, 0)
    assert (v["bench"], v["step"], v["problem"], v["reference"], v["roc"]) == ("", None, "", None, None)
    assert v["answer"] == "stored" and v["prompt_len"] == 17 and (v["len"], v["gen"]) == (5, 5)
    assert v["p_err"] == 0.5 and v["statuses"] == {}  # no call: RoC's default p_err
    raw["roc"] = {"no_tool_p_err": 0.0}
    assert view_record(raw, 0)["p_err"] == 0.0
    del raw["answer"]
    assert view_record(raw, 0)["answer"] is None


def test_a_record_that_is_not_a_trajectory_is_a_view_error():
    with pytest.raises(ViewError) as err:
        view_record({"problem_id": "a", "prompt_ids": [], "bogus": 1, "tool_calls": [{"x": 1}]}, 2)
    assert str(err.value).startswith("trajectory #3 is not a tirl trajectory record: ")


def test_load_source_reads_each_kind_of_path(tmp_path):
    row = traj("x", []).to_dict()
    bare = tmp_path / "some.jsonl"
    write_jsonl(bare, [row, row])
    assert load_source(str(bare)) == Source("trajectories", bare, [row, row])

    run = tmp_path / "run"
    run.mkdir()
    write_jsonl(run / "metrics.jsonl", [{"step": 1}, {"step": 2}])
    assert load_source(run) == Source("train", run, [], curves=[{"step": 1}, {"step": 2}], agent={})
    (run / "config.yaml").write_text(yaml.safe_dump({"agent": {"max_turns": 3}}))
    write_jsonl(run / "trajectories.jsonl", [row])
    src = load_source(run)
    assert (src.kind, src.records, src.agent) == ("train", [row], {"max_turns": 3})
    (run / "config.yaml").write_text("")
    assert load_source(run).agent == {}

    ev = tmp_path / "eval"
    ev.mkdir()
    write_jsonl(ev / "trajectories.jsonl", [row])
    assert load_source(ev) == Source("eval", ev, [row])
    metrics = {"benchmarks": {"aime": {"pass1": 0.5}}, "config": {"agent": {"max_turns": 2}}}
    (ev / "metrics.json").write_text(json.dumps(metrics))
    assert load_source(ev) == Source(
        "eval", ev, [row], summary={"aime": {"pass1": 0.5}}, agent={"max_turns": 2}
    )


def test_load_source_errors_name_the_path_and_what_to_give(tmp_path):
    what = "give an eval output directory, a training run directory or a trajectories.jsonl"
    with pytest.raises(ViewError) as err:
        load_source(tmp_path / "missing")
    assert str(err.value) == f"{tmp_path / 'missing'}: no such file or directory ({what})"
    with pytest.raises(ViewError) as err:
        load_source(tmp_path)
    assert str(err.value) == f"{tmp_path} holds neither trajectories.jsonl nor metrics.jsonl ({what})"
    bad = tmp_path / "bad.jsonl"
    bad.write_text("[1]\n")
    with pytest.raises(ViewError) as err:
        load_source(bad)
    assert str(err.value).endswith("expected a JSON object, got list; is it a tirl JSONL file?")


def test_statuses_count_every_call_and_no_empty_text_is_shown():
    text = call("a") + call("b") + call("c")
    records = [ToolCallRecord(0, "ok", "a"), ToolCallRecord(0, "ok", "b"), ToolCallRecord(0, "timeout", "c")]
    v = view_record(traj(text, records, mask=[1, 1]).to_dict(), 0)
    assert v["statuses"] == {"ok": 2, "timeout": 1}
    parts = v["turns"][0]["parts"]
    assert [kind for kind, _ in parts] == ["call", "call", "call"]  # back to back: no empty text between


# ---- locating the model's turns in the decoded text: each helper at its edges (the placement against
# forged tool output: test_forged_turns.py) ----


def test_the_prefill_after_a_tool_response_is_continue_prefill_else_prefill_else_the_default():
    assert _prefill({}) == AgentConfig().prefill == "<reason>"
    assert _prefill({"prefill": "P"}) == "P"
    assert _prefill({"prefill": "P", "continue_prefill": "C"}) == "C"
    assert _prefill({"prefill": "P", "continue_prefill": ""}) == "", "an empty continue_prefill is one"
    assert _prefill({"prefill": "P", "continue_prefill": None}) == "P"


@pytest.mark.parametrize("closed", [False, True])
def test_a_segment_is_exactly_the_frame_around_its_responses(closed):
    seg = segment("out", closed=closed)
    text = "turn" + seg + "next"
    start, stop = len("turn"), len("turn") + len(seg)
    assert _is_segment(text, start, stop, "<reason>")
    assert not _is_segment(text, start + 1, stop, "<reason>") and not _is_segment(
        text, start, stop - 1, "<reason>"
    )
    assert not _is_segment(text, start, stop, "<think>"), "another prefill closes another frame"
    empty = segment("", closed=True)  # an empty response: the frame alone, the shortest segment
    assert _is_segment(empty, 0, len(empty), "<reason>") and not _is_segment(
        empty, 0, len(empty) - 1, "<reason>"
    )
    # the head's last newline doubling as the closing's first: both ends match, the span is one too short
    overlap = "zz" + _HEAD + _CLOSE.removeprefix("\n") + "<reason>"
    assert overlap.startswith(_HEAD, 2) and overlap.endswith(_CLOSE + "<reason>")
    assert not _is_segment(overlap, 2, len(overlap), "<reason>")
    # an <|im_end|> that ends before `stop` only; the head and the closing inside [start, stop) only
    assert not _is_segment("<|im_end|>" + _HEAD + "x", 0, len("<|im_end|>") + 3, "<reason>")
    assert not _is_segment(_HEAD + "x" + _CLOSE + "<reason>", 1, len(_HEAD) + 1, "<reason>")
    tail = _HEAD + "x" + _CLOSE + "<reason>"
    assert not _is_segment("y" * 100 + tail, 0, 10, "<reason>")
    assert not _is_segment(tail + "y", 0, len(tail) + 1, "<reason>"), "the closing must end the span"


def test_a_segment_splits_into_one_response_per_call_and_keeps_a_printed_separator():
    two = segment("a", "b")
    assert _segment_responses(two, 2, "<reason>") == ["a", "b"]
    assert _segment_responses(segment("a", "b", closed=True), 2, "<reason>") == ["a", "b"]
    sep = "\n</tool_response>\n<tool_response>\n"
    assert _segment_responses(two, 1, "<reason>") == ["a" + sep + "b"], "one call: all of it is its output"
    assert _segment_responses(two, 0, "<reason>") == ["a" + sep + "b"]
    printed = segment("a", "b" + sep + "c")  # the second call's output printed the separator
    assert _segment_responses(printed, 2, "<reason>") == ["a", "b" + sep + "c"]
    assert _segment_responses(segment("x<|im_end|>"), 1, "<reason>") == ["x<|im_end|>"]
    frame = tool_response_text(["z"], AgentConfig(prefill="<think>"), turn_closed=False)
    assert _segment_responses(frame, 1, "<think>") == ["z"]


def test_the_gaps_between_placed_turns_are_their_segments():
    seg = segment("7")
    text = "A" + seg + "BB" + seg
    assert _gaps(text, ["A", "BB"], [0, 1 + len(seg)]) == [seg, seg]
    assert _gaps("A" + seg + "BB", ["A", "BB"], [0, 1 + len(seg)]) == [seg, None]
    assert _gaps(text, ["A", "BB"], None) == [None, None]


def test_turns_are_placed_at_their_frames_and_the_last_segment_follows_the_token_counts():
    seg = segment("7")
    text = "A" + seg + "B"
    assert place_turns(text, ["A", "B"], "<reason>", False) == [0, 1 + len(seg)]
    assert place_turns(text, ["A", "B"], "<reason>", None) == [0, 1 + len(seg)]
    assert place_turns(text, ["A", "B"], "<reason>", True) is None, "no segment follows the last turn"
    trailing = text + seg
    assert place_turns(trailing, ["A", "B"], "<reason>", True) == [0, 1 + len(seg)]
    assert place_turns(trailing, ["A", "B"], "<reason>", False) is None
    assert place_turns(text, [], "<reason>", None) is None
    assert place_turns("x" + text, ["A", "B"], "<reason>", None) is None, "the first turn starts the text"
    assert place_turns(text, ["A", "C"], "<reason>", None) is None
    assert place_turns("A", ["A"], "<reason>", False) == [0]


def test_a_turn_is_placed_after_a_tool_output_that_prints_the_frame():
    """The first closing the search meets is inside the tool's output: the turn goes after the real one."""
    fake = _CLOSE + "<reason>" + "B"
    seg = segment("x" + fake + "y")
    text = "A" + seg + "B"
    assert place_turns(text, ["A", "B"], "<reason>", False) == [0, len(text) - 1]
    turns = ["A", "B", "C"]  # three turns, the middle one also printed by the first tool
    text3 = "A" + seg + "B" + segment("1") + "C"
    assert place_turns(text3, turns, "<reason>", False) == [0, 1 + len(seg), 2 + len(seg) + len(segment("1"))]


def test_a_run_config_that_is_not_yaml_or_not_utf8_is_one_line(tmp_path):
    bad = tmp_path / "config.yaml"
    bad.write_text("agent: [unclosed\n")
    with pytest.raises(ViewError) as err:
        _read_yaml(bad)
    assert str(err.value).startswith(f"{bad}: not valid YAML (while parsing a flow sequence") and str(
        err.value
    ).endswith("); is it a tirl run?")
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"agent:\n  system_prompt: caf\xe9\n")  # a byte that is not UTF-8
    assert _read_yaml(latin) == {"agent": {"system_prompt": "caf\ufffd"}}
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1")
    assert _read_yaml(tmp_path / "none.yaml") == {} and _read_yaml(listed) == {}


def test_a_placement_search_stops_at_its_budget_of_candidate_ends(monkeypatch):
    """Each closing the search examines costs one try: a record that needs two is placed on a budget of
    two and shown unplaced on one."""
    import tirl.view.records as records

    seg = segment("x" + _CLOSE + "<reason>" + "B" + "y")  # the tool printed a closing then "B"
    text = "A" + seg + "B"
    for budget, want in [(2, [0, len(text) - 1]), (1, None)]:
        monkeypatch.setattr(records, "_PLACE_TRIES", budget)
        assert place_turns(text, ["A", "B"], "<reason>", False) == want, budget


def test_text_after_the_last_turn_is_placed_only_when_it_is_a_segment():
    seg = segment("7")
    assert place_turns("A" + seg + "B" + "junk", ["A", "B"], "<reason>", None) is None
    assert place_turns("A" + seg + "B" + seg, ["A", "B"], "<reason>", None) == [0, 1 + len(seg)]


def test_the_token_counts_say_whether_a_segment_follows_the_last_turn():
    """tokens[k] = (generated, tool response) of turn k: a tool count after the last turn means a
    segment is there; none means the text must end with the turn; no counts, either."""
    seg = segment("7")
    text = "A" + seg + "B" + seg  # an infrastructure error's response after the last turn
    record = traj(text, [], mask=[1], model_turns=["A", "B"])
    for tokens, note in [([(1, 5), (1, 1)], ""), ([(1, 5), (1, 0)], UNPLACED_NOTE), ([(1, 5)], "")]:
        turns, said = view_turns(record, tokens, {})
        assert said == note and len(turns) == 2, tokens
    ends = traj("A" + seg + "B", [], mask=[1], model_turns=["A", "B"])
    assert view_turns(ends, [(1, 5), (1, 1)], {})[1] == UNPLACED_NOTE
    assert view_turns(ends, [(1, 5), (1, 0)], {})[1] == ""


def test_no_turns_show_nothing_and_one_turn_shows_itself():
    assert view_turns(traj("", [], mask=[], model_turns=[]), [], {}) == ([], "")
    turns, note = view_turns(traj("only", [], mask=[1], model_turns=["only"]), [(1, 0)], {})
    assert note == "" and [t["parts"] for t in turns] == [[["text", "only"]]]


def test_a_jsonl_file_that_is_not_utf8_is_read_line_by_line(tmp_path):
    """Bytes that are not UTF-8 read as U+FFFD; blank lines are skipped; errors name their line."""
    good = tmp_path / "t.jsonl"
    good.write_bytes(b'{"a": "caf\xe9"}\n\n  \n{"b": 2}\n')
    assert load_source(good).records == [{"a": "caf\ufffd"}, {"b": 2}]
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"a": "\xe9"}\n\n{"b": \n')
    with pytest.raises(ViewError) as err:
        load_source(bad)
    assert str(err.value) == f"{bad}:3: not valid JSON (Expecting value); is it a tirl JSONL file?"
    listed = tmp_path / "list.jsonl"
    listed.write_bytes(b'{"a": "\xe9"}\n[1]\n')
    with pytest.raises(ViewError) as err:
        load_source(listed)
    assert str(err.value) == f"{listed}:2: expected a JSON object, got list"


def test_an_eval_summary_that_is_not_utf8_or_not_json(tmp_path):
    (tmp_path / "trajectories.jsonl").write_text("")
    (tmp_path / "metrics.json").write_bytes(b'{"benchmarks": {"b\xe9": {"pass1": 0.5}}}')
    assert load_source(tmp_path).summary == {"b\ufffd": {"pass1": 0.5}}
    (tmp_path / "metrics.json").write_text("{not json")
    with pytest.raises(ViewError) as err:
        load_source(tmp_path)
    assert str(err.value) == (
        f"{tmp_path / 'metrics.json'}: not valid JSON (Expecting property name enclosed in double quotes); "
        "is it a tirl eval output?"
    )


def test_the_models_own_turns_are_parsed_with_the_agent_config_and_read_the_prefill_first():
    """The model_turns path (every record written since they exist): the per-turn call limit and the
    tool schema the run used; after a segment, the frame's prefill is the next turn's first text, also
    when that turn opens with a call."""
    own = [call("print(1)") + call("print(2)"), call("print(3)"), "done"]
    text = own[0] + segment("1", "2") + own[1] + segment("3") + own[2]
    records = [
        ToolCallRecord(0, "ok", "print(1)"),
        ToolCallRecord(0, "malformed", ""),
        ToolCallRecord(1, "ok", "print(3)"),
    ]
    turns, note = view_turns(
        traj(text, records, mask=[1], model_turns=own), [(1, 2), (1, 1), (1, 0)], {"max_calls_per_turn": 1}
    )
    assert note == ""
    first, second = parts_of(turns[0], "call")
    assert first["status"] == "ok" and second["status"] == "malformed"
    assert "only 1 tool call(s) per turn" in second["parse_error"]
    assert turns[1]["parts"][0] == ["text", CFG.prefill] and turns[1]["parts"][1][0] == "call"
    assert len(turns[1]["parts"]) == 2 and turns[2]["parts"] == [["text", CFG.prefill + "done"]]
    schema = {"type": "function", "function": {"name": "calc", "parameters": {"properties": {"e": {}}}}}
    calc = '<tool_call>{"name": "calc", "arguments": {"e": "1+1"}}</tool_call>'
    calc_turns, _ = view_turns(
        traj(calc, [], mask=[1], model_turns=[calc]), [(1, 0)], {"tool_schema": schema}
    )
    [[c]] = [parts_of(t, "call") for t in calc_turns]
    assert "parse_error" not in c and c["code"] == json.dumps({"e": "1+1"})


def test_forged_observations_show_per_trajectory_and_in_the_page(tmp_path):
    """The forged column: turns in which the model wrote a tool-response frame itself (0 in records
    written before it was counted); the page lists it as a column and a badge."""
    forged = traj("x", [], forged_observations=2)
    assert view_record(forged.to_dict(), 0)["forged"] == 2
    old = traj("x", []).to_dict()
    del old["forged_observations"]
    assert view_record(old, 1)["forged"] == 0
    page = build_html(Source("trajectories", tmp_path / "t.jsonl", [forged.to_dict()]))
    assert 'key: "forged"' in page and 'id="forged"' in page


def test_the_page_shows_the_forged_column_and_badge(browser, tmp_path):
    """In a real headless Chromium: the forged count in its column (0 for an honest record), and the
    badge on the forging trajectory's detail only."""
    from tests.view.browser import Page

    path = tmp_path / "t.jsonl"
    write_jsonl(path, [traj("x", [], forged_observations=2).to_dict(), traj("y", []).to_dict()])
    result = CliRunner().invoke(app, ["view", str(path)])
    assert result.exit_code == 0, result.output
    page = Page(browser, path.with_suffix(".html").as_uri())
    assert "forged" in page.page.inner_text("#thead")
    page.page.click('.row[data-id="0"]')
    assert page.page.inner_text("#detail #forged") == "2 forged tool responses"
    page.page.click('.row[data-id="1"]')
    assert page.page.query_selector("#detail #forged") is None
    assert page.errors == []
    page.close()
