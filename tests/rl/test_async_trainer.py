"""Asynchronous GRPO-RoC end to end (tiny model on the HF engine, real sandbox and math-verify): with
max_staleness=0 it is the synchronous trainer bit for bit; a killed async run resumes from its
checkpoint (in-flight groups regenerated from the saved draws): exactly with k = 0, with k = 1
training first the very draws that were in flight, none lost or repeated, and, killed after a stale
group was dropped and its prompt re-queued, training every prompt as often as the uninterrupted run."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tests.rl.test_trainer import _comparable, _write_config, train_in_subprocess
from tests.terminal import tirl_env
from tests.tied import run_to_the_end_or_fault

from tirl.config import load_config
from tirl.rl.checkpoint import latest_checkpoint, load_trainer_state
from tirl.rl.config import TrainConfig
from tirl.rl.metrics import read_metrics
from tirl.rl.sampler import EpochSampler
from tirl.rl.trainer import FAULT_ENV
from tirl.seeds import derive_seed

K0 = ["algorithm.async=true", "algorithm.max_staleness=0"]
K1 = ["algorithm.async=true", "algorithm.max_staleness=1"]


def _rows(run_dir) -> list[dict]:
    """All metrics but timings and throughput, and whether engines were asked to sleep (synchronous
    colocated engines are, async ones never)."""
    return [
        {k: v for k, v in r.items() if not k.startswith("colocate/")}
        for r in _comparable(read_metrics(run_dir))
    ]


def _assert_same(rows: list[dict], want: list[dict]) -> None:
    """The same batches, rewards, RoC, losses and diagnostics, exactly. The engine's own log-probs depend
    in their last bits on how its continuous batching happened to group requests (timing, in any two
    runs): they enter the loss only with TIS (off here), and their gap to the trainer's is ~1e-7."""
    gap = "train/engine_logprob_gap"
    for got, ref in zip(rows, want, strict=True):
        assert got.pop(gap) == pytest.approx(ref.pop(gap), abs=1e-6)
    assert rows == want


def _weights(run_dir) -> dict[str, torch.Tensor]:
    return load_file(latest_checkpoint(run_dir) / "model" / "model.safetensors")


def _train(config, name: str, overrides: list[str], resume: bool = False, fault: str | None = None):
    """Every run of this module in a fresh process, as a user runs it: the runs are compared bit for bit."""
    return train_in_subprocess(config, name, overrides, resume=resume, fault=fault)


@pytest.fixture(scope="module")
def config(tiny_model_dir, tmp_path_factory):
    return _write_config(tmp_path_factory.mktemp("async"), tiny_model_dir, steps=(2, 1))


