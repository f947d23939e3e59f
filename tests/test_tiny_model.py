"""The tiny model preset loads with transformers and keeps the protocol markup as single tokens."""

from __future__ import annotations

import json

import pytest
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


def _copy_score(model) -> float:
    """Share of tokens whose own logit is the largest when every head of the last layer writes what it
    reads from that token (value -> output, through the final norm to the tied unembedding)."""
    emb = model.get_input_embeddings().weight
    attn = model.model.layers[-1].self_attn
    read = attn.v_proj(model.model.layers[-1].input_layernorm(emb))
    logits = model.model.norm(attn.o_proj(read)) @ emb.T
    return (logits.argmax(-1) == torch.arange(len(emb))).float().mean().item()


def test_the_demo_preset_starts_with_copy_heads(tmp_path):
    from tirl.tiny_model import create_tiny_model, init_copy_heads

    model = AutoModelForCausalLM.from_pretrained(create_tiny_model(tmp_path / "demo", preset="demo", seed=3))
    with torch.no_grad():
        assert _copy_score(model) > 0.99
        attn = model.model.layers[0].self_attn
        d = attn.head_dim
        for h in (0, 15):  # each head's value -> output map is a projection onto its own head_dim subspace
            ov = attn.o_proj.weight[:, h * d : (h + 1) * d] @ attn.v_proj.weight[h * d : (h + 1) * d]
            torch.testing.assert_close(ov @ ov, ov, atol=1e-5, rtol=0)
            assert round(torch.trace(ov).item()) == d
        plain = AutoModelForCausalLM.from_config(model.config)
        assert _copy_score(plain) < 0.05  # a random init copies nothing
        init_copy_heads(plain, seed=3)
        assert _copy_score(plain) > 0.99


def test_copy_heads_need_a_value_head_per_query_head(tiny_model_dir):
    from tirl.tiny_model import init_copy_heads

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)  # 4 query heads share 2 value heads
    with pytest.raises(ValueError, match="as many key/value heads as query heads"):
        init_copy_heads(model)
