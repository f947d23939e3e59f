"""An OpenAI-compatible /v1/chat/completions in front of tirl's engines that records each trajectory
exactly, so an agent written against the OpenAI API trains as tirl's own loop does.

An agent addresses its trajectory by base URL, `http://HOST:PORT/t/<trajectory id>/v1` (or sends the
header `X-Trajectory-Id` to /v1/chat/completions), and talks to it with any OpenAI client. Per
trajectory the recorder keeps the exact token ids the engine saw and generated, the loss mask (1:
generated, 0: everything the agent added), the sampling log-prob of every generated token and its
policy version: `finish(tid)` hands back a tirl `Trajectory`, which the reward, RoC and GRPO take
like any other.

No re-tokenization drift across turns. The first request's prompt is the chat template's rendering of
its messages. Each later request must repeat the conversation so far (the messages it sent and the
assistant messages it got back) and add new ones; only the new messages are rendered, as the text the
template adds after the recorded conversation, and appended as tokens tokenized on their own. The
generated turns stay the token ids the engine sampled, never their text re-encoded, so each call's
prompt extends the previous call's tokens by construction. Where the template would render an
earlier assistant turn differently from what the model generated (tool-call JSON re-formatted, text
trimmed), the model's own tokens are kept and the turn is reported as drift (`drift` in the
response's `tirl` field and in the recording); `on_drift="error"` refuses the next request instead.
A request whose history differs from the recording, or whose template re-renders the history
differently (see below), is refused with HTTP 409 saying where.

Thinking models, per chat template family (`template_policy`):
- qwen3: the template drops the <think> blocks of assistant turns before the latest user message.
  Within one user query (an agent calling tools: tirl's setting) the history renders as generated
  and the thinking is kept; a NEW user message after a thinking turn would rewrite the history, so it
  is refused (409): start a new trajectory for a new query.
- llama3 and chatml (Qwen2.5, tirl's tiny model): no thinking in the template; histories extend.
Anything else is treated like chatml and checked the same way (a 409 says when it does not extend).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from contextlib import AsyncExitStack, suppress
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tirl.agent.protocol import ToolCall, count_answer_blocks, parse_tool_calls
from tirl.agent.trajectory import ToolCallRecord, ToolCallStatus, Trajectory
from tirl.engines.base import EnginePool, SamplingParams

DriftPolicy = Literal["keep", "error"]


class ChatError(Exception):
    """A request the recorder refuses; `status` is the HTTP status it answers with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class TemplatePolicy:
    family: str  # qwen3 | llama3 | chatml
    end_of_turn: str  # the token that closes an assistant turn
    thinking: str  # how thinking in earlier turns is handled (docs, 409 messages)


