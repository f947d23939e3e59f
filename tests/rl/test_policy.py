"""The update machinery: micro-batching, LR schedule, 1 process == 2 FSDP2 processes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from tests.terminal import run_torchrun

from tirl.rl.policy import lr_factor, pack_micro_batches

WORKER = Path(__file__).with_name("dist_worker.py")


def test_pack_micro_batches_respects_budget():
    lengths = [10, 3, 7, 7, 2, 30, 5]
    batches = pack_micro_batches(lengths, 20)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) * max(lengths[i] for i in b) <= 20 or len(b) == 1
    assert [5] in batches  # longer than the budget: alone


def test_lr_schedules():
    assert [lr_factor(s, 100, 4, "constant") for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_factor(4, 104, 4, "cosine") == pytest.approx(1.0)
    assert lr_factor(54, 104, 4, "cosine") == pytest.approx(0.5)
    assert lr_factor(104, 104, 4, "cosine", min_ratio=0.1) == pytest.approx(0.1)


def _load_worker():
    spec = importlib.util.spec_from_file_location("dist_worker", WORKER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_two_fsdp2_processes_match_one(tiny_model_dir, tmp_path):
    """Same fixed batches, 2 mini-batch updates per step, uneven micro-batches across ranks."""
    single = _load_worker().run_updates(str(tiny_model_dir))
    out = tmp_path / "dist.json"
    proc = run_torchrun(WORKER, str(tiny_model_dir), str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    dist = json.loads(out.read_text())
    assert dist["world"] == 2 and single["world"] == 1
    assert dist["losses"] == pytest.approx(single["losses"], rel=1e-4, abs=1e-6)
    assert dist["grad_norms"] == pytest.approx(single["grad_norms"], rel=1e-4)
    assert dist["checksum"] == pytest.approx(single["checksum"], rel=1e-5)
    assert single["losses"][0] != single["losses"][-1]  # the weights did change between steps


def test_kl_term_against_the_stage_reference(tiny_model_dir):
    """With kl_coef > 0 the reference is the policy at the stage start: KL 0 first, > 0 after an update."""
    from tirl.distributed.groups import init_distributed
    from tirl.rl.config import AlgorithmConfig, OptimConfig
    from tirl.rl.policy import Policy
    from tirl.rl.update import grpo_update

    worker = _load_worker()
    policy = Policy(
        str(tiny_model_dir), OptimConfig(lr=1e-2, warmup_steps=0, device="cpu"), init_distributed("cpu"), 2
    )
    policy.snapshot_reference()
    alg = AlgorithmConfig(kl_coef=0.1)
    batch = worker.fixed_samples(policy.model.config.vocab_size, n=4)
    first = grpo_update(policy, batch, alg)
    second = grpo_update(policy, worker.fixed_samples(policy.model.config.vocab_size, n=4), alg)
    assert first["train/kl"] == pytest.approx(0.0, abs=1e-9)
    assert second["train/kl"] > 1e-6


@pytest.mark.parametrize("checkpointing", [False, True])
def test_gradient_checkpointing_recomputes_layers_without_dropout(tiny_model_dir, tmp_path, checkpointing):
    """Configured checkpointing really recomputes each decoder layer in backward (a layer's forward runs
    twice per micro-batch), and dropout stays off: a model whose config asks for heavy attention
    dropout still gives identical log-probs twice and the same gradients as without checkpointing."""
    import torch
    from transformers import AutoConfig

    from tirl.distributed.groups import init_distributed
    from tirl.rl.config import OptimConfig
    from tirl.rl.policy import Policy

    model_dir = tmp_path / "dropout_model"
    model_dir.mkdir()
    for f in tiny_model_dir.iterdir():
        (model_dir / f.name).symlink_to(f)
    (model_dir / "config.json").unlink()
    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.attention_dropout = 0.5
    config.save_pretrained(model_dir)

    optim = OptimConfig(lr=1e-3, warmup_steps=0, device="cpu", gradient_checkpointing=checkpointing)
    policy = Policy(str(model_dir), optim, init_distributed("cpu"), 1)
    samples = _load_worker().fixed_samples(policy.model.config.vocab_size, n=2)
    calls = []
    layer = policy.model.model.layers[0]
    layer.self_attn.register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))

    first = policy.forward(samples).logprobs.detach()
    calls.clear()
    policy.accumulate(samples, lambda mb: -(mb.logprobs * mb.mask).sum())
    assert len(calls) == (2 if checkpointing else 1)  # forward, then the recomputation in backward
    assert torch.equal(policy.forward(samples).logprobs.detach(), first)  # no dropout
    grad = policy.model.model.layers[0].self_attn.q_proj.weight.grad.clone()

    reference = Policy(
        str(model_dir), optim.model_copy(update={"gradient_checkpointing": False}), init_distributed("cpu"), 1
    )
    reference.accumulate(samples, lambda mb: -(mb.logprobs * mb.mask).sum())
    assert torch.allclose(grad, reference.model.model.layers[0].self_attn.q_proj.weight.grad, atol=1e-6)
