"""Sharded checkpoints across two FSDP2 (gloo) processes: exact resume, each rank reading only its own
optimizer shards, a Hugging Face export beside them, and no unsharded model moved to a device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.terminal import run_torchrun

WORKER = Path(__file__).with_name("dist_worker.py")
pytestmark = pytest.mark.timeout(900)  # a hang guard: two torchrun ranks are slow on a loaded machine


@pytest.fixture(scope="module")
def resumed(tiny_model_dir, tmp_path_factory) -> tuple[list[dict], Path]:
    tmp = tmp_path_factory.mktemp("sharded")
    out, run = tmp / "out.json", tmp / "run"
    proc = run_torchrun(WORKER, "resume", str(tiny_model_dir), str(run), str(out), timeout=800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((tmp / f"out.json.{r}").read_text()) for r in range(2)], tmp / "run"


def test_resume_from_shards_is_exact(resumed):
    results, _ = resumed
    main = results[0]
    assert main["world"] == 2
    assert main["losses"][1] == main["losses"][0]  # bit-identical: same weights, moments and schedule
    assert main["checksums"][1] == main["checksums"][0]


def test_each_rank_reads_only_its_own_optimizer_shards(resumed):
    results, _ = resumed
    """The AdamW moments (the optimizer's bulk, sharded like the weights) come only from the file the rank
    wrote itself; what is replicated (step counts, hyperparameters) is stored once, in any rank's file."""
    for r in results:
        moments = [(fqn, path) for fqn, path in r["reads"] if "exp_avg" in fqn]
        assert moments and {path for _, path in moments} == {f"__{r['rank']}_0.distcp"}, moments
        others = {fqn for fqn, path in r["reads"] if path != f"__{r['rank']}_0.distcp"}
        assert all(fqn.endswith(".step") or ".param_groups." in fqn for fqn in others), others
        assert "optimizer" not in r["trainer_state_keys"]  # trainer_state.pt carries no optimizer


def test_no_unsharded_model_is_moved_to_a_device(resumed):
    results, _ = resumed
    assert all(r["unsharded_moves"] == [] for r in results)


def test_the_checkpoint_holds_a_loadable_hf_export(resumed, tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    _, run = resumed
    ckpt = run / "checkpoints" / "step_000002"
    assert (ckpt / "shards" / ".metadata").is_file()
    model = AutoModelForCausalLM.from_pretrained(ckpt / "model", dtype=torch.float32)
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert model.config.vocab_size == start.config.vocab_size
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, start.get_parameter(n))]
    assert changed  # trained weights, not the initial ones
