"""The OpenAI-compatible endpoint: every call's exact tokens, loss mask and log-probs recorded, each
prompt extending the previous call's tokens; the openai client over HTTP; refusals that say why."""

from __future__ import annotations

import json

import pytest
import pytest_asyncio
import torch

from tirl.agent.openai_server import ChatError, ChatRecorder, OpenAIEndpoint, template_policy
from tirl.engines import EngineConfig, SingleEnginePool
from tirl.engines.base import Generation, SamplingParams
from tirl.engines.hf import HFEngine

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "python",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string"}},
                "required": ["code"],
            },
        },
    }
]


class Spy:
    """The real engine, with every prompt it was given kept (what the model really saw)."""

    def __init__(self, engine):
        self.engine = engine
        self.prompts: list[list[int]] = []
        self.outputs: list[Generation] = []
        self.name = "spy"

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        self.prompts.append(list(prompt_ids))
        out = await self.engine.generate(prompt_ids, params)
        self.outputs.append(out)
        return out


class Scripted:
    """Answers each call with the next scripted text (tokenized): turns a random tiny model cannot write."""

    def __init__(self, tokenizer, turns: list[str]):
        self.tokenizer, self.turns = tokenizer, list(turns)
        self.prompts: list[list[int]] = []
        self.name = "scripted"

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        self.prompts.append(list(prompt_ids))
        ids = self.tokenizer(self.turns.pop(0), add_special_tokens=False)["input_ids"]
        return Generation(ids, [-0.5] * len(ids), "stop", version=3)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(tiny_model_dir):
    eng = HFEngine(
        EngineConfig(model=str(tiny_model_dir), device="cpu", max_model_len=1024, max_batch_size=8)
    )
    yield eng
    await eng.close()


def conversation() -> list[dict]:
    return [{"role": "system", "content": "Use the tool."}, {"role": "user", "content": "What is 6*7?"}]


async def test_each_prompt_extends_the_recorded_tokens_and_the_record_is_exact(
    engine, tokenizer, tiny_model_dir
):
    spy = Spy(engine)
    rec = ChatRecorder(SingleEnginePool(spy), tokenizer, max_response_tokens=200)
    messages = conversation()
    for turn in range(3):
        reply = await rec.complete(
            "t1", {"messages": messages, "max_tokens": 12, "seed": turn, "tools": TOOLS}
        )
        assert reply["tirl"]["trajectory_id"] == "t1"
        messages = [*messages, reply["choices"][0]["message"], {"role": "tool", "content": f"{turn}\n"}]
    traj = await rec.finish("t1", problem_id="p", sample_index=2)

    # Each call's prompt is the previous call's prompt + its generated ids + the agent's new tokens.
    for before, out, after in zip(spy.prompts, spy.outputs, spy.prompts[1:], strict=False):
        assert after[: len(before) + len(out.token_ids)] == before + out.token_ids
    full = traj.prompt_ids + traj.response_ids
    assert full == spy.prompts[-1] + spy.outputs[-1].token_ids
    assert traj.prompt_ids == spy.prompts[0] and (traj.problem_id, traj.sample_index, traj.turns) == (
        "p",
        2,
        3,
    )
    # Loss mask 1 exactly on the generated ids, their sampling log-probs in place, 0 elsewhere.
    generated = [i for i, m in enumerate(traj.loss_mask) if m]
    assert len(generated) == sum(len(o.token_ids) for o in spy.outputs)
    assert [traj.logprobs[i] for i in generated] == [lp for o in spy.outputs for lp in o.logprobs]
    assert all(traj.logprobs[i] == 0.0 for i, m in enumerate(traj.loss_mask) if not m)
    # The trainer recomputes the same log-probs on the recorded sequence (what GRPO and TIS compare).
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([full])).logits[0], dim=-1)
    start = len(traj.prompt_ids)
    ref = [logp[start + i - 1, full[start + i]].item() for i in generated]
    torch.testing.assert_close(
        torch.tensor(ref), torch.tensor([traj.logprobs[i] for i in generated]), atol=1e-3, rtol=0
    )


