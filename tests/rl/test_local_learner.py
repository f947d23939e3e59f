"""`LocalLearner` (tirl.rl.local_learner): the policy in this process, as the trainer drives it.

The colocated GPU step moves the policy between the GPU and host memory (offload/onload); CPU runs
never take that path (the policy lives in host memory). Here it runs on real tensors with the meta
device standing in for the memory that is not the policy's: the device as the GPU for onload, the
host for offload (a meta tensor keeps its shape and loses its data, so each test moves one way).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

from tirl.distributed.groups import DistInfo
from tirl.rl import local_learner
from tirl.rl.checkpoint import load_trainer_state
from tirl.rl.config import AlgorithmConfig, OptimConfig
from tirl.rl.local_learner import LocalLearner
from tirl.rl.policy import Policy, TrainSample
from tirl.runtime import handoff
from tirl.runtime.handoff import InProcess

META = torch.device("meta")


def _batch() -> list[TrainSample]:
    """A fixed batch, made anew each time (an update writes its log-probs into the samples)."""
    return [
        TrainSample([5, 6, 7, 8, 9, 10], [0, 0, 1, 1, 1], 1.0),
        TrainSample([5, 6, 9, 8], [0, 1, 1], -1.0),
    ]


def _learner(model_dir, steps: int = 4) -> LocalLearner:
    optim = OptimConfig(lr=1e-2, warmup_steps=0, micro_batch_tokens=256, device="cpu")
    return LocalLearner(Policy(str(model_dir), optim, DistInfo(0, 1, torch.device("cpu")), total_steps=steps))


def _trained(model_dir) -> LocalLearner:
    """A learner after one update: gradients and Adam state exist, as after a colocated step's update."""
    learner = _learner(model_dir)
    learner.update(_batch(), AlgorithmConfig())
    learner.policy.snapshot_reference()
    for p in learner.policy.model.parameters():  # gradients held (the update frees its own: a guard)
        p.grad = torch.ones_like(p)
    return learner


def _devices(learner: LocalLearner) -> dict[str, set[str]]:
    p = learner.policy
    state = [
        (k, v) for st in p.optimizer.state.values() for k, v in st.items() if isinstance(v, torch.Tensor)
    ]
    return {
        "params": {t.device.type for t in p.model.parameters()},
        "reference": {t.device.type for t in p.reference.parameters()},
        "optimizer": {t.device.type for k, t in state if k != "step"},
        "steps": {t.device.type for k, t in state if k == "step"},  # AdamW's counters: always the host's
    }


def test_the_update_returns_the_step_metrics_and_the_learning_rate_it_used(tiny_model_dir):
    learner = _learner(tiny_model_dir, steps=4)
    learner.policy.optim_cfg.schedule = "cosine"
    lrs = []
    for _ in range(2):
        lr = learner.policy.lr
        metrics = learner.update(_batch(), AlgorithmConfig())
        assert metrics["train/lr"] == lr and "train/loss" in metrics
        lrs.append(lr)
    assert learner.policy.lr < lrs[1] <= lrs[0]  # the schedule advanced once per update


@pytest.mark.parametrize("what", ["all", "optimizer", "params"])
def test_offload_moves_what_it_names_to_the_host_and_hands_the_cache_back(tiny_model_dir, monkeypatch, what):
    learner = _trained(tiny_model_dir)
    handed = []
    monkeypatch.setattr(local_learner, "HOST", META)  # the host, for this test
    monkeypatch.setattr(local_learner, "_hand_back_cache", handed.append)
    assert (learner.offload() if what == "all" else learner.offload(what)) is True  # "all": the default
    moved = {"all": {"params", "reference", "optimizer"}, "optimizer": {"optimizer"}}.get(
        what, {"params", "reference"}
    )
    want = {k: {"meta" if k in moved else "cpu"} for k in ("params", "reference", "optimizer")}
    assert _devices(learner) == want | {"steps": {"cpu"}}  # AdamW's counters never leave the host
    if "optimizer" in moved:  # gradients freed with the optimizer state, not carried to the host
        assert all(p.grad is None for p in learner.policy.model.parameters())
    else:
        assert any(p.grad is not None for p in learner.policy.model.parameters())
    assert handed == [torch.device("cpu")]  # the policy's device gives its cache back


def test_onload_brings_parameters_reference_and_optimizer_state_back_to_the_device(tiny_model_dir):
    learner = _trained(tiny_model_dir)
    learner.policy.device = META  # the GPU, for this test
    assert learner.onload() is True
    assert _devices(learner) == {
        "params": {"meta"},
        "reference": {"meta"},
        "optimizer": {"meta"},
        "steps": {"cpu"},
    }


