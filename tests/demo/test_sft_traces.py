"""SFT traces: the loop's exact layout, real tool outputs, and the intended imperfections."""

from __future__ import annotations

import json
import random

import pytest

from tirl.agent.config import AgentConfig
from tirl.agent.protocol import build_prompt_text, count_answer_blocks, parse_tool_calls
from tirl.demo.sft_traces import TraceMix, buggy_variant, copy_drills, make_traces, write_traces
from tirl.demo.synthetic import generate
from tirl.reward import score

SCHEMA = {"name": "python", "parameters": {"properties": {"code": {"type": "string"}}, "required": ["code"]}}
CFG = AgentConfig(system_prompt="Use the python tool.", user_prompt="{problem}", tool_schema=SCHEMA,
                  use_chat_template=False)  # fmt: skip


def turns(completion: str) -> list[str]:
    """The assistant turns of a completion (the text between tool-response segments)."""
    out = []
    for chunk in completion.split("<|im_start|>assistant\n"):
        out.append(chunk.split("<|im_end|>")[0])
    return out


async def traces_of(kind_mix: TraceMix, n: int, sandbox) -> tuple[list, list[dict]]:
    problems = generate(n, "train", seed=11)
    return problems, await make_traces(problems, sandbox, CFG, kind_mix, seed=5)


@pytest.mark.asyncio(loop_scope="package")
async def test_clean_traces_call_the_tool_once_and_answer_correctly(sandbox):
    problems, traces = await traces_of(TraceMix(no_tool=0, code_fix=0, redundant_answer=0), 6, sandbox)
    for p, t in zip(problems, traces, strict=True):
        assert t["kind"] == "tool"
        assert t["prompt"] == build_prompt_text(None, p.problem, CFG)
        first, final = turns(t["completion"])
        (call,) = parse_tool_calls(first, tool_schema=SCHEMA)
        assert call.code == p.meta["code"]
        assert "[ok," in t["completion"]  # the sandbox's real status line
        assert score(t["completion"], p.answer) == 1.0
        assert count_answer_blocks(final) == 1


@pytest.mark.asyncio(loop_scope="package")
async def test_code_fix_traces_show_a_real_error_then_the_fix(sandbox):
    problems, traces = await traces_of(TraceMix(no_tool=0, code_fix=1, redundant_answer=1), 6, sandbox)
    for p, t in zip(problems, traces, strict=True):
        first, fix, final = turns(t["completion"])
        (bad,) = parse_tool_calls(first, tool_schema=SCHEMA)
        (good,) = parse_tool_calls(fix, tool_schema=SCHEMA)
        assert bad.code != p.meta["code"] and good.code == p.meta["code"]
        assert "NameError" in t["completion"] and "[runtime_error," in t["completion"]
        assert count_answer_blocks(final) == 2  # redundant_answer=1: a repeated answer block
        assert score(t["completion"], p.answer) == 1.0


@pytest.mark.asyncio(loop_scope="package")
async def test_no_tool_traces_guess_a_wrong_number(sandbox):
    problems, traces = await traces_of(TraceMix(no_tool=1, code_fix=0), 6, sandbox)
    for p, t in zip(problems, traces, strict=True):
        assert "<tool_call>" not in t["completion"]
        assert score(t["completion"], p.answer) == 0.0


@pytest.mark.asyncio(loop_scope="package")
async def test_mix_shares_and_sft_masking(sandbox, tiny_model_dir, tmp_path):
    from tirl.engines.factory import load_tokenizer
    from tirl.rl.sft import read_examples, tokenize_example

    _, traces = await traces_of(TraceMix(no_tool=0.3, code_fix=0.3), 40, sandbox)
    kinds = [t["kind"] for t in traces]
    assert {"tool", "code_fix", "no_tool"} == set(kinds)
    path = write_traces(traces, tmp_path / "traces.jsonl")
    tokenizer = load_tokenizer(tiny_model_dir)
    example = next(e for e in read_examples([str(path)]) if e["kind"] == "code_fix")
    sample, truncated = tokenize_example(tokenizer, example, 4096)
    ids = sample.input_ids
    trained = tokenizer.decode([t for t, m in zip(ids[1:], sample.loss_mask, strict=True) if m])
    assert (
        not truncated and "NameError" not in trained and "Traceback" not in trained
    )  # tool output is context
    assert "<tool_call>" in trained and "\\boxed{" in trained
    assert json.loads(path.read_text().splitlines()[0])["prompt"].startswith("<|im_start|>system")


@pytest.mark.asyncio(loop_scope="package")
async def test_every_buggy_variant_fails_with_a_name_error(sandbox):
    rng = random.Random(0)
    for p in generate(12, "train"):
        result = await sandbox.run(buggy_variant(p.meta["code"], rng))
        assert result.status == "runtime_error" and "NameError" in result.stderr, result.render()


def test_mix_must_fit():
    with pytest.raises(ValueError, match=r"no_tool \+ code_fix"):
        TraceMix(no_tool=0.8, code_fix=0.5)


def test_copy_drills_repeat_the_prompt_numbers():
    drills = copy_drills(20, seed=1)
    assert drills == copy_drills(20, seed=1) and drills != copy_drills(20, seed=2)
    for d in drills:
        numbers = d["prompt"].split("Repeat: ")[1].split("<|im_end|>")[0]
        assert d["completion"] == numbers + "<|im_end|>"
        assert all(x.isdigit() for x in numbers.split())
