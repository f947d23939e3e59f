"""Checkpoints someone else wrote: a trainer state, shard metadata or shard entry whose load would run
code is refused on resume without running it (the marker file it would write never appears); an old
checkpoint (numpy RNG pickled, or the whole optimizer from before sharded checkpoints) is refused with
the command that converts it, and `tirl convert-checkpoint` turns it into one that resumes exactly."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from tests.rl.dist_worker import fixed_samples
from tests.train_config import write_train_config
from typer.testing import CliRunner

from tirl.cli import app
from tirl.distributed.checkpoint_reader import CheckpointRefused
from tirl.distributed.groups import DistInfo, save_sharded
from tirl.rl.checkpoint import latest_checkpoint, load_trainer_state, read_saved_training_state
from tirl.rl.config import AlgorithmConfig, OptimConfig
from tirl.rl.policy import Policy
from tirl.rl.update import grpo_update

pytestmark = pytest.mark.timeout(600)
OPTIM = OptimConfig(lr=1e-3, warmup_steps=3, micro_batch_tokens=40, device="cpu")
ALG = AlgorithmConfig(mini_batches=2)


class _WritesMarker:
    """Unpickling this writes a file: the proof that a load ran code from the checkpoint."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


def _policy(model_dir) -> Policy:
    return Policy(str(model_dir), OPTIM, DistInfo(0, 1, torch.device("cpu")), total_steps=4)


@pytest.fixture
def trained(tiny_model_dir, tmp_path) -> tuple[Path, Policy]:
    """A run with one checkpoint at step 1 (moments and schedule under way), and its live policy."""
    torch.manual_seed(0)
    run = tmp_path / "run"
    policy = _policy(tiny_model_dir)
    grpo_update(policy, fixed_samples(policy.model.config.vocab_size, n=6, seed=0), ALG)
    policy.advance_schedule()
    policy.save(run, 1, None, {"step": 1}, keep_last=2)
    return run, policy


def _one_more_update(policy: Policy) -> tuple[float, list[torch.Tensor]]:
    loss = grpo_update(policy, fixed_samples(policy.model.config.vocab_size, n=6, seed=2), ALG)["train/loss"]
    return loss, [p.detach().clone() for p in policy.model.parameters()]


def _resumed(ckpt: Path) -> Policy:
    policy = _policy(ckpt / "model")
    policy.restore(load_trainer_state(ckpt))
    return policy


def _rewrite_state(ckpt: Path, change) -> None:
    path = ckpt / "trainer_state.pt"
    state = torch.load(path, weights_only=True)
    change(state)
    torch.save(state, path)


def test_a_trainer_state_that_runs_code_is_refused_on_resume(trained, tiny_model_dir, tmp_path):
    run, _ = trained
    marker = tmp_path / "ran"
    _rewrite_state(latest_checkpoint(run), lambda s: s.update(payload=_WritesMarker(marker)))
    with pytest.raises(CheckpointRefused, match="tirl convert-checkpoint"):
        load_trainer_state(latest_checkpoint(run))
    assert not marker.exists()
    # the same through `tirl train --resume`: one error line, nothing run
    config = write_train_config(tmp_path, tiny_model_dir, output_dir=str(tmp_path), run_name="run")
    result = CliRunner().invoke(app, ["train", "--config", str(config), "--resume", "--quiet"])
    assert result.exit_code == 2, result.output
    assert "refused" in result.output and "tirl convert-checkpoint" in result.output
    assert not marker.exists()


def test_a_run_whose_files_link_outside_it_is_refused_before_anything_is_written(tiny_model_dir, tmp_path):
    """A shared run holding `metrics.jsonl -> ~/.config/autostart/x.desktop` (a file not there yet) and
    `trajectories.jsonl -> ~/notes`: resuming it appended to the first and truncated the second.
    Refused with one line, both untouched."""
    config = write_train_config(tmp_path, tiny_model_dir, steps=1)
    assert CliRunner().invoke(app, ["train", "--config", str(config), "--quiet"]).exit_code == 0
    run = tmp_path / "runs" / "r"
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes").write_text('{"step": 9}\n')
    for name, victim in [("metrics.jsonl", "autostart"), ("trajectories.jsonl", "notes")]:
        (run / name).unlink(missing_ok=True)
        (run / name).symlink_to(home / victim)
    config = write_train_config(tmp_path, tiny_model_dir, steps=2)
    result = CliRunner().invoke(app, ["train", "--config", str(config), "--resume", "--quiet"])
    assert result.exit_code == 2, result.output
    assert "is a symbolic link to" in result.output and str(home) in result.output
    assert sorted(p.name for p in home.iterdir()) == ["notes"]
    assert (home / "notes").read_text() == '{"step": 9}\n'


def test_shard_metadata_that_names_code_is_refused(trained, tmp_path):
    run, _ = trained
    ckpt, marker = latest_checkpoint(run), tmp_path / "ran"
    (ckpt / "shards" / ".metadata").write_bytes(pickle.dumps(_WritesMarker(marker)))
    with pytest.raises(CheckpointRefused, match=r"refused: it names builtins\.exec"):
        _resumed(ckpt)
    with pytest.raises(CheckpointRefused, match="refused"):
        read_saved_training_state(ckpt)
    assert not marker.exists()