async def test_turn_boundary_parity_with_the_template_rendering(tokenizer):
    """Generated turns that end with <|im_end|>: the recorded tokens are the template's rendering of the
    whole conversation tokenized whole (segments tokenized alone add up to it)."""
    turns = ["I will compute.<|im_end|>", "It is 42.<|im_end|>"]
    rec = ChatRecorder(SingleEnginePool(Scripted(tokenizer, turns)), tokenizer)
    messages = conversation()
    for _ in turns:
        reply = await rec.complete("t", {"messages": messages})
        messages = [*messages, reply["choices"][0]["message"], {"role": "tool", "content": "42"}]
    traj = await rec.finish("t")
    rendered = tokenizer.apply_chat_template(messages[:-1], tokenize=False)
    assert rendered.endswith("<|im_end|>\n")  # the template's "\n" after the last turn: not generated
    whole = tokenizer(rendered[:-1], add_special_tokens=False)["input_ids"]
    assert traj.prompt_ids + traj.response_ids == whole
    assert set(traj.versions) == {3}  # the engine's policy version on every token


async def test_tool_calls_come_back_as_openai_tool_calls_without_drift(tokenizer):
    call = '<tool_call>\n{"name": "python", "arguments": {"code": "print(6*7)"}}\n</tool_call><|im_end|>'
    rec = ChatRecorder(SingleEnginePool(Scripted(tokenizer, [call, "42<|im_end|>"])), tokenizer)
    reply = await rec.complete("t", {"messages": conversation(), "tools": TOOLS})
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and not reply["tirl"]["drift"]
    [tc] = choice["message"]["tool_calls"]
    assert tc["function"]["name"] == "python" and json.loads(tc["function"]["arguments"]) == {
        "code": "print(6*7)"
    }
    # The client re-serializes the call (null content, its own argument JSON): still the same history.
    echoed = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{**tc, "function": {**tc["function"], "arguments": '{"code":"print(6*7)"}'}}],
    }
    history = [*conversation(), echoed, {"role": "tool", "content": "42", "tool_call_id": tc["id"]}]
    await rec.complete("t", {"messages": history, "tools": TOOLS})
    traj = await rec.finish("t")
    assert [c.status for c in traj.tool_calls] == ["ok"] and traj.tool_calls[0].code == "print(6*7)"


async def test_drift_keeps_the_generated_tokens_and_says_so(tokenizer):
    """The model wrote the call's JSON compactly; the template re-renders it spaced: the recorded turn
    stays the model's tokens, the next prompt extends them, the response says drift."""
    call = '<tool_call>{"name":"python","arguments":{"code":"1"}}</tool_call><|im_end|>'
    engine = Scripted(tokenizer, [call, "done<|im_end|>"])
    rec = ChatRecorder(SingleEnginePool(engine), tokenizer)
    first = await rec.complete("t", {"messages": conversation(), "tools": TOOLS})
    assert first["tirl"]["drift"] and "generated tokens are kept" in rec.recording("t").drift[0]
    generated = tokenizer(call, add_special_tokens=False)["input_ids"]
    history = [*conversation(), first["choices"][0]["message"], {"role": "tool", "content": "1"}]
    await rec.complete("t", {"messages": history, "tools": TOOLS})
    assert engine.prompts[1][: len(engine.prompts[0]) + len(generated)] == engine.prompts[0] + generated

    strict = ChatRecorder(SingleEnginePool(Scripted(tokenizer, [call])), tokenizer, on_drift="error")
    first = await strict.complete("s", {"messages": conversation(), "tools": TOOLS})
    with pytest.raises(ChatError, match="drifted") as err:
        await strict.complete(
            "s",
            {"messages": [*conversation(), first["choices"][0]["message"], {"role": "tool", "content": "1"}]},
        )
    assert err.value.status == 409


