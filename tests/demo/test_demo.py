"""The demo pipeline: settings, output-directory safety, and a micro end-to-end run (real everything)."""

from __future__ import annotations

import asyncio
import json

import pytest

from tirl.config import ConfigError, read_yaml
from tirl.demo.pipeline import (
    MARKER,
    DemoError,
    error_ratio_in_correct,
    load_settings,
    prepare_out,
    run_demo,
    train_config,
)

MICRO = [
    "demo.preset=tiny", "demo.drill_steps=1", "demo.shaped_drill_steps=1", "demo.copy_drills=8",
    "drills.batch_size=8",
    "demo.sft_problems=24", "demo.rl_problems=8", "demo.heldout_problems=4",
    "demo.rl_steps=1", "sft.epochs=1", "train.algorithm.prompts_per_step=2", "train.algorithm.group_size=2",
    "eval.samples=1", "train.engine.backend=hf", "agent.max_response_tokens=96", "agent.max_turn_tokens=48", "eval.max_tokens=96",
    "demo.checks=warn",  # a micro model learns nothing: its shortfalls are warnings here
]  # fmt: skip


def test_shipped_settings_validate_and_take_section_overrides():
    s = load_settings(overrides=["demo.rl_steps=3", "train.optim.lr=2.0e-5", "agent.max_turns=2"])
    assert s.demo.rl_steps == 3 and s.train["optim"]["lr"] == 2.0e-5 and s.agent.max_turns == 2
    assert not s.agent.use_chat_template  # the traces and the loop render the same built-in prompt


def test_the_default_sft_is_the_measured_cosine_over_the_steps_sft_yaml_names():
    """sft.yaml's "# N steps" is what the default settings train (tirl.rl.sft: ceil per epoch), with the
    cosine to 0.1 x lr that docs/results.md's five-seed sweep measured."""
    import math
    import re

    from tirl.demo.pipeline import CONFIG_DIR

    s = load_settings()
    (said,) = re.findall(r"^epochs: \d+ +# (\d+) steps", (CONFIG_DIR / "sft.yaml").read_text(), flags=re.M)
    assert math.ceil(s.demo.sft_problems / s.sft["batch_size"]) * s.sft["epochs"] == int(said)
    assert (s.sft["optim"]["schedule"], s.sft["optim"]["min_lr_ratio"]) == ("cosine", 0.1)


def test_the_demos_rl_steps_are_one_number_everywhere_a_user_reads_them():
    """demo.yaml's rl_steps, DemoConfig's default, train.yaml's stage (`tirl train --config` alone) and
    the README's "the demo's N RL steps" agree: a default changed in one place fails here."""
    import re
    from pathlib import Path

    from tirl.demo.pipeline import CONFIG_DIR, DemoConfig

    steps = load_settings().demo.rl_steps
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    (said,) = re.findall(r"runs the demo's (\d+) RL steps", readme)
    assert (
        steps
        == DemoConfig().rl_steps
        == read_yaml(CONFIG_DIR / "train.yaml")["stages"][0]["steps"]
        == int(said)
    )


def test_the_quick_preset_skips_the_drills_of_a_model_with_copy_heads():
    """`tirl demo --quick` trains its SFT from the fresh demo-preset model (copy heads: tirl.tiny_model),
    and the command line's overrides win over the preset's."""
    from tirl.demo import quick_overrides
    from tirl.tiny_model import PRESETS

    s = load_settings(overrides=quick_overrides())
    assert (s.demo.drill_steps, s.demo.shaped_drill_steps, s.demo.rl_steps) == (0, 0, 4)
    assert s.sft["optim"]["lr"] == 6.0e-3 and s.train["engine"]["backend"] == "hf"
    assert s.sft["optim"]["micro_batch_tokens"] == 1024  # speed only (docs/results.md)
    # quick.yaml's measured SFT (175 steps at a constant lr), whatever sft.yaml's default becomes
    sft = (s.demo.sft_problems * s.sft["epochs"] / s.sft["batch_size"], s.sft["optim"]["schedule"])
    assert sft == (175, "constant")
    assert PRESETS[s.demo.preset]["copy_heads"]
    assert load_settings(overrides=[*quick_overrides(), "demo.drill_steps=300"]).demo.drill_steps == 300