def template_policy(tokenizer) -> TemplatePolicy:
    """The chat template's family, read from the template text itself."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if "<|eot_id|>" in template:
        return TemplatePolicy("llama3", "<|eot_id|>", "no thinking in the template: histories extend")
    if "</think>" in template and "<|im_end|>" in template:
        return TemplatePolicy(
            "qwen3",
            "<|im_end|>",
            "the template drops <think> blocks before the latest user message: thinking is kept within "
            "one user query; a new user message after a thinking turn needs a new trajectory",
        )
    return TemplatePolicy("chatml", "<|im_end|>", "no thinking in the template: histories extend")


@dataclass
class Recording:
    """One trajectory as the engine saw it."""

    trajectory_id: str
    group: str
    prompt_ids: list[int]
    ids: list[int]  # prompt + every token since (generated or added by the agent)
    messages: list[dict]  # the conversation so far, assistant messages as the recorder returned them
    tools: list[dict] | None
    loss_mask: list[int] = field(default_factory=list)  # per token after the prompt
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    closing: str = ""  # what the template writes after the last generated turn (e.g. "\n")
    turns: int = 0
    drift: list[str] = field(default_factory=list)
    last_finish: str = "stop"
    generated_text: list[str] = field(default_factory=list)  # per turn, for reward and tool statistics
    engine: str = ""
    gen_seconds: float = 0.0
    stack: AsyncExitStack = field(default_factory=AsyncExitStack)  # holds the engine lease
    engine_handle: Any = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def _norm_message(m: dict) -> dict:
    """What must match between the recorded history and a request's copy of it (OpenAI clients
    re-serialize messages: null vs "", argument JSON spacing, extra keys)."""
    calls = []
    for tc in m.get("tool_calls") or []:
        fn = tc.get("function", tc)
        args = fn.get("arguments")
        if isinstance(args, str):
            with suppress(json.JSONDecodeError):
                args = json.loads(args)
        calls.append((fn.get("name"), json.dumps(args, sort_keys=True)))
    content = m.get("content") or ""
    if isinstance(content, list):  # content parts: the text ones, joined
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return {"role": m.get("role"), "content": content, "tool_calls": calls}


def _first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class ChatRecorder:
    """Serves chat completions on an EnginePool and records every trajectory in token space."""

    def __init__(
        self,
        pool: EnginePool,
        tokenizer,
        *,
        max_response_tokens: int = 8192,
        on_drift: DriftPolicy = "keep",
        chat_template_kwargs: dict | None = None,
        prefill: str = "",
    ):
        self.pool = pool
        self.tokenizer = tokenizer
        self.max_response_tokens = max_response_tokens
        self.on_drift = on_drift
        self.policy = template_policy(tokenizer)
        self.template_kwargs = dict(chat_template_kwargs or {})
        # Written after every assistant header before the model generates (tirl's agent.prefill, e.g.
        # "<reason>"): loss mask 0, and part of the assistant message's content the agent gets back.
        self.prefill = prefill
        self._recordings: dict[str, Recording] = {}
        eot = tokenizer.convert_tokens_to_ids(self.policy.end_of_turn)
        self.eot_id = eot
        ids = {eot, tokenizer.eos_token_id}
        self.stop_ids = sorted(i for i in ids if isinstance(i, int) and i != tokenizer.unk_token_id)

    # --- rendering --------------------------------------------------------------------------------
    def render(self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            add_generation_prompt=generation_prompt,
            tokenize=False,
            **self.template_kwargs,
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    # --- one request ------------------------------------------------------------------------------
    async def complete(self, trajectory_id: str, request: dict, group: str | None = None) -> dict:
        """One /v1/chat/completions request of a trajectory: the OpenAI response (plus a `tirl` field)."""
        _check_supported(request)
        messages = list(request.get("messages") or [])
        if not messages:
            raise ChatError(400, "messages is empty")
        rec = self._recordings.get(trajectory_id)
        if rec is None:
            rec = await self._open(trajectory_id, messages, request.get("tools"), group or trajectory_id)
            added = 0
        else:
            if rec.lock.locked():
                raise ChatError(
                    409, f"trajectory {trajectory_id!r} has a request in flight: send one at a time"
                )
            added = self._extend(rec, messages)
        async with rec.lock:
            return await self._generate(rec, request, added)

    async def _open(self, tid: str, messages: list[dict], tools: list[dict] | None, group: str) -> Recording:
        prompt_ids = self.encode(self.render(messages, tools, generation_prompt=True))
        rec = Recording(tid, group, prompt_ids, list(prompt_ids), [dict(m) for m in messages], tools)
        budget = len(prompt_ids) + self.max_response_tokens
        rec.engine_handle = await rec.stack.enter_async_context(self.pool.lease(group, budget))
        rec.engine = str(getattr(rec.engine_handle, "name", type(rec.engine_handle).__name__))
        self._recordings[tid] = rec
        return rec

    def _extend(self, rec: Recording, messages: list[dict]) -> int:
        """Append the request's new messages as tokens (loss mask 0); the number of tokens added."""
        if self.on_drift == "error" and rec.drift:
            raise ChatError(409, f"trajectory {rec.trajectory_id!r} drifted: {rec.drift[-1]}")
        known = len(rec.messages)
        for i, (mine, theirs) in enumerate(zip(rec.messages, messages, strict=False)):
            if _norm_message(mine) != _norm_message(theirs):
                raise ChatError(
                    409,
                    f"message {i} ({mine.get('role')}) differs from the recorded trajectory: a trajectory's "
                    "history must be repeated as it was (start a new trajectory id to change it)",
                )
        if len(messages) <= known:
            raise ChatError(409, f"the request repeats the {known} recorded messages but adds none")
        new = [dict(m) for m in messages[known:]]
        before = self.render(rec.messages, rec.tools, generation_prompt=False)
        after = self.render(rec.messages + new, rec.tools, generation_prompt=True)
        if not after.startswith(before):
            at = _first_difference(before, after)
            raise ChatError(
                409,
                f"the chat template ({self.policy.family}) renders the recorded history differently once "
                f"the new messages are added (at character {at}: {before[at : at + 40]!r} became "
                f"{after[at : at + 40]!r}), so the new prompt cannot extend the recorded tokens; "
                f"{self.policy.thinking}",
            )
        segment = self.encode(rec.closing + after[len(before) :])
        self._append(rec, segment)
        rec.messages += new
        rec.closing = ""
        return len(segment)

    @staticmethod
    def _append(rec: Recording, tokens: list[int]) -> None:
        """Tokens the model did not generate: loss mask 0; version: the last turn's (as tirl's loop)."""
        rec.ids += tokens
        rec.loss_mask += [0] * len(tokens)
        rec.logprobs += [0.0] * len(tokens)
        rec.versions += [rec.versions[-1] if rec.versions else 0] * len(tokens)

    async def _generate(self, rec: Recording, request: dict, added: int) -> dict:
        left = self.max_response_tokens - len(rec.loss_mask)
        if left <= 0:
            raise ChatError(
                400, f"trajectory {rec.trajectory_id!r} used its {self.max_response_tokens} tokens"
            )
        wanted = request.get("max_completion_tokens") or request.get("max_tokens") or left
        stop = request.get("stop") or []
        params = SamplingParams(
            temperature=float(request.get("temperature", 1.0)),
            top_p=float(request.get("top_p", 1.0)),
            max_tokens=min(int(wanted), left),
            stop_token_ids=list(self.stop_ids),
            stop_strings=[stop] if isinstance(stop, str) else list(stop),
            seed=request.get("seed"),
        )
        if self.prefill and rec.loss_mask:
            self._append(rec, self.encode(self.prefill))
        elif self.prefill:  # the first turn: part of the prompt, as in tirl's loop
            rec.prompt_ids += self.encode(self.prefill)
            rec.ids = list(rec.prompt_ids)
        start = time.perf_counter()
        gen = await rec.engine_handle.generate(list(rec.ids), params)
        rec.gen_seconds += time.perf_counter() - start
        rec.ids += gen.token_ids
        rec.loss_mask += [1] * len(gen.token_ids)
        rec.logprobs += list(gen.logprobs)
        rec.versions += [gen.version] * len(gen.token_ids)
        rec.turns += 1
        rec.last_finish = gen.finish_reason
        ended = bool(gen.token_ids) and gen.token_ids[-1] in self.stop_ids
        body = gen.token_ids[:-1] if ended else gen.token_ids
        text = self.prefill + self.tokenizer.decode(body, skip_special_tokens=False)
        rec.generated_text.append(text)
        message = self._assistant_message(text, rec.tools)
        generated = self.prefill + self.tokenizer.decode(gen.token_ids, skip_special_tokens=False)
        self._close_turn(rec, message, generated, ended and gen.token_ids[-1] == self.eot_id)
        return self._response(rec, message, gen.finish_reason, len(gen.token_ids), added, request)

    def _assistant_message(self, text: str, tools: list[dict] | None) -> dict:
        """The turn as an OpenAI assistant message: well-formed <tool_call> blocks become tool_calls
        when the request declared tools (a malformed one stays in the text for the agent to see)."""
        calls = parse_tool_calls(text, tools=tools) if tools else []
        good = [c for c in calls if isinstance(c, ToolCall)]
        if not good or len(good) != len(calls):
            return {"role": "assistant", "content": text}
        content = text
        for c in reversed(good):
            content = content[: c.start] + content[c.end :]
        tool_calls = [
            {
                "id": f"call_{uuid.uuid4().hex[:12]}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
            }
            for c in good
        ]
        return {"role": "assistant", "content": content.strip(), "tool_calls": tool_calls}

    def _close_turn(self, rec: Recording, message: dict, generated: str, ended_with_eot: bool) -> None:
        """Record the assistant message and what the template writes after the generated tokens; a
        template rendering of the turn that differs from the generation is drift (tokens kept)."""
        prompt_text = self.render(rec.messages, rec.tools, generation_prompt=True)
        rendered = self.render([*rec.messages, message], rec.tools, generation_prompt=False)
        rec.messages.append(message)
        eot = self.policy.end_of_turn
        turn = rendered[len(prompt_text) :] if rendered.startswith(prompt_text) else ""
        tail = turn[len(generated) :]
        if turn.startswith(generated) and (ended_with_eot or tail.startswith(eot)):
            rec.closing = tail  # e.g. "\n" after <|im_end|>, or "<|im_end|>\n" after a stop string
            return
        # The template does not write the turn as generated: keep the model's tokens, close the turn
        # the way the template closes one, and say so.
        after_eot = turn.rsplit(eot, 1)[1] if eot in turn else ""
        rec.closing = after_eot if ended_with_eot else eot + after_eot
        at = _first_difference(generated, turn)
        rec.drift.append(
            f"turn {rec.turns}: the template renders the assistant turn as {turn[at : at + 40]!r} where the "
            f"model generated {generated[at : at + 40]!r} (character {at}); the generated tokens are kept"
        )

    def _response(
        self, rec: Recording, message: dict, finish: str, generated: int, added: int, request: dict
    ) -> dict:
        reason = (
            "tool_calls" if message.get("tool_calls") else finish if finish in ("stop", "length") else "stop"
        )
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": request.get("model") or "tirl",
            "choices": [{"index": 0, "message": message, "finish_reason": reason, "logprobs": None}],
            "usage": {
                "prompt_tokens": len(rec.ids) - generated,
                "completion_tokens": generated,
                "total_tokens": len(rec.ids),
            },
            "tirl": {
                "trajectory_id": rec.trajectory_id,
                "added_tokens": added,
                "drift": bool(rec.drift),
                "engine": rec.engine,
            },
        }

    # --- trajectories -----------------------------------------------------------------------------
    def recording(self, trajectory_id: str) -> Recording:
        try:
            return self._recordings[trajectory_id]
        except KeyError:
            raise ChatError(404, f"no trajectory {trajectory_id!r}") from None

    async def finish(self, trajectory_id: str, problem_id: str = "", sample_index: int = 0) -> Trajectory:
        """End a trajectory: release its engine, hand back its tirl Trajectory (reward still 0)."""
        rec = self.recording(trajectory_id)
        del self._recordings[trajectory_id]
        await rec.stack.aclose()
        return to_trajectory(
            rec, self.tokenizer, problem_id or trajectory_id, sample_index, self.max_response_tokens
        )

    async def close(self) -> None:
        for tid in list(self._recordings):
            await self.finish(tid)


