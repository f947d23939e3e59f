"""examples/openai_agent: the plain openai-client agent's episodes, recorded by the endpoint, go through
reward, RoC and a GRPO update, the new weights reach the engine, and the trained model is saved as a
tirl run (two tiny steps); its training problems are the --problems file or the demo's RL split."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from tests.jsonl import write_jsonl

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "openai_agent"


def import_train(monkeypatch):
    pytest.importorskip("openai")
    monkeypatch.syspath_prepend(str(EXAMPLE))
    sys.modules.pop("train", None)
    import train

    return train


def write_problems(path: Path, n: int) -> Path:
    rows = [{"id": f"q{i}", "problem": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(n)]
    return write_jsonl(path, rows)


def test_the_training_problems_are_the_file_given_or_the_demos_rl_split(tmp_path, monkeypatch):
    from tirl.demo.pipeline import load_settings
    from tirl.demo.synthetic import generate

    train = import_train(monkeypatch)
    path = write_problems(tmp_path / "rl.jsonl", 3)
    assert train.parse_args(["--model", "m", "--problems", str(path)]).problems == str(path)
    assert [(p.id, p.problem, p.answer) for p in train.training_problems(str(path))] == [
        ("q0", "What is 0 + 1?", "1"),
        ("q1", "What is 1 + 1?", "2"),
        ("q2", "What is 2 + 1?", "3"),
    ]
    assert train.parse_args(["--model", "m"]).problems == ""
    demo = load_settings().demo
    default = train.training_problems("")  # not the SFT problems: the draw after them, as the demo splits it
    drawn = generate(demo.sft_problems + 2, "train", seed=demo.seed)
    assert len(default) == demo.rl_problems
    assert [p.id for p in default[:2]] == [p.id for p in drawn[demo.sft_problems :]]
    assert {p.id for p in default}.isdisjoint(p.id for p in drawn[: demo.sft_problems])


@pytest.mark.slow
async def test_the_example_trains_through_the_endpoint(tiny_model_dir, tmp_path, monkeypatch):
    train = import_train(monkeypatch)
    metrics = tmp_path / "metrics.jsonl"
    problems = write_problems(tmp_path / "rl.jsonl", 3)  # 2 steps x 2 prompts: the order cycles
    args = train.parse_args(
        [
            "--model", str(tiny_model_dir), "--problems", str(problems), "--steps", "2", "--prompts", "2",
            "--group", "2",
            "--max-tokens", "12", "--max-turns", "2", "--metrics", str(metrics), "--out", str(tmp_path / "run"),
        ]
    )  # fmt: skip
    history = await train.train(args)
    assert [h["step"] for h in history] == [0, 1]
    assert all(h["samples"] == 4 and h["response_tokens"] > 0 for h in history)  # G=2 of 2G=4, 2 problems
    assert len(metrics.read_text().splitlines()) == 2
    saved = tmp_path / "run" / "checkpoints" / "step_000002" / "model"  # what `tirl eval --model` takes
    assert (saved / "config.json").is_file() and (saved / "tokenizer.json").is_file()


def test_the_agents_tool_runs_python_and_reports_errors():
    sys.path.insert(0, str(EXAMPLE))
    try:
        from agent import run_python, tool_output
    finally:
        sys.path.remove(str(EXAMPLE))
    assert run_python("print(6*7)") == "42\n[ok]"
    assert run_python("1/0").endswith("ZeroDivisionError: division by zero\n[runtime_error]")
    assert run_python("print('x' * 1000)") == "x" * 400 + "[ok]"  # the demo agent's 400 characters
    assert tool_output("no call") is None
    assert (
        tool_output('<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>')
        == "1\n[ok]"
    )
    assert tool_output("<tool_call>{bad</tool_call>").startswith("Error: malformed tool call")