def test_the_traces_phase_opens_its_own_slots_and_the_demos_preload(tmp_path, monkeypatch):
    """The traces phase runs in `demo.trace_slots` slots with train.yaml's stdlib-only preload, and its
    traces (brute forces that time out among them) are the same as one slot's: only the wait changes."""
    import tirl.sandbox
    from tirl.demo.pipeline import _make_traces
    from tirl.demo.synthetic import generate

    opened = []
    real = tirl.sandbox.open_executor

    def recorded(cfg):
        opened.append(cfg)
        return real(cfg)

    monkeypatch.setattr(tirl.sandbox, "open_executor", recorded)
    problems = generate(6, "train", seed=3, families=["sum_big"])  # their failed attempts: half brute forces
    made = {}
    for slots in (1, 4):
        settings = load_settings(overrides=[f"demo.trace_slots={slots}", "agent.tool_timeout=0.5"])
        path = asyncio.run(_make_traces(settings, problems, tmp_path / str(slots)))
        made[slots] = path.read_text()
    assert [c.slots for c in opened] == [1, 4]
    assert opened[0].preload == settings.train["sandbox"]["preload"] == "stdlib"
    assert made[1] == made[4] and "Timed out after 0.5 s" in made[1]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rl_steps=3", "must start with one of"),
        ("demo.rl_steps=0", "rl_steps"),
        ("agent.bogus=1", "bogus"),
        ("demo.preset=huge", "unknown preset 'huge'"),
    ],
)
def test_bad_overrides_say_what_is_wrong(override, message):
    with pytest.raises(ConfigError, match=message):
        load_settings(overrides=[override])


def test_output_directory_is_replaced_only_when_the_demo_wrote_it(tmp_path):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(DemoError, match="not written by `tirl demo`"):
        prepare_out(foreign)
    assert (foreign / "notes.txt").read_text() == "keep me"
    out = prepare_out(tmp_path / "demo")
    (out / "old.txt").write_text("from the last run")
    assert prepare_out(out) == out and not (out / "old.txt").exists() and (out / MARKER).exists()


def test_resume_continues_only_a_demo_written_with_the_same_settings(tmp_path):
    from tirl.demo.pipeline import settings_record

    record = settings_record(load_settings(overrides=["demo.rl_steps=3"]), "grpo", 5)
    with pytest.raises(DemoError, match="holds no demo to continue"):
        prepare_out(tmp_path / "nothing", record, resume=True)
    out = prepare_out(tmp_path / "demo", record)
    (out / "phases.json").write_text("{}")
    assert prepare_out(out, record, resume=True) == out and (out / "phases.json").exists()
    for other in (
        settings_record(load_settings(overrides=["demo.rl_steps=4"]), "grpo", 5),
        settings_record(load_settings(overrides=["demo.rl_steps=3"]), "grpo", 4),
        settings_record(load_settings(overrides=["demo.rl_steps=3"]), None, 5),
    ):
        with pytest.raises(DemoError, match="written with other settings"):
            prepare_out(out, other, resume=True)
    assert (out / "phases.json").exists()  # refused: nothing removed


def test_the_grpo_baseline_differs_from_the_rl_run_only_in_roc(tmp_path):
    s = load_settings()
    rl = train_config(s, tmp_path / "sft", "rl.jsonl", tmp_path, "rl")
    grpo = train_config(s, tmp_path / "sft", "rl.jsonl", tmp_path, "grpo", roc="off")
    assert rl.algorithm.roc == "sample" and grpo.algorithm.roc == "off"
    assert rl.algorithm.rollouts_per_prompt == 2 * grpo.algorithm.rollouts_per_prompt  # RoC draws 2G, keeps G
    assert rl.model_dump(exclude={"algorithm", "run_name"}) == grpo.model_dump(
        exclude={"algorithm", "run_name"}
    )
    assert rl.agent == s.agent and rl.stages[0].steps == s.demo.rl_steps


def test_unknown_baseline_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="the only baseline is grpo"):
        run_demo(tmp_path / "x", compare="ppo")


def test_error_ratio_in_correct_counts_correct_trajectories_only():
    from tirl.agent.trajectory import ToolCallRecord, Trajectory

    def traj(reward, *statuses):
        t = Trajectory(problem_id="p", prompt_ids=[1], reward=reward)
        t.tool_calls = [ToolCallRecord(turn=0, status=s) for s in statuses]
        return t

    trajs = [traj(1.0, "runtime_error", "ok"), traj(1.0, "ok"), traj(0.0, "runtime_error", "runtime_error")]
    assert error_ratio_in_correct(trajs) == pytest.approx(1 / 3)
    assert error_ratio_in_correct([traj(0.0, "ok")]) is None  # no correct trajectory: undefined