def _check_supported(request: dict) -> None:
    if request.get("stream"):
        raise ChatError(400, "stream=true is not supported: the recorder answers whole turns")
    if int(request.get("n") or 1) != 1:
        raise ChatError(400, "n must be 1: one trajectory is one sequence of turns")


def to_trajectory(rec: Recording, tokenizer, problem_id: str, sample_index: int, budget: int) -> Trajectory:
    """The recording as tirl's Trajectory: what reward, RoC and the update read."""
    response_ids = rec.ids[len(rec.prompt_ids) :]
    full_text = tokenizer.decode(response_ids, skip_special_tokens=False)
    last = rec.generated_text[-1] if rec.generated_text else ""
    if rec.last_finish == "length" or len(response_ids) >= budget:
        finish = "length"
    else:
        finish = "answered" if count_answer_blocks(last) else "no_answer"
    return Trajectory(
        problem_id=problem_id,
        prompt_ids=list(rec.prompt_ids),
        response_ids=response_ids,
        loss_mask=list(rec.loss_mask),
        logprobs=list(rec.logprobs),
        versions=list(rec.versions),
        response_text=full_text,
        turns=rec.turns,
        tool_calls=_tool_records(rec),
        answer_blocks=sum(count_answer_blocks(t) for t in rec.generated_text),
        finish_reason=finish,
        gen_seconds=rec.gen_seconds,
        engine=rec.engine,
        sample_index=sample_index,
    )


