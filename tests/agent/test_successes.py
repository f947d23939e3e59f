"""Training metrics and evaluation on real successes: the taught tiny model answers some problems
correctly (through real tool calls, the real sandbox and math-verify), so the positive side of RoC,
the error ratio among correct trajectories, the alert monitor and pass@k / maj@k / avg@k all see
known, non-zero values."""

from __future__ import annotations

import json

import pytest
import yaml
from tests.agent.conftest import CFG, SCRIPTS

from tirl.config import load_config
from tirl.data.problem import Problem
from tirl.engines import SingleEnginePool
from tirl.eval.config import EvalConfig
from tirl.eval.evaluate import evaluate
from tirl.reward import RewardPool
from tirl.reward.pool import RewardConfig
from tirl.rl.config import TrainConfig
from tirl.rl.metrics import read_metrics
from tirl.rl.trainer import run_training
from tirl.runtime import Runtime

# mul: 1 ok call, answers 42 (right). fix: 1 malformed + 1 ok call, answers 42 (right).
# fix-wrong: the same conversation as fix, graded against 41: wrong.
PROBLEMS = [
    SCRIPTS["mul"].problem,
    SCRIPTS["fix"].problem,
    Problem("fix-wrong", SCRIPTS["fix"].problem.problem, "41"),
]


@pytest.mark.timeout(900)  # teaching the model, then an evaluation
@pytest.mark.asyncio(loop_scope="session")  # the session-scoped engine and sandbox
async def test_evaluation_counts_the_right_answers(engine, tokenizer, sandbox, taught):
    cfg = EvalConfig(samples=2, temperature=0.0, max_turns=3, max_tokens=400, agent=CFG)
    async with RewardPool(RewardConfig(workers=1)) as rewards:
        rt = Runtime([engine], SingleEnginePool(engine), sandbox, rewards, tokenizer)
        report = await evaluate(rt, {"taught": PROBLEMS}, cfg, progress=False)
    m = report.metrics["taught"]
    assert [r.rewards for r in report.benchmarks["taught"].problems] == [[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]]
    assert (m.problems, m.samples) == (3, 2)
    assert m.pass1 == pytest.approx(2 / 3) and m.maj == pytest.approx(2 / 3)
    assert m.pass_at == pytest.approx({1: 2 / 3, 2: 2 / 3})
    assert m.tool_calls_per_trajectory == pytest.approx(10 / 6) and m.tool_error_rate == pytest.approx(4 / 10)
    assert m.no_answer_rate == 0.0 and m.finish_reasons == {"answered": 6}


@pytest.mark.timeout(900)  # teaching the model, then a training run
def test_training_step_metrics_on_right_and_wrong_answers(taught, tokenizer, tmp_path):
    model, _ = taught
    model_dir = tmp_path / "taught"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data = tmp_path / "problems.jsonl"
    data.write_text(
        "".join(json.dumps({"id": p.id, "problem": p.problem, "answer": p.answer}) + "\n" for p in PROBLEMS)
    )
    config = tmp_path / "train.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": str(model_dir),
                "output_dir": str(tmp_path / "runs"),
                "engine": {"backend": "hf", "device": "cpu", "max_model_len": 1024},
                # greedy decoding replays the taught conversations: every sample of a problem is alike
                "agent": CFG.model_dump() | {"max_turns": 3},
                "sandbox": {"mode": "inprocess", "slots": 4},
                "reward": {"workers": 1},
                "algorithm": {"prompts_per_step": 3, "group_size": 2},
                "optim": {"lr": 1e-5, "warmup_steps": 0, "device": "cpu"},
                "stages": [{"name": "s1", "steps": 1, "data": str(data)}],
                "logging": {"tensorboard": False, "alert_tool_error_rate": 0.3},
            },
            sort_keys=False,  # the tool schema's key order is part of the prompt the model learned
        )
    )
    [m] = read_metrics(run_training(load_config(TrainConfig, config), progress=False))
    assert sorted(m["batch"]) == sorted(p.id for p in PROBLEMS), m
    assert m["reward/mean"] == pytest.approx(8 / 12) and m["reward/kept_mean"] == pytest.approx(4 / 6)
    assert (m["reward/solve_all_ratio"], m["reward/solve_none_ratio"]) == pytest.approx((2 / 3, 1 / 3))
    assert (m["tools/calls"], m["tools/error_ratio"]) == (20, pytest.approx(8 / 20))
    # the paper's Figure 4 quantity: 4 errored calls among the 12 calls of the 8 correct trajectories
    assert m["tools/error_ratio_in_correct"] == pytest.approx(4 / 12)
    # RoC kept G = 2 of 2G = 4 per group; the kept positives: 2 of mul (p_err 0), 2 of fix (p_err 1/2)
    assert (m["roc/kept"], m["roc/dropped"]) == (6, 6)
    assert m["roc/p_err_kept_pos"] == pytest.approx(0.25) and m["roc/p_format_kept_pos"] == 0.0
    assert m["finish/answered"] == 1.0
    assert m["alerts"] == ["tool error ratio 40.0%"]  # step 1: no running mean to compare with yet