def test_a_policy_in_host_memory_has_nothing_to_offload_or_onload(tiny_model_dir, monkeypatch):
    learner = _trained(tiny_model_dir)
    handed = []
    monkeypatch.setattr(local_learner, "_hand_back_cache", handed.append)
    before = _devices(learner)
    assert learner.offload() is False and learner.onload() is False
    assert _devices(learner) == before and handed == []
    assert any(p.grad is not None for p in learner.policy.model.parameters())


def test_the_cache_goes_back_to_cuda_only_from_a_cuda_device(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("synchronize", device)))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(("empty_cache", None)))
    local_learner._hand_back_cache(torch.device("cpu"))
    assert calls == []
    gpu = torch.device("cuda", 1)
    local_learner._hand_back_cache(gpu)
    assert calls == [("synchronize", gpu), ("empty_cache", None)]  # its work done before it frees


def test_optimizer_state_moves_but_adams_steps_stay_where_torch_keeps_them():
    plain, captured, fused, fresh = (torch.nn.Parameter(torch.zeros(2)) for _ in range(4))
    elsewhere = torch.zeros(2, device=META)
    state = {
        plain: {"exp_avg": torch.zeros(2), "step": torch.tensor(3.0), "count": 3, "kept": elsewhere},
        captured: {"exp_avg": torch.zeros(2), "step": torch.tensor(3.0)},
        fused: {"exp_avg": torch.zeros(2), "step": torch.tensor(3.0)},
    }  # `fresh` has no state yet (no update since the optimizer was made)
    groups = [
        {"params": [plain, fresh], "fused": None, "capturable": False},
        {"params": [captured], "capturable": True},
        {"params": [fused], "fused": True},
    ]
    local_learner._move_optimizer_state(SimpleNamespace(state=state, param_groups=groups), META)
    assert state[plain]["exp_avg"].device == META and state[plain]["step"].device.type == "cpu"
    assert state[plain]["count"] == 3 and state[plain]["kept"] is elsewhere and fresh not in state
    for p in (captured, fused):  # their steps live beside the parameters
        assert state[p]["exp_avg"].device == META and state[p]["step"].device == META


def test_engines_in_this_process_get_every_tensor_for_the_policys_device(tiny_model_dir):
    learner = _learner(tiny_model_dir)
    learner.policy.device = META  # the GPU rank 0's engines pack their buffer on
    calls = []
    runtime = SimpleNamespace(load_sources=lambda s, d: calls.append((s, d)) or {"sync/tensors": 1})
    assert InProcess(runtime, learner, learner.info).send() == {"sync/tensors": 1}
    [(sources, device)] = calls
    assert device == META and list(sources) == [n for n, _ in learner.policy.model.named_parameters()]


def test_a_rank_without_engines_gathers_every_tensor_in_the_order_rank_0_sends_them(
    tiny_model_dir, monkeypatch
):
    learner = _learner(tiny_model_dir)
    sources = learner.sync_tensors()
    gathered = []
    monkeypatch.setattr(handoff, "gathered", gathered.append)  # the collective each rank joins
    assert InProcess(None, learner, learner.info).send() == {"sync/tensors": 0.0, "sync/bytes": 0.0}
    assert [id(t) for t in gathered] == [id(t) for t in sources.values()]
    assert list(sources) == [n for n, _ in learner.policy.model.named_parameters()]


def test_save_restore_and_a_fresh_optimizer_go_to_the_policy(tiny_model_dir, tmp_path):
    learner = _trained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    learner.stage_checkpoint(tmp_path, 3)  # right after the update, in a run (tirl.rl.trainer.rl_step)
    learner.publish_checkpoint(tmp_path, 3, tokenizer, {"step": 3, "note": "x"}, keep_last=1)
    ckpt = tmp_path / "checkpoints" / "step_000003"
    assert AutoTokenizer.from_pretrained(ckpt / "model").get_vocab() == tokenizer.get_vocab()
    state = load_trainer_state(ckpt)
    assert state["note"] == "x" and state["step"] == 3
    saved = {n: p.detach().clone() for n, p in learner.policy.model.named_parameters()}
    other = _learner(tiny_model_dir)
    other.restore(state)
    assert all(torch.equal(p, saved[n]) for n, p in other.policy.model.named_parameters())
    assert (
        other.policy.optimizer.state_dict()["state"].keys()
        == learner.policy.optimizer.state_dict()["state"].keys()
    )
    other.reset_optimizer(9)
    assert other.policy.optimizer.state_dict()["state"] == {} and other.policy.total_steps == 9
    other.snapshot_reference()
    assert all(torch.equal(p, saved[n]) for n, p in other.policy.reference.named_parameters())
