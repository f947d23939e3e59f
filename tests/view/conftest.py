"""Fixtures of the viewer tests: a tiny model taught to use the tool, a real `tirl eval` and a real
`tirl train` run of it, and a headless Chromium (skipped, with the reason, where none can run)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import yaml
from tests.agent.scripted import COMPACT_SCHEMA, Script, call, record, teach
from tests.view.browser import chromium, need_browser
from typer.testing import CliRunner

from tirl.agent import AgentConfig
from tirl.cli import app
from tirl.data.problem import Problem

# Short prompts keep the memorized conversations short (teaching cost grows with their length).
AGENT = {
    "system_prompt": "Use the tool.",
    "user_prompt": "{problem}",
    "tool_schema": COMPACT_SCHEMA,
    "use_chat_template": False,
    "show_exec_time": False,
    "tool_timeout": 5.0,
}
SCRIPTS = [
    # a clean call, then the right answer
    Script(
        Problem("six", "6*7?", "42"),
        [" " + call("print(6*7)"), "</reason><answer>\\boxed{42}</answer><|im_end|>"],
    ),
    # a malformed call, a call that raises, then a wrong answer
    Script(
        Problem("fix", "2*21?", "42"),
        [
            ' <tool_call>{"name": "execute_python_code_with_standard_io", "arguments": {"code": 1}}</tool_call>',
            " " + call("x = 1/0\nprint(x)"),
            "</reason><answer>\\boxed{7}</answer><|im_end|>",
        ],
    ),
]
# An unscripted problem: whatever the model makes of it.
PROBLEMS = [s.problem for s in SCRIPTS] + [Problem("add", "What is 2+3?", "5")]


def _cli(args: list[str]):
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture
def browser():
    """One Chromium per test: Playwright's sync API runs an event loop in this thread while it is open,
    and the session fixtures above call asyncio.run (pytest sets them up before this one)."""
    need_browser("the viewer's browser tests")
    with chromium() as b:
        yield b


@pytest.fixture(scope="session")
def taught_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model, fine-tuned for a few seconds to replay SCRIPTS (real tool calls, real statuses)."""
    from transformers import AutoModelForCausalLM

    from tirl.engines import load_tokenizer
    from tirl.sandbox import Sandbox

    tokenizer = load_tokenizer(tiny_model_dir)
    cfg = AgentConfig(**AGENT)

    async def recordings():
        async with Sandbox(slots=1, preload=[]) as sandbox:
            return [await record(tokenizer, sandbox, s, cfg) for s in SCRIPTS]

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    loss = teach(model, asyncio.run(recordings()))
    assert loss < 0.05, f"the tiny model did not memorize the scripts (loss {loss:.3f})"
    out = tmp_path_factory.mktemp("taught")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _problems_file(directory: Path) -> Path:
    path = directory / "problems.jsonl"
    path.write_text(
        "".join(json.dumps({"id": p.id, "problem": p.problem, "answer": p.answer}) + "\n" for p in PROBLEMS)
    )
    return path


@pytest.fixture(scope="session")
def eval_dir(taught_model_dir, tmp_path_factory) -> Path:
    """`tirl eval` of the taught tiny model: 3 problems x 2 samples, greedy, real sandbox service."""
    work = tmp_path_factory.mktemp("eval")
    config = work / "eval.yaml"
    config.write_text(yaml.safe_dump({"agent": AGENT}, sort_keys=False))
    out = work / "out"
    args = [
        "eval",
        "--model",
        str(taught_model_dir),
        "--data",
        str(_problems_file(work)),
        "--config",
        str(config),
        "--samples",
        "2",
        "--temperature",
        "0",
        "--max-tokens",
        "300",
        "--max-turns",
        "4",
        "--out",
        str(out),
        "--reward-workers",
        "1",
    ]
    _cli(args)
    return out


@pytest.fixture(scope="session")
def train_dir(taught_model_dir, tmp_path_factory) -> Path:
    """`tirl train` of the taught tiny model: 3 GRPO-RoC steps, 4 sampled trajectories per step."""
    work = tmp_path_factory.mktemp("train")
    cfg = {
        "model": str(taught_model_dir),
        "output_dir": str(work),
        "run_name": "run",
        "seed": 3,
        "engine": {"backend": "hf", "device": "cpu", "max_model_len": 1024, "max_batch_size": 16},
        "agent": {**AGENT, "max_turns": 4, "max_response_tokens": 300},
        "sandbox": {"mode": "inprocess", "slots": 2},
        "reward": {"workers": 1},
        "algorithm": {"prompts_per_step": 2, "group_size": 2},
        "optim": {"lr": 1e-4, "warmup_steps": 0, "device": "cpu"},
        "stages": [{"name": "s1", "steps": 3, "data": str(_problems_file(work))}],
        "checkpoint": {"every": 10, "keep_last": 1},
        "logging": {"tensorboard": False, "trajectories_per_step": 4},
        "rollout_concurrency": 8,
    }
    config = work / "train.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))  # key order is prompt text
    _cli(["train", "--config", str(config), "--quiet"])
    return work / "run"
