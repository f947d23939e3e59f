"""examples/openai_agent: the plain openai-client agent's episodes, recorded by the endpoint, go through
reward, RoC and a GRPO update, the new weights reach the engine, and the trained model is saved as a
tirl run (two tiny steps)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "openai_agent"


@pytest.mark.slow
async def test_the_example_trains_through_the_endpoint(tiny_model_dir, tmp_path, monkeypatch):
    pytest.importorskip("openai")
    monkeypatch.syspath_prepend(str(EXAMPLE))
    sys.modules.pop("train", None)
    import train

    metrics = tmp_path / "metrics.jsonl"
    args = train.parse_args(
        [
            "--model", str(tiny_model_dir), "--steps", "2", "--prompts", "2", "--group", "2",
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
    assert tool_output("no call") is None
    assert (
        tool_output('<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>')
        == "1\n[ok]"
    )
    assert tool_output("<tool_call>{bad</tool_call>").startswith("Error: malformed tool call")