@pytest.fixture(scope="module")
def k0_run(config):
    return _train(config, "k0", K0)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_async_with_max_staleness_0_is_the_synchronous_step_bit_for_bit(config, k0_run):
    sync = _train(config, "sync", [])
    rows = _rows(k0_run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    _assert_same(rows, _rows(sync))
    assert all(r["async/staleness/0"] == 2 and r["async/dropped_stale"] == 0 for r in rows)
    got, ref = _weights(k0_run), _weights(sync)
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_killed_async_run_resumes_exactly_with_k0(config, k0_run):
    """SIGKILLed after step 2's update (its groups' successors were not admitted yet; the checkpoint of
    step 1 holds step 2's draws): the resumed run regenerates them and ends where the
    uninterrupted run did."""
    _train(config, "killed", K0, fault="update:2")
    resumed = _train(config, "killed", K0, resume=True)
    _assert_same(_rows(resumed), _rows(k0_run))
    got, ref = _weights(resumed), _weights(k0_run)
    assert all(torch.equal(got[k], ref[k]) for k in ref)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_killed_async_run_with_k1_trains_the_draws_it_had_in_flight(config, tmp_path):
    """With k = 1 the engines run a step ahead: at the step-1 checkpoint one group was in flight for
    step 2. Killed during step 2, the resumed run regenerates exactly that draw's prompts for step 2."""
    _train(config, "killed_k1", K1, fault="update:2")
    run_dir = config.parent / "runs" / "killed_k1"
    saved = load_trainer_state(latest_checkpoint(run_dir))
    assert saved["step"] == 1
    pending = saved["producer"]["pending"]
    assert len(pending) == 2  # P = 2 draws admitted for step 2 while step 1 trained (k = 1)
    problems = [p.id for p in _problems(config)]
    resumed = _train(config, "killed_k1", K1, resume=True)
    rows = read_metrics(resumed)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert sorted(rows[1]["batch"]) == sorted(problems[i] for i, _, _ in pending)
    assert all(r["async/dropped_stale"] == 0 for r in rows)


def _problems(config):
    from tirl.data import load_problems

    cfg = load_config(TrainConfig, config, [])
    return load_problems(cfg.stages[0].data)


KX = [*K1, "algorithm.staleness_mode=exact"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_exact_staleness_replays_the_runs_pattern(config):
    """staleness_mode=exact, k = 1: step t of a stage trains on groups generated by the stage's version
    max(t - 1, 0) alone, and a second run with the seed trains on the same prompts, versions and rewards.
    (Losses agree to rounding only: with TIS, on by default, the engine's log-probs enter the loss, and
    their last bits depend on how the engine happened to batch requests.)"""
    runs = [_rows(_train(config, name, KX)) for name in ("exact_a", "exact_b")]
    for rows in runs:
        assert [r["async/behaviour_version_min"] for r in rows] == [0, 0, 2]  # stage 2 starts at version 2
        assert [r["async/behaviour_version_max"] for r in rows] == [0, 0, 2]
        assert [r["async/staleness/1"] for r in rows] == [0, 2, 0]
        assert all(r["async/dropped_stale"] == 0 for r in rows)
    exact = ("batch", "reward/mean", "roc/kept", "response/length_mean", "async/staleness/0")
    assert [{k: r[k] for k in exact} for r in runs[0]] == [{k: r[k] for k in exact} for r in runs[1]]
    for a, b in zip(*runs, strict=True):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-4, abs=1e-6)


HELD_TRAIN = Path(__file__).with_name("held_train.py")


def _train_held(config, name: str, resume: bool = False, fault: str | None = None) -> Path:
    """`tirl train` with k = 1 in a fresh process, stage 1's draw 0 held until it is stale and dropped
    (held_train.py); with `fault` ("PHASE:STEP") SIGKILLed there."""
    env = tirl_env() | ({FAULT_ENV: fault} if fault else {})
    args = ["train", "--config", str(config), "--quiet", f"run_name={name}", *K1]
    cmd = [sys.executable, str(HELD_TRAIN), "0", *args, *(["--resume"] if resume else [])]
    run_to_the_end_or_fault(cmd, env, fault, timeout=1200)
    return config.parent / "runs" / name


def _first_draws(config, steps: tuple[int, ...]) -> Counter:
    """What each stage trains whatever the timing: its first steps x P draws of its sampler (a dropped
    group's prompt is retried, never replaced by a new draw), per stage."""
    cfg, problems = load_config(TrainConfig, config, []), _problems(config)
    want: Counter = Counter()
    for stage, n in enumerate(steps):
        sampler = EpochSampler(len(problems), derive_seed(cfg.seed, stage))
        want.update((stage, problems[i].id) for i in sampler.next(n * cfg.algorithm.prompts_per_step))
    return want


def _trained(rows: list[dict]) -> Counter:
    """How often each prompt was trained on, per stage."""
    return Counter((r["stage"], problem) for r in rows for problem in r["batch"])


@pytest.mark.slow
@pytest.mark.timeout(3000)  # three runs of the trainer on a loaded 2-core machine
def test_a_run_killed_after_a_stale_drop_trains_every_prompt_as_often_as_uninterrupted(
    tiny_model_dir, tmp_path
):
    """TRL#7274's case: a group dropped as stale must not pin the resume point (replaying the prompts
    drawn after it) nor be lost. With k = 1, stage 1's draw 0 is dropped at the end of step 2 and its
    prompt re-queued (and trained in step 3, the stage's last); a run SIGKILLed in step 3 resumes from step 2's checkpoint, which holds the
    re-queued draw, and trains each prompt exactly as often as the uninterrupted run: both train each
    stage's first steps x P draws (only their order depends on which groups finish first). Planted:
    a resume that loses the re-queued draw trains one prompt once too few and another once too often."""
    config = _write_config(tmp_path, tiny_model_dir, steps=(3, 1))
    ref = read_metrics(_train_held(config, "ref"))
    assert [r["step"] for r in ref] == [1, 2, 3, 4]
    assert ref[2]["async/dropped_stale"] >= 1 and sum(r["async/retries_trained"] for r in ref) >= 1
    killed = _train_held(config, "killed", fault="update:3")
    saved = load_trainer_state(latest_checkpoint(killed))
    assert saved["step"] == 2
    assert [d for d in saved["producer"]["pending"] if d[2]], saved["producer"]  # the re-queued draw
    resumed = read_metrics(_train_held(config, "killed", resume=True))
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert _trained(resumed) == _trained(ref) == _first_draws(config, (3, 1))