def test_a_shard_entry_that_runs_code_is_refused(tmp_path):
    """A non-tensor entry (where the optimizer's hyperparameters live) holding a pickled callable."""
    import torch.distributed.checkpoint as dcp

    marker, shards = tmp_path / "ran", tmp_path / "ckpt" / "shards"
    dcp.save(
        {"model": {"w": torch.ones(2)}, "evil": _WritesMarker(marker)},
        checkpoint_id=str(shards),
        no_dist=True,
    )
    with pytest.raises(CheckpointRefused, match="checkpoint entry evil: refused"):
        read_saved_training_state(shards.parent)
    assert not marker.exists()


def test_shard_metadata_that_points_outside_its_directory_is_refused(tmp_path):
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    shards = tmp_path / "ckpt" / "shards"
    save_sharded(shards, model, optimizer)
    meta = (shards / ".metadata").read_bytes()
    (shards / ".metadata").write_bytes(meta.replace(b"__0_0.distcp", b"../../passwd"))  # same length
    with pytest.raises(CheckpointRefused, match="not a shard file beside it"):
        read_saved_training_state(shards.parent)


def _old_numpy_rng(state: dict) -> None:
    """The trainer state as tirl wrote it before safe loading: numpy's RNG key an ndarray."""
    kind, keys, *rest = state["rng"]["numpy"]
    state["rng"]["numpy"] = (kind, np.asarray(keys, dtype=np.uint32), *rest)


def _old_trainer_state(ckpt: Path) -> None:
    path = ckpt / "trainer_state.pt"
    state = torch.load(path, weights_only=True)
    _old_numpy_rng(state)
    torch.save(state, path)


def test_an_old_checkpoint_is_refused_then_converted_and_resumes_exactly(trained):
    run, live = trained
    ckpt = latest_checkpoint(run)
    _old_trainer_state(ckpt)
    with pytest.raises(CheckpointRefused, match=f"convert it once with `tirl convert-checkpoint {ckpt}`"):
        load_trainer_state(ckpt)
    result = CliRunner().invoke(app, ["convert-checkpoint", str(run)])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"converted {ckpt}", "no warning: nothing in the file is trusted"
    want_loss, want_params = _one_more_update(live)
    got_loss, got_params = _one_more_update(_resumed(ckpt))
    assert got_loss == want_loss
    assert all(torch.equal(g, w) for g, w in zip(got_params, want_params, strict=True))
    again = CliRunner().invoke(app, ["convert-checkpoint", str(ckpt)])
    assert again.exit_code == 0 and "nothing to convert" in again.output


def test_convert_checkpoint_refuses_a_trainer_state_that_runs_code(trained, tmp_path):
    """Round 5, item 3: the converter unpickled anything after one warning line; now it reads old states
    with a restricted unpickler (tensors, plain values, numpy arrays), so the code never runs."""
    run, _ = trained
    ckpt = latest_checkpoint(run)
    marker = tmp_path / "ran"
    _old_trainer_state(ckpt)
    _rewrite_state_unsafe(ckpt, lambda s: s.update(extra=_WritesMarker(marker)))
    result = CliRunner().invoke(app, ["convert-checkpoint", str(run)])
    assert result.exit_code == 2, result.output
    assert "not converted: it names exec" in result.output, result.output
    assert not marker.exists(), "the converter ran code from the checkpoint"


def _rewrite_state_unsafe(ckpt: Path, change) -> None:
    """Rewrite an old-format state (which needs numpy to load): the test's own file, trusted."""
    path = ckpt / "trainer_state.pt"
    state = torch.load(path, weights_only=False)
    change(state)
    torch.save(state, path)


def test_a_checkpoint_from_before_sharded_checkpoints_is_converted_and_resumes_exactly(trained):
    """Its trainer state held the whole optimizer (and no shards/ existed): the converter writes the
    shards from model/ and that state, and the resume continues exactly."""
    import shutil

    run, live = trained
    ckpt = latest_checkpoint(run)
    optimizer = live.optimizer.state_dict()  # what a single process pickled then
    shutil.rmtree(ckpt / "shards")
    _rewrite_state(ckpt, lambda s: s.update(optimizer=optimizer))
    _old_trainer_state(ckpt)
    with pytest.raises(CheckpointRefused):
        load_trainer_state(ckpt)
    result = CliRunner().invoke(app, ["convert-checkpoint", str(ckpt)])
    assert result.exit_code == 0, result.output
    assert "optimizer" not in load_trainer_state(ckpt)
    want_loss, want_params = _one_more_update(live)
    got_loss, got_params = _one_more_update(_resumed(ckpt))
    assert got_loss == want_loss
    assert all(torch.equal(g, w) for g, w in zip(got_params, want_params, strict=True))