async def test_the_offline_drift_check_agrees_with_the_recorder(tokenizer):
    """tirl.agent.drift on a recording: no difference where the recorder saw none (two tool calls in one
    turn, their tool messages back to back, then another tool turn); where the recorder kept a turn the
    template renders otherwise (compact JSON), the check finds it at that turn, in every later context."""
    from tirl.agent.drift import check_drift

    def call(code: str, compact: bool = False) -> str:
        body = {"name": "python", "arguments": {"code": code}}
        text = json.dumps(body, separators=(",", ":")) if compact else json.dumps(body)
        return f"<tool_call>\n{text}\n</tool_call>"

    for turns, drift in (
        ([call("1") + "\n" + call("2") + "<|im_end|>", call("3") + "<|im_end|>", "42<|im_end|>"], False),
        ([call("1", compact=True) + "<|im_end|>", call("3") + "<|im_end|>", "42<|im_end|>"], True),
    ):
        rec = ChatRecorder(SingleEnginePool(Scripted(tokenizer, turns)), tokenizer)
        messages = conversation()
        for outputs in (["1", "2"] if not drift else ["1"], ["3"], []):
            reply = await rec.complete("t", {"messages": messages, "tools": TOOLS})
            messages += [reply["choices"][0]["message"], *({"role": "tool", "content": o} for o in outputs)]
        recorded = list(rec.recording("t").messages)
        assert bool(rec.recording("t").drift) is drift
        traj = await rec.finish("t")
        report = check_drift(tokenizer, recorded, TOOLS, traj)
        assert report.renderings == 4
        if not drift:
            assert report.differences == []
            continue
        generated = tokenizer(turns[0], add_special_tokens=False)["input_ids"]
        rendered = tokenizer(call("1") + "<|im_end|>", add_special_tokens=False)["input_ids"]
        off = next(i for i, (a, b) in enumerate(zip(generated, rendered, strict=False)) if a != b)
        at = len(traj.prompt_ids) + off
        assert [(d.where, d.position) for d in report.differences] == [
            ("context of turn 1", at),
            ("context of turn 2", at),
            ("whole conversation", at),
        ]


async def test_an_edited_history_and_unsupported_requests_are_refused(tokenizer):
    rec = ChatRecorder(SingleEnginePool(Scripted(tokenizer, ["a<|im_end|>"])), tokenizer)
    reply = await rec.complete("t", {"messages": conversation()})
    edited = [conversation()[0], {"role": "user", "content": "What is 7*6?"}, reply["choices"][0]["message"]]
    with pytest.raises(ChatError, match=r"message 1 .* differs") as err:
        await rec.complete("t", {"messages": [*edited, {"role": "user", "content": "go on"}]})
    assert err.value.status == 409
    with pytest.raises(ChatError, match="adds none"):
        await rec.complete("t", {"messages": [*conversation(), reply["choices"][0]["message"]]})
    with pytest.raises(ChatError, match="stream"):
        await rec.complete("u", {"messages": conversation(), "stream": True})
    with pytest.raises(ChatError, match="n must be 1"):
        await rec.complete("u", {"messages": conversation(), "n": 2})


async def test_qwen3_thinking_is_kept_within_a_query_and_a_new_query_is_refused(qwen3):
    assert template_policy(qwen3).family == "qwen3"
    turns = ["<think>\nuse python\n</think>\n\ncalling<|im_end|>", "<think>\nok\n</think>\n\n42<|im_end|>"]
    engine = Scripted(qwen3, turns)
    rec = ChatRecorder(SingleEnginePool(engine), qwen3)
    first = await rec.complete("t", {"messages": conversation()})
    assert not first["tirl"]["drift"]
    assert "<think>" in first["choices"][0]["message"]["content"]  # the agent sees the thinking
    history = [*conversation(), first["choices"][0]["message"], {"role": "tool", "content": "42"}]
    second = await rec.complete("t", {"messages": history})
    assert not second["tirl"]["drift"]
    with pytest.raises(ChatError, match="qwen3") as err:
        await rec.complete(
            "t",
            {
                "messages": [
                    *history,
                    second["choices"][0]["message"],
                    {"role": "user", "content": "and 6*8?"},
                ]
            },
        )
    assert "new trajectory" in str(err.value)


