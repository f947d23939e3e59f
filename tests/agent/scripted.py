"""A tiny model taught (by a few seconds of fine-tuning) to follow scripted tool-use conversations.

A randomly initialized model never emits a tool call; the loop tests need one that does, for real,
through the real engine. Each script is recorded once through the real tool protocol and a real
executor (so the tool responses are the executor's actual output), then memorized; greedy decoding
replays it and the loop must reproduce the recorded token ids exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tirl.agent import AgentConfig, build_prompt_ids, parse_tool_calls, render_tool_response
from tirl.agent.protocol import ToolCall, encode, tool_schemas, truncate_middle
from tirl.agent.tools import ToolContext, close_tools, toolbox
from tirl.data.problem import Problem

# The Python tool's schema without descriptions: the taught model memorizes conversations whose prompt
# holds it, and teaching cost grows with their length.
COMPACT_SCHEMA = {
    "type": "function",
    "function": {
        "name": "execute_python_code_with_standard_io",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string"}, "input": {"type": "string"}},
            "required": ["code"],
        },
    },
}


@dataclass
class Script:
    problem: Problem
    turns: list[str]  # assistant turns as generated (after the prefill), the last one ends the answer
    cfg: AgentConfig | None = None  # None: the tests' common config


@dataclass
class Recording:
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]


def call(code: str, stdin: str = "", name: str = "execute_python_code_with_standard_io") -> str:
    """A well-formed Python tool call as the model would write it."""
    return tool_call(name, {"code": code, "input": stdin})


def tool_call(name: str, arguments: dict) -> str:
    import json

    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


async def record(tokenizer, executor, script: Script, cfg: AgentConfig) -> Recording:
    """The script's conversation as the loop must produce it, the calls run by the configured tools."""
    cfg = script.cfg or cfg
    tools = toolbox(cfg.tools, cfg.tool_schema).open(ToolContext(executor, cfg))
    try:
        return await _record(tokenizer, tools, script, cfg)
    finally:
        await close_tools(tools)


async def _record(tokenizer, tools, script: Script, cfg: AgentConfig) -> Recording:
    prompt = build_prompt_ids(tokenizer, script.problem.problem, cfg)
    ids: list[int] = []
    mask: list[int] = []
    for i, turn in enumerate(script.turns):
        gen = encode(tokenizer, turn)
        ids += gen
        mask += [1] * len(gen)
        if i == len(script.turns) - 1:
            break
        responses = []
        for c in parse_tool_calls(turn, cfg.max_calls_per_turn, tool_schemas(cfg)):
            if isinstance(c, ToolCall):
                result = await tools[c.name].call(c.arguments)
                responses.append(truncate_middle(result.text, cfg.tool_output_max_chars))
            else:
                responses.append(c.render())
        # A turn that ends with <|im_end|> itself (no stop at </tool_call>) is closed already.
        seg = render_tool_response(tokenizer, responses, cfg, turn_closed=turn.endswith("<|im_end|>"))
        ids += seg
        mask += [0] * len(seg)
    return Recording(prompt, ids, mask)


def teach(model: torch.nn.Module, recordings: list[Recording], steps: int = 200, lr: float = 4e-3) -> float:
    """Fine-tune `model` in place until greedy decoding reproduces the recorded responses; returns the loss.

    It stops when every trained token is its position's most likely one with probability >= 0.9 (then
    greedy decoding, teacher-forced by its own tokens, replays each recording, with a margin no float
    difference between this padded forward and an engine's cached one can cross): ~115 steps, where a
    mean loss of 3e-3 took ~140 (0.4 s each)."""
    torch.manual_seed(0)
    seqs = [r.prompt_ids + r.response_ids for r in recordings]
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    attn = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, (r, s) in enumerate(zip(recordings, seqs, strict=True)):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
        trained = [-100] * len(r.prompt_ids) + [
            t if m else -100 for t, m in zip(r.response_ids, r.loss_mask, strict=True)
        ]
        labels[i, : len(s)] = torch.tensor(trained)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a busy 2-core machine, intra-op threads spin against each other
    model.train()
    try:
        for _ in range(steps):
            out = model(input_ids=ids, attention_mask=attn, labels=labels)
            if _replays(out.logits, labels):
                break
            opt.zero_grad()
            out.loss.backward()
            opt.step()
    finally:
        model.eval()
        torch.set_num_threads(threads)
    return out.loss.item()


def _replays(logits: torch.Tensor, labels: torch.Tensor, margin: float = 0.9) -> bool:
    """Whether each trained label is its position's argmax with probability >= margin."""
    with torch.no_grad():
        logp, target = logits[:, :-1].float().log_softmax(-1), labels[:, 1:]
        trained = target != -100
        picked = logp.gather(-1, target.clamp(min=0)[..., None]).squeeze(-1)[trained]
        return bool((logp.argmax(-1) == target)[trained].all() and picked.exp().min() >= margin)
