"""SFT: assistant-only loss masks for every data form, and a real run that learns and checkpoints."""

from __future__ import annotations

import json

import pytest
import torch

from tirl.config import ConfigError
from tirl.engines.tokenizer import load_tokenizer
from tirl.rl.checkpoint import latest_model_dir
from tirl.rl.config import SFTConfig
from tirl.rl.metrics import read_metrics
from tirl.rl.sft import read_examples, run_sft, tokenize_example

CALL = {"name": "execute_python_code_with_standard_io", "arguments": {"code": "print(17*3)", "input": ""}}
CHAT = {
    "messages": [
        {"role": "system", "content": "Solve with Python."},
        {"role": "user", "content": "What is 17 times 3?"},
        {
            "role": "assistant",
            "content": "<reason>multiply</reason>",
            "tool_calls": [{"type": "function", "function": CALL}],
        },
        {"role": "tool", "content": "51"},
        {"role": "assistant", "content": "<reason>done</reason><answer>\\boxed{51}</answer>"},
    ]
}
RAW = {
    "text": '<reason>x</reason><tool_call>{"name": "f"}</tool_call><tool_response>SECRET</tool_response><answer>\\boxed{2}</answer>'
}


def _trained_text(tok, sample) -> str:
    return tok.decode([i for i, m in zip(sample.input_ids[1:], sample.loss_mask, strict=True) if m])


def test_chat_mask_covers_assistant_turns_only(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    sample, truncated = tokenize_example(tok, CHAT, 4096)
    trained = _trained_text(tok, sample)
    assert not truncated
    assert "print(17*3)" in trained and "<tool_call>" in trained and "\\boxed{51}" in trained
    assert "17 times 3" not in trained and "Solve with Python" not in trained  # system/user: context
    assert "51\n</tool_response>" not in trained and "<tool_response>" not in trained  # tool output: never
    assert trained.count("<|im_end|>") == 2  # each assistant turn learns to stop


def test_raw_text_and_prompt_completion_masks(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    trained = _trained_text(tok, tokenize_example(tok, RAW, 4096)[0])
    assert "SECRET" not in trained and "<tool_call>" in trained and "\\boxed{2}" in trained
    pc = {"prompt": "Question: 1+1?\n", "completion": "<answer>\\boxed{2}</answer>"}
    trained = _trained_text(tok, tokenize_example(tok, pc, 4096)[0])
    assert "Question" not in trained and "\\boxed{2}" in trained
    sample, truncated = tokenize_example(tok, CHAT, 16)
    assert truncated and len(sample.input_ids) == 16


def test_bad_data_is_reported_with_its_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(RAW) + "\n{not json\n")
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2"):
        read_examples([str(bad)])
    bad.write_text(json.dumps({"answer": 1}) + "\n")
    with pytest.raises(ConfigError, match="needs 'messages'"):
        read_examples([str(bad)])


def test_sft_run_learns_and_writes_loadable_checkpoints(tiny_model_dir, tmp_path):
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(ex) + "\n" for ex in [CHAT, RAW] * 4))
    cfg = SFTConfig(
        model=str(tiny_model_dir),
        data=[str(data)],
        output_dir=str(tmp_path),
        run_name="sft",
        epochs=6,
        batch_size=4,
        optim={"lr": 3e-3, "schedule": "cosine", "warmup_ratio": 0.25, "device": "cpu"},
        checkpoint={"every": 4, "keep_last": 2},
        logging={"tensorboard": True},
    )
    run_dir = run_sft(cfg, progress=False)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert rows[-1]["train/loss"] < 0.7 * rows[0]["train/loss"]
    assert (
        rows[0]["train/lr"] < rows[2]["train/lr"] and rows[-1]["train/lr"] < rows[2]["train/lr"]
    )  # warm-up, decay
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["step_000008", "step_000012"]  # keep_last=2, and the final step is always saved
    assert any((run_dir / "tensorboard").iterdir())
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(latest_model_dir(run_dir))
    assert load_tokenizer(latest_model_dir(run_dir)).chat_template  # a complete model dir, tokenizer included
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert any(not torch.equal(w, initial[k]) for k, w in model.state_dict().items())  # the trained weights
    with pytest.raises(ConfigError, match="already holds a run"):
        run_sft(cfg, progress=False)
    assert run_sft(cfg, resume=True, progress=False) == run_dir  # finished: nothing left to do
    assert len(read_metrics(run_dir)) == 12