def _count_engine_starts(monkeypatch) -> list:
    from tirl.engines import factory

    starts, build = [], factory.build_engines
    monkeypatch.setattr(factory, "build_engines", lambda cfg: starts.append(cfg.model) or build(cfg))
    return starts


def test_micro_demo_end_to_end(tmp_path, monkeypatch):
    out = tmp_path / "demo"
    starts = _count_engine_starts(monkeypatch)
    summary = run_demo(out, overrides=MICRO, progress=False)
    # One engine start for eval_sft, the RL run and eval_rl (pipeline.SharedRuntime): the RL model is
    # evaluated on the engines the run synced after its last step, as on its checkpoint anew.
    assert len(starts) == 1
    from tirl.demo.pipeline import SharedRuntime, _evaluate_into
    from tirl.demo.synthetic import generate
    from tirl.rl.checkpoint import latest_model_dir

    settings = load_settings(overrides=MICRO)
    cfg = train_config(
        settings, latest_model_dir(out / "sft"), str(out / "data" / "rl_train.jsonl"), out, "rl"
    )
    heldout = generate(settings.demo.heldout_problems, "heldout", seed=settings.demo.seed)
    with SharedRuntime(cfg) as fresh:
        _evaluate_into(settings, latest_model_dir(out / "rl"), heldout, tmp_path / "anew", False, fresh)
    assert len(starts) == 2 and starts[1] == str(latest_model_dir(out / "rl"))
    assert _responses(tmp_path / "anew") == _responses(out / "eval_rl")  # weights: tests/rl/test_trainer.py
    saved = json.loads((out / "summary.json").read_text())
    assert saved == summary
    for tag in ("sft", "rl"):  # the summary reports what the evaluation measured
        rows = [json.loads(x) for x in (out / f"eval_{tag}" / "trajectories.jsonl").read_text().splitlines()]
        assert len(rows) == 4  # 4 held-out problems x 1 sample
        assert summary[f"{tag}_accuracy"] == pytest.approx(100 * sum(r["reward"] for r in rows) / 4)
    for name in (
        "reward",
        "response_length",
        "tool_error_ratio_in_correct",
        "tool_calls",
        "heldout_accuracy",
    ):
        assert (out / f"{name}.png").read_bytes().startswith(b"\x89PNG")
    rows = [json.loads(x) for x in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    report = (out / "report.md").read_text()
    assert "GRPO-RoC" in report and "heldout_accuracy.png" in report
    # demo.checks=warn: the shortfall of 1 drill step is a warning at the top of the report, not silence
    assert summary["warnings"][0].startswith("copy drills did not learn to copy")
    assert summary["drills"]["steps"] == 1 and "**Warning: copy drills did not learn to copy" in report

    # `tirl analyze` reads what the demo's evaluation wrote, scored by the SFT and the RL model.
    from tirl.analysis import analyze
    from tirl.rl.checkpoint import latest_model_dir

    models = [latest_model_dir(out / "sft"), latest_model_dir(out / "rl")]
    analysis = analyze(out / "eval_rl" / "trajectories.jsonl", models, out / "analysis")
    trajectories = (out / "eval_rl" / "trajectories.jsonl").read_text().splitlines()
    generated = sum(sum(json.loads(t)["loss_mask"]) for t in trajectories)
    for res in analysis["results"].values():
        assert sum(res["generated"].values()) == generated


def _responses(eval_dir) -> list:
    rows = [json.loads(x) for x in (eval_dir / "trajectories.jsonl").read_text().splitlines()]
    return [(r["problem_id"], r["sample_index"], r["response_ids"], r["reward"]) for r in rows]


def test_an_interrupted_demo_resumes_where_it_stopped(tmp_path, monkeypatch):
    """Ctrl-C during the RL model's evaluation; --resume then skips every finished phase (they would
    fail if run again), evaluates, and reports; a finished RL run resumed from its last checkpoint
    (a kill after its last step, before the phase was recorded) trains no further step."""
    from tirl.demo import pipeline

    out = tmp_path / "demo"
    evaluate_into = pipeline._evaluate_into

    def ctrl_c_at_rl(settings, model, problems, out_dir, progress, shared):
        if out_dir.name == "eval_rl":
            raise KeyboardInterrupt
        return evaluate_into(settings, model, problems, out_dir, progress, shared)

    monkeypatch.setattr(pipeline, "_evaluate_into", ctrl_c_at_rl)
    with pytest.raises(KeyboardInterrupt):
        run_demo(out, overrides=MICRO, progress=False)
    finished = json.loads((out / "phases.json").read_text())
    assert list(finished) == ["traces", "drills", "shaped_drills", "sft", "eval_sft", "rl"]
    assert not (out / "summary.json").exists()

    monkeypatch.setattr(pipeline, "_evaluate_into", evaluate_into)
    for done in ("_write_traces", "_drill", "_shaped_drill", "_sft", "_train"):
        monkeypatch.setattr(pipeline, done, lambda *a, _name=done: pytest.fail(f"{_name} ran again"))
    with pytest.raises(DemoError, match="written with other settings"):
        run_demo(out, overrides=[*MICRO, "demo.rl_steps=2"], progress=False, resume=True)
    summary = run_demo(out, overrides=MICRO, progress=False, resume=True)
    saved = json.loads((out / "eval_rl" / "metrics.json").read_text())
    assert summary["rl_accuracy"] == pytest.approx(100 * saved["benchmarks"]["heldout"]["pass1"], abs=0.01)
    assert summary["wall_seconds"]["sft"] == finished["sft"]["seconds"]
    assert "GRPO-RoC" in (out / "report.md").read_text()

    monkeypatch.undo()  # a kill between the RL run's last checkpoint and its phase record
    finished = json.loads((out / "phases.json").read_text())
    (out / "phases.json").write_text(json.dumps({k: v for k, v in finished.items() if k != "rl"}))
    metrics = (out / "rl" / "metrics.jsonl").read_text()
    assert (
        run_demo(out, overrides=MICRO, progress=False, resume=True)["rl_accuracy"] == summary["rl_accuracy"]
    )
    assert (out / "rl" / "metrics.jsonl").read_text() == metrics  # continued at its end: no step added


def test_micro_comparison_over_seeds(tmp_path, monkeypatch):
    out = tmp_path / "demo"
    starts = _count_engine_starts(monkeypatch)
    summary = run_demo(out, compare="grpo", seeds=2, overrides=[*MICRO, "demo.rl_steps=2"], progress=False)
    assert len(starts) == 1 + 3 * 2  # the first RL run shares eval_sft's engines; 3 more runs + evals
    comparison = summary["comparison"]
    assert comparison["seeds"] == 2
    for run in ("rl", "grpo"):
        accuracies = [summary["eval"][f"{run}_seed{k}"]["accuracy"] for k in (0, 1)]
        assert comparison["heldout_accuracy"][run]["per_seed"] == accuracies
        rewards = [
            [
                json.loads(x)["reward/mean"]
                for x in (out / f"{run}_seed{k}" / "metrics.jsonl").read_text().splitlines()
            ]
            for k in (0, 1)
        ]
        band = comparison["curves"]["reward/mean"][run]
        assert [band[s]["mean"] for s in (1, 2)] == pytest.approx(
            [(a + b) / 2 for a, b in zip(*rewards, strict=True)]
        )
    seeds = [read_yaml(out / f"rl_seed{k}" / "config.yaml")["seed"] for k in (0, 1)]
    assert seeds == [0, 1]
    report = (out / "report.md").read_text()
    assert "Comparison over 2 seeds" in report and "figure4.png" in report and "figure9.png" in report
    assert "The paper's claims, tested" in report  # 2 steps: no change to test, said so per claim


def test_demo_help_lists_every_knob_with_its_default_from_the_config_model():
    from typer.testing import CliRunner

    from tirl.cli import app
    from tirl.demo.pipeline import CONFIG_DIR, DemoConfig

    result = CliRunner().invoke(app, ["demo", "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    shipped = read_yaml(CONFIG_DIR / "demo.yaml")
    for name, value in shipped.items():
        if isinstance(value, dict):
            for sub, v in value.items():
                assert f"demo.{name}.{sub}={v}" in result.output, (name, sub)
        else:
            assert f"demo.{name}={value}:" in result.output, name
        assert name in DemoConfig.model_fields
    assert "train.stages.0.steps=5" in result.output  # list entries by position


def test_a_prompt_too_long_for_the_rl_engine_fails_before_sft(tmp_path):
    """The demo's RL config is checked as soon as its problems exist, not after minutes of SFT."""
    from tirl.demo import DemoError, run_demo

    small = ["demo.preset=tiny", "demo.sft_problems=4", "demo.rl_problems=4", "demo.heldout_problems=2"]
    with pytest.raises(DemoError, match=r"phase 'data'.*does not fit engine\.max_model_len=32"):
        run_demo(tmp_path / "out", overrides=[*small, "train.engine.max_model_len=32"], progress=False)
    assert not (tmp_path / "out" / "data" / "sft_traces.jsonl").exists()
