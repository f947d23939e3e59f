"""`tirl eval` and `tirl chat` end to end: tiny real model, real sandbox service, real math-verify."""

import json
import re
import statistics

from typer.testing import CliRunner

from tirl.cli import app
from tirl.reward import score

PROBLEMS = [
    {"id": "add", "problem": "What is 2+3?", "answer": "5"},
    {"id": "mul", "problem": "What is 7*6?", "answer": "42"},
    {"id": "half", "problem": "Compute 1/2+1/2.", "answer": "1"},
]


def test_eval_writes_consistent_report(tiny_model_dir, tmp_path):
    data = tmp_path / "three.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    out = tmp_path / "run"
    args = [
        "eval",
        "--model",
        str(tiny_model_dir),
        "--data",
        str(data),
        "--samples",
        "2",
        "--max-tokens",
        "48",
        "--max-turns",
        "3",
        "--out",
        str(out),
        "--reward-workers",
        "1",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output

    metrics = json.loads((out / "metrics.json").read_text())["benchmarks"]["three"]
    trajs = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert sorted((t["problem_id"], t["sample_index"]) for t in trajs) == sorted(
        (p["id"], j) for p in PROBLEMS for j in range(2)
    )
    references = {p["id"]: p["answer"] for p in PROBLEMS}
    for t in trajs:
        assert t["benchmark"] == "three" and t["reference"] == references[t["problem_id"]]
        assert len(t["response_ids"]) == len(t["loss_mask"]) == len(t["logprobs"]) <= 48
        scored = t["finish_reason"] not in ("length", "error")
        assert t["reward"] == (score(t["response_text"], t["reference"]) if scored else 0.0)
    assert (metrics["problems"], metrics["samples"]) == (3, 2)
    assert metrics["pass1"] == statistics.mean(t["reward"] for t in trajs)
    assert metrics["mean_response_tokens"] == statistics.mean(len(t["response_ids"]) for t in trajs)
    assert metrics["tool_calls_per_trajectory"] == statistics.mean(len(t["tool_calls"]) for t in trajs)
    assert sum(metrics["finish_reasons"].values()) == 6
    for pid in references:
        votes = [t for t in trajs if t["problem_id"] == pid]
        has_answer = any(t["answer"] is not None for t in votes)
        assert sum(t["majority"] for t in votes) == int(has_answer)
    report = (out / "report.md").read_text()
    assert "| three | 3 |" in report and "avg@2 pass@1" in report
    assert re.search(
        r"\nAnswer checks: \d+ responses scored \(\d+ without a boxed answer\); \d+ answer", report
    )
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["total_seconds"] > saved["seconds"] > 0  # start-up is counted, and said apart
    said = re.search(r"Wall time: ([\d.]+) s in all: ", report)  # rounded once for people
    assert said and abs(float(said.group(1)) - saved["total_seconds"]) <= 0.05 + 1e-9
    assert "| three | 3 |" in result.output


def test_eval_bad_data_is_a_clear_error_and_leaves_no_empty_out(tiny_model_dir, tmp_path):
    out = tmp_path / "runs" / "eval"
    result = CliRunner().invoke(
        app,
        ["eval", "--model", str(tiny_model_dir), "--data", str(tmp_path / "none.jsonl"), "--out", str(out)],
    )
    assert result.exit_code == 2
    assert "no such file" in result.output
    assert not (tmp_path / "runs").exists()  # created for the run, removed with it: nothing was written


def test_the_answer_checks_line_says_what_each_count_counts():
    """`fast` and `verified` count comparisons (scores and maj@k's grouping), so they may exceed the
    responses: the line says so instead of `responses 78 ... fast 82`."""
    from tirl.eval.report import answer_checks

    stats = {"responses": 78, "no_answer": 4, "fast": 82, "verified": 3, "timeouts": 1, "killed": 1}
    assert answer_checks(stats | {"errors": 0, "verify_s": 0.5}) == (
        "Answer checks: 78 responses scored (4 without a boxed answer); 85 answer comparisons (scores and "
        "maj@k's grouping): 82 decided as plain integers, 3 by math-verify in 0.50 s (1 timeouts, 1 killed, "
        "0 errors)."
    )


def test_chat_shows_the_trajectory_and_exits_on_eof(tiny_model_dir):
    args = ["chat", "--model", str(tiny_model_dir), "--max-tokens", "32", "--max-turns", "2"]
    result = CliRunner().invoke(app, args, input="What is 2+3?\n")
    assert result.exit_code == 0, result.output
    assert "turn 1" in result.output  # the model's first turn was shown
    assert "finish:" in result.output and "bye" in result.output


def test_eval_uses_the_agent_settings_saved_with_the_model(tiny_model_dir, tmp_path):
    """A model trained by tirl carries its protocol (tirl_agent.yaml); eval prompts it that way, says
    so, and a flag still overrides a budget."""
    import shutil

    from transformers import AutoTokenizer

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "tirl_agent.yaml").write_text(
        "max_turns: 1\nmax_response_tokens: 20\nsystem_prompt: Use the python tool.\nuse_chat_template: false\n"
    )
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps(PROBLEMS[0]) + "\n")
    args = ["eval", "--model", str(model), "--data", str(data), "--samples", "1", "--reward-workers", "1"]
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "saved"), "--max-tokens", "12"])
    assert result.exit_code == 0, result.output
    assert f"agent settings: saved with the model ({model / 'tirl_agent.yaml'})" in result.output
    (traj,) = [
        json.loads(line) for line in (tmp_path / "saved" / "trajectories.jsonl").read_text().splitlines()
    ]
    prompt = AutoTokenizer.from_pretrained(model).decode(traj["prompt_ids"])
    assert prompt.startswith("<|im_start|>system\nUse the python tool.")
    assert len(traj["response_ids"]) <= 12 and traj["turns"] == 1  # the flag beat the saved budget of 20

    paper = tmp_path / "paper.yaml"
    paper.write_text("max_turns: 1\nmax_response_tokens: 8\n")
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "given"), "--agent", str(paper)])
    assert result.exit_code == 0, result.output
    assert "agent settings: as given" in result.output
    (traj,) = [
        json.loads(line) for line in (tmp_path / "given" / "trajectories.jsonl").read_text().splitlines()
    ]
    assert "Use the python tool." not in AutoTokenizer.from_pretrained(model).decode(traj["prompt_ids"])


def test_eval_input_errors_are_one_line_before_any_work(tiny_model_dir, tmp_path):
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps(PROBLEMS[0]) + "\n")
    blocker = tmp_path / "file"
    blocker.write_text("")
    cases = [
        (["--model", str(tmp_path / "runs" / "nope" / "model"), "--data", str(data)], "no such directory"),
        (["--model", str(tiny_model_dir), "--data", str(data), "--out", str(blocker / "x")], "cannot write"),
        (["--model", str(tiny_model_dir), "--data", str(data), "--samples", "0"], "--samples"),
    ]
    for args, message in cases:
        result = CliRunner().invoke(app, ["eval", *args])
        assert result.exit_code == 2 and message in result.output, result.output
        assert "Traceback" not in result.output


def test_eval_prompt_longer_than_the_context_fails_before_any_rollout(tiny_model_dir, tmp_path):
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps(PROBLEMS[0]) + "\n")
    args = ["eval", "--model", str(tiny_model_dir), "--data", str(data), "--max-model-len", "64"]
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "o")])
    assert result.exit_code == 2, result.output
    assert "does not fit engine.max_model_len=64" in result.output and "Traceback" not in result.output