def test_openai_client_over_http(engine, tokenizer):
    """A plain `openai` client, base URL per trajectory; the trajectory comes back from finish."""
    openai = pytest.importorskip("openai")

    endpoint = OpenAIEndpoint(ChatRecorder(SingleEnginePool(engine), tokenizer, max_response_tokens=64))
    try:
        client = openai.OpenAI(base_url=endpoint.base_url("traj-7"), api_key="unused")
        messages = conversation()
        reply = client.chat.completions.create(model="tirl", messages=messages, max_tokens=8, seed=1)
        assert reply.choices[0].finish_reason in ("stop", "length")
        messages += [
            reply.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "content": "42"},
        ]
        client.chat.completions.create(model="tirl", messages=messages, max_tokens=8, seed=2)
        with pytest.raises(openai.ConflictError, match="differs"):
            client.chat.completions.create(
                model="tirl", messages=[messages[0], {"role": "user", "content": "x"}, *messages[2:]]
            )
        with pytest.raises(openai.BadRequestError, match="name the trajectory"):
            openai.OpenAI(base_url=f"{endpoint.url}/v1", api_key="unused").chat.completions.create(
                model="tirl", messages=messages
            )
        traj = endpoint.finish("traj-7")
        assert traj.turns == 2 and sum(traj.loss_mask) <= 16 and len(traj.response_ids) == len(traj.loss_mask)
        with pytest.raises(ChatError, match="no trajectory"):
            endpoint.finish("traj-7")
    finally:
        endpoint.close()


def test_an_idle_connection_outlives_the_clients_keep_alive(engine, tokenizer):
    """An agent's connection idles while its tool runs; the endpoint must not be the side that closes
    it first (httpx drops idle connections after 5 s), or a request sent as it closes is lost."""
    import http.client
    import time

    endpoint = OpenAIEndpoint(ChatRecorder(SingleEnginePool(engine), tokenizer, max_response_tokens=8))
    host, port = endpoint.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        sockets = []
        for wait in (0.0, 6.0):  # longer than httpx's and uvicorn's default 5 s
            time.sleep(wait)
            conn.request("GET", "/health")  # raises RemoteDisconnected if the server closed it
            response = conn.getresponse()
            assert response.status == 200, f"answered {response.status} after {wait} s idle"
            response.read()  # the whole body, so the next request starts on a clean stream
            sockets.append(conn.sock)
        assert sockets[0] is sockets[1], "the client had to reconnect"
    finally:
        conn.close()
        endpoint.close()


def tirl_system_prompt(cfg) -> str:
    """tirl's built-in ChatML system turn (agent.use_chat_template=false) as one system message."""
    from tirl.agent.protocol import tool_schemas

    lines = "\n".join(json.dumps(s, ensure_ascii=False) for s in tool_schemas(cfg))
    return f"{cfg.system_prompt}\n\n# Tools\n<tools>\n{lines}\n</tools>"


async def test_an_openai_agent_records_what_tirls_own_loop_records(tokenizer):
    """The demo's protocol (built-in ChatML, "<reason>" prefill, turns cut at </tool_call>): the endpoint's
    trajectory has the token ids and loss mask tirl's agent loop builds for the same turns."""
    from tirl.agent import AgentConfig, build_prompt_ids, render_tool_response

    cfg = AgentConfig(system_prompt="Use the python tool.", user_prompt="{problem}", use_chat_template=False)
    call = ' <tool_call>\n{"name": "execute_python_code_with_standard_io", "arguments": {"code": "print(6*7)"}}\n</tool_call>'
    turns, output = [call, "</reason><answer>\\boxed{42}</answer><|im_end|>"], "42\n[ok]"
    rec = ChatRecorder(SingleEnginePool(Scripted(tokenizer, turns)), tokenizer, prefill=cfg.prefill)
    messages = [{"role": "system", "content": tirl_system_prompt(cfg)}, {"role": "user", "content": "6*7?"}]
    first = await rec.complete("t", {"messages": messages, "stop": ["</tool_call>"]})
    messages += [first["choices"][0]["message"], {"role": "tool", "content": output}]
    await rec.complete("t", {"messages": messages, "stop": ["</tool_call>"]})
    traj = await rec.finish("t")

    def enc(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    segment = render_tool_response(tokenizer, [output], cfg)
    assert traj.prompt_ids == build_prompt_ids(tokenizer, "6*7?", cfg)
    assert traj.response_ids == enc(call) + segment + enc(turns[1])
    assert traj.loss_mask == [1] * len(enc(call)) + [0] * len(segment) + [1] * len(enc(turns[1]))
    assert traj.finish_reason == "answered" and traj.answer_blocks == 1
    assert [c.status for c in traj.tool_calls] == ["ok"]
