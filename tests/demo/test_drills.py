"""The copy drills' stop rule (tirl.demo.drills): they run until the held-out check passes, or to the
cap, whose outcome says in one line that the model did not learn to copy. A real tiny model trains."""

from __future__ import annotations

import pytest

from tirl.demo.drills import OUTCOME_FILE, DrillOutcome, StopRule, copy_accuracy, run_drills
from tirl.demo.sft_traces import copy_drills
from tirl.rl.checkpoint import latest_checkpoint
from tirl.rl.config import SFTConfig


def _cfg(tmp_path, lr: float, batch_size: int) -> SFTConfig:
    from tirl.tiny_model import create_tiny_model

    model = create_tiny_model(tmp_path / "init", preset="tiny", seed=0)
    optim = {"lr": lr, "schedule": "constant", "warmup_steps": 0, "weight_decay": 0.0, "device": "cpu"}
    return SFTConfig(model=str(model), data=["unused.jsonl"], output_dir=str(tmp_path), run_name="drills",
                     batch_size=batch_size, max_length=64, optim=optim)  # fmt: skip


def test_the_drills_stop_once_the_held_out_check_passes(tmp_path):
    few = copy_drills(2, seed=3, max_digits=1)  # two short drills a tiny model memorizes fast
    cfg = _cfg(tmp_path, lr=1e-2, batch_size=2)
    rule = StopRule(max_steps=150, check_every=5, target=1.0, heldout=2)
    lines: list[str] = []
    outcome = run_drills(cfg, few * 150, few, rule, say=lines.append)
    assert outcome.learned and outcome.accuracy == 1.0
    assert outcome.steps < 150 and outcome.steps % 5 == 0  # stopped at a check, before the cap
    assert [h["step"] for h in outcome.history] == list(range(5, outcome.steps + 1, 5))
    assert all(h["copy_accuracy"] < 1.0 for h in outcome.history[:-1])
    assert latest_checkpoint(cfg.run_dir).name == f"step_{outcome.steps:06d}"
    assert DrillOutcome.read(cfg.run_dir) == outcome and "copies 100% of held-out drills" in outcome.message()


def test_the_cap_ends_drills_that_did_not_learn_and_says_so_in_one_line(tmp_path):
    cfg = _cfg(tmp_path, lr=1e-3, batch_size=4)
    rule = StopRule(max_steps=3, check_every=25, target=0.95, heldout=16)
    outcome = run_drills(cfg, copy_drills(12, seed=1), copy_drills(16, seed=-1), rule, say=lambda _: None)
    assert not outcome.learned and outcome.steps == 3 and outcome.accuracy < 0.95
    assert [h["step"] for h in outcome.history] == [3]  # the cap is always checked
    message = outcome.message()
    assert message.startswith("copy drills did not learn to copy") and "cap of 3 steps" in message
    assert "\n" not in message and (cfg.run_dir / OUTCOME_FILE).exists()
    assert latest_checkpoint(cfg.run_dir).name == "step_000003"  # the model is saved either way


def test_copy_accuracy_is_greedy_exact_match_of_the_whole_completion(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from tirl.demo.drills import _samples
    from tirl.engines.tokenizer import load_tokenizer

    cfg = _cfg(tmp_path, lr=1e-3, batch_size=1)
    model = AutoModelForCausalLM.from_pretrained(cfg.model)
    tokenizer = load_tokenizer(cfg.model)
    samples = _samples(tokenizer, copy_drills(4, seed=0), 64)
    greedy = []
    for s in samples:  # what greedy decoding emits, token by token, from each prompt
        start = s.loss_mask.index(1) + 1
        ids = torch.tensor([s.input_ids[:start]])
        out = model.generate(ids, max_new_tokens=len(s.input_ids) - start, do_sample=False)
        greedy.append(out[0, start:].tolist() == s.input_ids[start:])
    assert copy_accuracy(model, samples, tokenizer.pad_token_id or 0) == sum(greedy) / len(greedy)


def test_a_bad_stop_rule_is_refused():
    with pytest.raises(ValueError, match="bad drill stop rule"):
        StopRule(max_steps=10, check_every=0)