def _tool_records(rec: Recording) -> list[ToolCallRecord]:
    """The model's tool calls (RoC's p_err): a malformed block is "malformed"; a call's status is read
    from the tool message that answered it (a traceback or an "Error" line: runtime_error)."""
    answers = [m for m in rec.messages if m.get("role") == "tool"]
    records: list[ToolCallRecord] = []
    for turn, text in enumerate(rec.generated_text):
        for call in parse_tool_calls(text, tools=rec.tools or None):
            if not isinstance(call, ToolCall):
                records.append(ToolCallRecord(turn, "malformed", call.raw))
                continue
            answer = _norm_message(answers[len(records)])["content"] if len(records) < len(answers) else ""
            status: ToolCallStatus = "runtime_error" if _looks_failed(answer) else "ok"
            code = str(call.arguments.get("code", json.dumps(call.arguments)))
            records.append(ToolCallRecord(turn, status, code, tool=call.name))
    return records


def _looks_failed(output: str) -> bool:
    return "Traceback (most recent call last)" in output or output.lstrip().startswith("Error")


# ---- HTTP -----------------------------------------------------------------------------------------------


def create_app(recorder: ChatRecorder) -> FastAPI:
    """The FastAPI app: /t/{tid}/v1/chat/completions (or /v1/chat/completions with X-Trajectory-Id),
    /t/{tid}/finish (the trajectory as JSON), /t/{tid}/v1/models, /health."""
    app = FastAPI(title="tirl OpenAI-compatible endpoint")

    async def answer(tid: str | None, request: Request) -> JSONResponse:
        if not tid:
            return _error(400, "name the trajectory: base URL /t/<id>/v1 or header X-Trajectory-Id")
        try:
            body = await request.json()
            group = request.headers.get("x-tirl-group")
            return JSONResponse(await recorder.complete(tid, body, group=group))
        except ChatError as e:
            return _error(e.status, str(e))
        except ValueError as e:  # e.g. a prompt longer than the engine's context
            return _error(400, str(e))

    @app.post("/t/{tid}/v1/chat/completions")
    async def chat_by_path(tid: str, request: Request) -> JSONResponse:
        return await answer(tid, request)

    @app.post("/v1/chat/completions")
    async def chat_by_header(request: Request) -> JSONResponse:
        return await answer(request.headers.get("x-trajectory-id"), request)

    @app.post("/t/{tid}/finish")
    async def finish(tid: str, problem_id: str = "", sample_index: int = 0) -> JSONResponse:
        try:
            traj = await recorder.finish(tid, problem_id, sample_index)
        except ChatError as e:
            return _error(e.status, str(e))
        return JSONResponse(traj.to_dict())

    @app.get("/t/{tid}/v1/models")
    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "tirl", "object": "model", "owned_by": "tirl"}]}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "trajectories": len(recorder._recordings)}

    return app


