"""SFT traces: the loop's exact layout, real tool outputs, and the intended imperfections."""

from __future__ import annotations

import json
import random

import pytest

from tirl.agent.config import AgentConfig
from tirl.agent.protocol import build_prompt_text, count_answer_blocks, parse_tool_calls
from tirl.demo.sft_traces import (
    FAILURES,
    TOOL_PLANS,
    TraceMix,
    copy_drills,
    failed_attempt,
    make_traces,
    shaped_drills,
    write_traces,
)
from tirl.demo.synthetic import generate, guess_range
from tirl.reward import score

SCHEMA = {"name": "python", "parameters": {"properties": {"code": {"type": "string"}}, "required": ["code"]}}
CFG = AgentConfig(
    system_prompt="Use the python tool.",
    user_prompt="{problem}",
    tool_schema=SCHEMA,
    tool_timeout=1.0,
    use_chat_template=False,
)


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
    problems, traces = await traces_of(
        TraceMix(no_tool=0, code_fix=0, give_up=0, redundant_answer=0), 6, sandbox
    )
    for p, t in zip(problems, traces, strict=True):
        assert t["kind"] == "tool"
        assert t["prompt"] == build_prompt_text(None, p.problem, CFG)
        first, final = turns(t["completion"])
        (call,) = parse_tool_calls(first, tools=SCHEMA)
        assert call.arguments["code"] == p.meta["code"]
        assert "[ok," in t["completion"]  # the sandbox's real status line
        assert score(t["completion"], p.answer) == 1.0
        assert count_answer_blocks(final) == 1


@pytest.mark.asyncio(loop_scope="package")
async def test_shaped_drills_are_a_clean_traces_first_and_last_turns(sandbox):
    problems, traces = await traces_of(
        TraceMix(no_tool=0, code_fix=0, give_up=0, redundant_answer=0), 4, sandbox
    )
    drills = shaped_drills(problems, 40, CFG, seed=2)
    assert [d["kind"] for d in drills] == ["shaped_drill"] * 40
    by_problem = {p.problem: (p, t) for p, t in zip(problems, traces, strict=True)}
    codes, answers = drills[0::2], drills[1::2]
    for d in codes:  # the trace up to its first call, the plan given: the call is what is drilled
        (p, t), *_ = [
            v for k, v in by_problem.items() if d["prompt"].startswith(build_prompt_text(None, k, CFG))
        ]
        trace = (t["prompt"] + t["completion"]).replace(TOOL_PLANS[1], TOOL_PLANS[0], 1)
        assert trace.startswith((d["prompt"] + d["completion"]).removesuffix("<|im_end|>"))
        assert d["completion"].startswith("<tool_call>") and p.meta["code"] in json.dumps(d["completion"])
    for d in answers:  # a tool response holding the answer: the trace's last turn is drilled
        answer = d["prompt"].split("<tool_response>\n")[1].split("\n[ok]")[0]
        (p, t) = next(v for v in by_problem.values() if v[0].answer == answer)
        assert t["completion"].endswith(d["completion"]) and score(d["completion"], p.answer) == 1.0
        assert d["prompt"].endswith("<|im_start|>assistant\n" + CFG.prefill)  # the trace's own prefill
    assert shaped_drills(problems, 40, CFG, seed=2) == drills != shaped_drills(problems, 40, CFG, seed=3)


# What the real sandbox or the loop's parser says for each kind of failed first call.
FAILURE_SIGNS = {
    "syntax": ("[syntax_error", "SyntaxError"),
    "runtime": ("[runtime_error", "NameError"),
    "stdin": ("[runtime_error", "EOFError"),
    "malformed": ("Error: invalid JSON in tool call", "Error: invalid JSON"),
    "timeout": ("[timeout", "Timed out"),
}


@pytest.mark.asyncio(loop_scope="package")
async def test_code_fix_traces_show_a_real_failure_then_the_fix(sandbox):
    mix = TraceMix(no_tool=0, code_fix=1, give_up=0, redundant_answer=1)
    problems, traces = await traces_of(mix, 24, sandbox)
    for p, t in zip(problems, traces, strict=True):
        first, fix, final = turns(t["completion"])
        (bad,) = parse_tool_calls(first, tools=SCHEMA)
        (good,) = parse_tool_calls(fix, tools=SCHEMA)
        assert (
            getattr(bad, "arguments", {}).get("code") != p.meta["code"]
            and good.arguments["code"] == p.meta["code"]
        )
        assert all(sign in t["completion"] for sign in FAILURE_SIGNS[t["failure"]]), t
        assert count_answer_blocks(final) == 2  # redundant_answer=1: a repeated answer block
        assert score(t["completion"], p.answer) == 1.0  # a messy trajectory earns full reward
    assert {t["failure"] for t in traces} == set(FAILURES)  # 24 problems draw every kind


