"""Asynchronous GRPO-RoC end to end (tiny model on the HF engine, real sandbox and math-verify): with
max_staleness=0 it is the synchronous trainer bit for bit; a killed async run resumes from its
checkpoint (in-flight groups regenerated from the saved draws): exactly with k = 0, and with k = 1
training first the very draws that were in flight, none lost or repeated."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from tests.rl.test_trainer import _comparable, _train_until_killed, _write_config

from tirl.config import load_config
from tirl.rl.checkpoint import latest_checkpoint, load_trainer_state
from tirl.rl.config import TrainConfig
from tirl.rl.metrics import read_metrics
from tirl.rl.trainer import run_training

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


def _train(config, name: str, overrides: list[str], resume: bool = False):
    cfg = load_config(TrainConfig, config, [f"run_name={name}", *overrides])
    return run_training(cfg, resume=resume, progress=False)


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
    _train_until_killed(config, "update:2", resume=False, overrides=K0)
    resumed = _train(config, "killed", K0, resume=True)
    _assert_same(_rows(resumed), _rows(k0_run))
    got, ref = _weights(resumed), _weights(k0_run)
    assert all(torch.equal(got[k], ref[k]) for k in ref)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_killed_async_run_with_k1_trains_the_draws_it_had_in_flight(config, tmp_path):
    """With k = 1 the engines run a step ahead: at the step-1 checkpoint one group was in flight for
    step 2. Killed during step 2, the resumed run regenerates exactly that draw's prompts for step 2."""
    _train_until_killed(config, "update:2", resume=False, overrides=K1, name="killed_k1")
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
