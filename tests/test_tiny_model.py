"""The tiny model preset loads with transformers and keeps the protocol markup as single tokens."""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def test_tiny_model_loads_and_runs(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = tok("Compute 12345 * 678.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape[-1] == model.config.vocab_size >= len(tok)
    assert json.loads((tiny_model_dir / "tirl_preset.json").read_text())["preset"] == "tiny"


def test_digits_and_markup_are_single_tokens(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "<reason>x</reason><answer>\\boxed{4021}</answer><tool_call>\n</tool_call><|im_end|>"
    pieces = [tok.decode([i]) for i in tok(text)["input_ids"]]
    for markup in ["<reason>", "</answer>", "\\boxed{", "<tool_call>", "</tool_call>", "<|im_end|>"]:
        assert markup in pieces
    assert pieces[pieces.index("\\boxed{") + 1 : pieces.index("\\boxed{") + 5] == ["4", "0", "2", "1"]
    assert tok.decode(tok(text)["input_ids"]) == text


def test_chat_template_renders_tool_turns_like_qwen(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    call = {"name": "execute_python_code_with_standard_io", "arguments": {"code": "print(2+2)", "input": ""}}
    msgs = [
        {"role": "user", "content": "What is 2+2?"},
        {
            "role": "assistant",
            "content": "<reason>use python",
            "tool_calls": [{"type": "function", "function": call}],
        },
        {"role": "tool", "content": "4"},
    ]
    text = tok.apply_chat_template(
        msgs,
        tools=[{"type": "function", "function": {"name": call["name"]}}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert "<tools>\n" in text and text.startswith("<|im_start|>system\n")
    assert (
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n" in text
    )
    assert text.endswith("<|im_start|>assistant\n")