def _error(status: int, message: str) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


# An agent's connection idles while its tools run. Whichever side closes an idle connection first races
# the other's next use of it: a server closing it just as the client sends drops that request (the
# client sees a connection error, not a status). Servers conventionally wait longer than clients
# (httpx, under the openai client, drops idle connections after 5 s; uvicorn's default is also 5 s).
KEEP_ALIVE_S = 75


class OpenAIEndpoint:
    """The app served by uvicorn on its own thread and event loop (the recorder and its engine leases
    live on that loop); `finish` is callable from any thread."""

    def __init__(self, recorder: ChatRecorder, host: str = "127.0.0.1", port: int = 0):
        import socket

        import uvicorn

        if port == 0:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        self.recorder = recorder
        self.url = f"http://{host}:{port}"
        config = uvicorn.Config(
            create_app(recorder), host=host, port=port, log_level="warning", timeout_keep_alive=KEEP_ALIVE_S
        )
        self._server = uvicorn.Server(config)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="tirl-openai-endpoint", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the OpenAI endpoint did not start on {self.url}")
            time.sleep(0.05)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._server.serve())

    def base_url(self, trajectory_id: str) -> str:
        """What an OpenAI client takes as base_url for one trajectory."""
        return f"{self.url}/t/{trajectory_id}/v1"

    def finish(self, trajectory_id: str, problem_id: str = "", sample_index: int = 0) -> Trajectory:
        coro = self.recorder.finish(trajectory_id, problem_id, sample_index)
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self.recorder.close(), self._loop).result()
            self._server.should_exit = True
            self._thread.join(timeout=30)