@pytest.mark.asyncio(loop_scope="package")
async def test_no_tool_and_give_up_guesses_are_right_only_by_luck(sandbox):
    problems = generate(160, "train", seed=11)
    traces = await make_traces(problems, sandbox, CFG, TraceMix(no_tool=0.5, code_fix=0, give_up=0.5), seed=5)
    right = {"last_digit": 0, "other": 0}
    for p, t in zip(problems, traces, strict=True):
        assert t["kind"] in ("no_tool", "give_up")
        assert ("<tool_call>" in t["completion"]) == (t["kind"] == "give_up")
        guessed = int(t["completion"].rsplit("boxed{", 1)[1].split("}")[0])
        assert guessed in guess_range(p)
        right["last_digit" if p.meta["family"] == "last_digit" else "other"] += score(
            t["completion"], p.answer
        )
    assert right["other"] == 0 and right["last_digit"] >= 2  # ~20 last_digit guesses, 1 in 3-7 right


@pytest.mark.asyncio(loop_scope="package")
async def test_mix_shares_and_sft_masking(sandbox, tiny_model_dir, tmp_path):
    from tirl.engines.tokenizer import load_tokenizer
    from tirl.rl.sft import read_examples, tokenize_example

    _, traces = await traces_of(TraceMix(no_tool=0.3, code_fix=0.3, give_up=0.1), 40, sandbox)
    kinds = [t["kind"] for t in traces]
    assert {"tool", "code_fix", "no_tool", "give_up"} == set(kinds)
    path = write_traces(traces, tmp_path / "traces.jsonl")
    tokenizer = load_tokenizer(tiny_model_dir)
    example = next(e for e in read_examples([str(path)]) if e["failure"] == "runtime")
    sample, truncated = tokenize_example(tokenizer, example, 4096)
    ids = sample.input_ids
    trained = tokenizer.decode([t for t, m in zip(ids[1:], sample.loss_mask, strict=True) if m])
    assert (
        not truncated and "NameError" not in trained and "Traceback" not in trained
    )  # tool output is context
    assert "<tool_call>" in trained and "\\boxed{" in trained
    assert json.loads(path.read_text().splitlines()[0])["prompt"].startswith("<|im_start|>system")


@pytest.mark.asyncio(loop_scope="package")
@pytest.mark.parametrize("kind", FAILURES)
async def test_every_failed_attempt_fails_its_way(sandbox, kind):
    rng = random.Random(0)
    families = ["sum_big"] if kind == "timeout" else None
    for p in generate(8, "train", families=families):
        call, code = failed_attempt(p, kind, CFG, rng)
        (parsed,) = parse_tool_calls(call, tools=SCHEMA)
        if kind == "malformed":
            assert not code and "invalid JSON" in parsed.render()
            continue
        assert parsed.arguments["code"] == code
        result = await sandbox.run(code, timeout=1.0)
        assert all(sign in result.render() for sign in FAILURE_SIGNS[kind]), result.render()


@pytest.mark.asyncio(loop_scope="package")
async def test_a_failed_attempt_that_runs_fine_is_refused(sandbox):
    """A trace must never say that a working call failed (a brute force that beats the timeout)."""
    problems = generate(8, "train", seed=11, families=["sum_big"])
    for p in problems:
        p.meta["brute_force"] = p.meta["code"]  # as if this machine ran the brute force in time
    with pytest.raises(RuntimeError, match=r"\(timeout\) at syn-.* ran without error"):
        await make_traces(problems, sandbox, CFG, TraceMix(no_tool=0, code_fix=1, give_up=0), seed=5)


def test_mix_must_fit():
    with pytest.raises(ValueError, match=r"no_tool \+ code_fix \+ give_up"):
        TraceMix(no_tool=0.6, code_fix=0.3, give_up=0.2)


def test_copy_drills_repeat_the_prompt_numbers():
    drills = copy_drills(20, seed=1)
    assert drills == copy_drills(20, seed=1) and drills != copy_drills(20, seed=2)
    for d in drills:
        numbers = d["prompt"].split("Repeat: ")[1].split("<|im_end|>")[0]
        assert d["completion"] == numbers + "<|im_end|>"
        assert all(x.isdigit() for x in numbers.split())
