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

Over HTTP (docs/security.md, "HTTP servers"): every request passes tirl's HTTP guard (Host allowlist,
JSON-only POSTs, optional bearer token, bounded bodies); trajectory ids are issued by the endpoint
(unguessable), and a request may only open an id it issued. Each request is validated by a pydantic
model (a malformed one answers 400, sampling parameters out of range included). A request is atomic:
one that fails, is refused or whose client disconnects leaves its trajectory as it was, and the first
request of a trajectory that fails releases the engine lease it took. A trajectory left idle for
`idle_timeout_s` after its last request (an agent that died) is dropped and its lease released; an
id not yet used stays valid until its first request (an agent may start late). Chat templates render and
tokenize on worker threads, so one huge request does not stall the other agents' requests.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import threading
import time
from collections import OrderedDict
from contextlib import AsyncExitStack, asynccontextmanager, suppress
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tirl.agent.framing import Piece, encode_framed
from tirl.agent.protocol import ToolCall, count_answer_blocks, parse_tool_calls
from tirl.agent.trajectory import ToolCallRecord, ToolCallStatus, Trajectory, generated_runs
from tirl.engines.base import EnginePool, SamplingParams
from tirl.http_guard import GuardPolicy, HTTPGuard, Refusal, header_deadline_protocol, unguessable_id
from tirl.ports import free_port

DriftPolicy = Literal["keep", "error"]


class ChatError(Exception):
    """A request the recorder refuses; `status` is the HTTP status it answers with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


# ---- the request, validated -------------------------------------------------------------------------------

MAX_STOP_STRINGS = 16
# JSON objects and arrays in one request. pydantic validates a body in one call that holds the GIL, so
# it blocks the event loop whatever thread runs it: 4 MiB of empty messages (135k objects) held it for
# 1.1 s on 2 loaded cores. A real trajectory's request holds hundreds; this bounds it to ~0.2 s.
MAX_JSON_CONTAINERS = 20_000
MAX_STOP_CHARS = 256
MAX_UNUSED_IDS = 1 << 20  # ids issued and not yet used, kept until first use (then the oldest goes)
NAME = re.compile(r"[A-Za-z0-9._-]{0,64}")  # a trajectory name: it goes into URL paths


class _Open(BaseModel):
    """Objects whose unknown keys are kept (clients add their own, templates may read them)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class ContentPart(_Open):
    type: str
    text: str | None = None


class FunctionCall(_Open):
    name: str
    arguments: str | dict[str, Any] = ""


class ToolCallIn(_Open):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class Message(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class FunctionSpec(_Open):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolSpec(_Open):
    type: Literal["function"] = "function"
    function: FunctionSpec


class ChatRequest(BaseModel):
    """The fields of /v1/chat/completions the recorder reads; any other field is ignored."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    messages: list[Message]
    tools: list[ToolSpec] | None = None
    model: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stream: bool | None = None
    n: int | None = None

    def stop_strings(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP_STRINGS or any(not 0 < len(s) <= MAX_STOP_CHARS for s in stop):
            raise ChatError(
                400, f"stop: at most {MAX_STOP_STRINGS} strings of 1 to {MAX_STOP_CHARS} characters each"
            )
        return stop


# JSON may escape a lone surrogate (`"\ud800"`: undecodable bytes a tool's output held, decoded with
# surrogateescape); json.loads joins real pairs, so any surrogate left in a str is a lone one.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _valid_unicode(value: Any) -> Any:
    """A copy of `value` with every lone surrogate in its strings (keys included) replaced by U+FFFD:
    the tokenizer cannot encode one (a 500 deep in a turn), and tirl's own tool text shows such bytes
    so. Iterative: a body may nest as deeply as json.loads allows. A 400 past MAX_JSON_CONTAINERS."""
    root: list[Any] = [None]
    stack: list[tuple[Any, Any, Any]] = [(value, root, 0)]
    containers = 0
    while stack:
        item, parent, key = stack.pop()
        if isinstance(item, list | dict):
            containers += 1
            if containers > MAX_JSON_CONTAINERS:
                raise ChatError(
                    400, f"the request holds more than {MAX_JSON_CONTAINERS} JSON objects and arrays"
                )
        if isinstance(item, str):
            parent[key] = _LONE_SURROGATE.sub("\ufffd", item)
        elif isinstance(item, list):
            parent[key] = copy = [None] * len(item)
            stack += [(v, copy, i) for i, v in enumerate(item)]
        elif isinstance(item, dict):
            parent[key] = copy = {}
            for k, v in item.items():
                k = _LONE_SURROGATE.sub("\ufffd", k) if isinstance(k, str) else k
                copy[k] = None  # keeps the keys' order
                stack.append((v, copy, k))
        else:
            parent[key] = item
    return root[0]


def parse_request(request: Any) -> ChatRequest:
    """The request body as a ChatRequest, or a 400 that names each wrong field."""
    if not isinstance(request, dict):
        raise ChatError(400, f"the body must be a JSON object, not {type(request).__name__}")
    try:
        req = ChatRequest.model_validate(_valid_unicode(request))
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in e.errors()[:8]
        )
        raise ChatError(400, f"invalid request: {problems}") from None
    if req.stream:
        raise ChatError(400, "stream=true is not supported: the recorder answers whole turns")
    if req.n is not None and req.n != 1:
        raise ChatError(400, "n must be 1: one trajectory is one sequence of turns")
    if not req.messages:
        raise ChatError(400, "messages is empty")
    return req


def _parsed(request: Any) -> tuple[ChatRequest, list[dict], list[dict] | None]:
    """The request validated, with its messages and tools as dicts."""
    req = parse_request(request)
    messages = [m.model_dump(exclude_unset=True) for m in req.messages]
    tools = [t.model_dump(exclude_unset=True) for t in req.tools] if req.tools else None
    return req, messages, tools


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
    last_used: float = field(default_factory=time.monotonic)

    def snapshot(self) -> dict[str, Any]:
        """The state a request may change (every field but the trajectory's identity, its lease and
        lock), lists copied: a request that fails is undone with `restore`."""
        return {
            f.name: _copy(getattr(self, f.name)) for f in fields(self) if f.name not in _NOT_REQUEST_STATE
        }

    def restore(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self, name, value)


_NOT_REQUEST_STATE = frozenset(
    {"trajectory_id", "group", "tools", "engine", "stack", "engine_handle", "lock", "last_used"}
)


def _copy(value: Any) -> Any:
    return list(value) if isinstance(value, list) else value


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
        content = "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    return {"role": m.get("role"), "content": content, "tool_calls": calls}


def _text_content(m: dict) -> dict:
    """A copy of the message; a tool message's content parts become their text, joined (as
    `_norm_message` compares them), so that the template writes it as one string tirl can frame."""
    m = dict(m)
    if m.get("role") == "tool" and isinstance(m.get("content"), list):
        m["content"] = _norm_message(m)["content"]
    return m


def _after(pieces: list[Piece], skip: int) -> list[Piece]:
    """The pieces without their first `skip` characters."""
    out: list[Piece] = []
    for text, trusted in pieces:
        if skip >= len(text):
            skip -= len(text)
            continue
        out.append((text[skip:], trusted))
        skip = 0
    return out


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
        idle_timeout_s: float | None = 600.0,
    ):
        if idle_timeout_s is not None and not idle_timeout_s > 0:
            raise ValueError(
                f"idle_timeout_s={idle_timeout_s}: give seconds > 0, or None to keep idle trajectories"
            )
        self.pool = pool
        self.tokenizer = tokenizer
        self.max_response_tokens = max_response_tokens
        self.on_drift = on_drift
        self.policy = template_policy(tokenizer)
        self.template_kwargs = dict(chat_template_kwargs or {})
        # Written after every assistant header before the model generates (tirl's agent.prefill, e.g.
        # "<reason>"): loss mask 0, and part of the assistant message's content the agent gets back.
        self.prefill = prefill
        # An agent that dies mid-trajectory never finishes it: after this long without a request its
        # trajectory is dropped and its engine lease released (None: kept until finish()).
        self.idle_timeout_s = idle_timeout_s
        self._recordings: dict[str, Recording] = {}
        self._issued: dict[str, float] = {}  # ids handed out, not yet opened: when
        self._issued_lock = threading.Lock()  # issue() is called from any thread
        self._gone: OrderedDict[str, str] = OrderedDict()  # recently dropped ids: why (for the 404)
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

    def render_pieces(
        self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool, untrusted_from: int = 0
    ) -> list[Piece]:
        """The template's rendering of `messages` as (text, trusted) pieces: the content of each tool
        message from index `untrusted_from` on is tool output, tokenized as plain text so that it cannot
        write the chat format's control tokens (tirl.agent.framing); the template writes the rest. A
        template that does not write tool content as it is (escaped, trimmed) is refused: its tool text
        could not be told apart from its frame."""
        nonce, marks, shown = secrets.token_hex(8), {}, []
        for i, m in enumerate(messages):
            content = m.get("content")
            if i >= untrusted_from and m.get("role") == "tool" and isinstance(content, str) and content:
                marks[f"tirl{nonce}m{i}x"] = content
                m = {**m, "content": f"tirl{nonce}m{i}x"}
            shown.append(m)
        text = self.render(shown, tools, generation_prompt)
        if not marks:
            return [(text, True)]
        pieces: list[Piece] = []
        at = 0
        for hit in re.finditer("|".join(marks), text):
            pieces += [(text[at : hit.start()], True), (marks[hit.group()], False)]
            at = hit.end()
        pieces.append((text[at:], True))
        if "".join(t for t, _ in pieces) != self.render(messages, tools, generation_prompt):
            raise ChatError(
                400,
                f"the chat template ({self.policy.family}) does not write the content of tool messages as "
                "it is, so tirl cannot keep tool output apart from the chat format's control tokens: use "
                "a template that writes tool content verbatim",
            )
        return pieces

    # --- trajectory ids ---------------------------------------------------------------------------
    def issue(self, name: str = "") -> str:
        """A new trajectory id no one can guess (`name` readable in front of it); over HTTP a request
        may only open an id issued here, so a web page cannot name a live trajectory."""
        if not NAME.fullmatch(name):
            raise ValueError(f"trajectory name {name!r}: up to 64 of A-Z a-z 0-9 . _ -")
        tid = unguessable_id(f"{name}-" if name else "t-")
        with self._issued_lock:
            self._issued[tid] = time.monotonic()
            while len(self._issued) > MAX_UNUSED_IDS:  # only tirl's own code issues: a runaway loop
                oldest = next(iter(self._issued))  # the earliest issued
                del self._issued[oldest]
                self._note_gone(oldest, f"never used, and {MAX_UNUSED_IDS} newer ids were issued since")
        return tid

    def known(self, trajectory_id: str) -> bool:
        """Issued here and not finished: an id a request over HTTP may use."""
        with self._issued_lock:
            return trajectory_id in self._issued or trajectory_id in self._recordings

    # --- one request ------------------------------------------------------------------------------
    async def complete(self, trajectory_id: str, request: dict, group: str | None = None) -> dict:
        """One /v1/chat/completions request of a trajectory: the OpenAI response (plus a `tirl` field).
        Atomic: a request that raises or is cancelled leaves the trajectory as it was (a trajectory's
        first request takes its engine lease with it)."""
        # On a worker thread: the walk in _valid_unicode lets the loop run between its steps.
        req, messages, tools = await asyncio.to_thread(_parsed, request)
        rec = self._recordings.get(trajectory_id)
        if rec is not None and rec.lock.locked():
            raise ChatError(409, f"trajectory {trajectory_id!r} has a request in flight: send one at a time")
        fresh = rec is None
        if rec is None:  # registered before any await: a second first request gets the 409 above
            rec = Recording(trajectory_id, group or trajectory_id, [], [], [], tools)
            self._recordings[trajectory_id] = rec
            with self._issued_lock:
                self._issued.pop(trajectory_id, None)
        async with rec.lock:
            state = rec.snapshot()
            try:
                added = 0
                if fresh:
                    await self._open(rec, messages, tools)
                else:
                    added = await self._add_messages(rec, messages)
                return await self._generate(rec, req, added)
            except BaseException:
                if fresh:  # the lease goes back; the id stays usable for a retry
                    await self._drop(trajectory_id, "")
                    with self._issued_lock:
                        self._issued[trajectory_id] = time.monotonic()
                else:
                    rec.restore(state)
                raise
            finally:
                rec.last_used = time.monotonic()

    async def _open(self, rec: Recording, messages: list[dict], tools: list[dict] | None) -> None:
        messages = [_text_content(m) for m in messages]
        pieces = await asyncio.to_thread(self.render_pieces, messages, tools, True)
        prompt_ids = await asyncio.to_thread(encode_framed, self.tokenizer, pieces)
        rec.prompt_ids, rec.ids, rec.messages = prompt_ids, list(prompt_ids), messages
        budget = len(prompt_ids) + self.max_response_tokens
        rec.engine_handle = await rec.stack.enter_async_context(self.pool.lease(rec.group, budget))
        rec.engine = str(getattr(rec.engine_handle, "name", type(rec.engine_handle).__name__))

    async def _add_messages(self, rec: Recording, messages: list[dict]) -> int:
        """`_extend` on a worker thread (rendering and tokenizing a long history takes a while), on a
        copy of the recording, applied here on the loop; the number of tokens added."""
        work = Recording(rec.trajectory_id, rec.group, [], [], [], rec.tools)
        work.restore(rec.snapshot())  # copies: the thread never touches the live recording
        added = await asyncio.to_thread(self._extend, work, messages)
        rec.restore(work.snapshot())
        return added

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
        new = [_text_content(m) for m in messages[known:]]
        before = self.render(rec.messages, rec.tools, generation_prompt=False)
        pieces = self.render_pieces(rec.messages + new, rec.tools, True, untrusted_from=known)
        after = "".join(text for text, _ in pieces)
        if not after.startswith(before):
            at = _first_difference(before, after)
            raise ChatError(
                409,
                f"the chat template ({self.policy.family}) renders the recorded history differently once "
                f"the new messages are added (at character {at}: {before[at : at + 40]!r} became "
                f"{after[at : at + 40]!r}), so the new prompt cannot extend the recorded tokens; "
                f"{self.policy.thinking}",
            )
        segment = encode_framed(self.tokenizer, [(rec.closing, True), *_after(pieces, len(before))])
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

    async def _generate(self, rec: Recording, req: ChatRequest, added: int) -> dict:
        left = self.max_response_tokens - len(rec.loss_mask)
        if left <= 0:
            raise ChatError(
                400, f"trajectory {rec.trajectory_id!r} used its {self.max_response_tokens} tokens"
            )
        wanted = req.max_completion_tokens or req.max_tokens or left
        params = SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            max_tokens=min(wanted, left),
            stop_token_ids=list(self.stop_ids),
            stop_strings=req.stop_strings(),
            seed=req.seed,
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
        ended_with_eot = ended and gen.token_ids[-1] == self.eot_id
        closing, drift = await asyncio.to_thread(
            self._turn_closing, list(rec.messages), rec.tools, message, generated, ended_with_eot, rec.turns
        )
        rec.messages.append(message)
        rec.closing = closing
        if drift:
            rec.drift.append(drift)
        return self._response(rec, message, gen.finish_reason, len(gen.token_ids), added, req)

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
                "id": unguessable_id("call_"),
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
            }
            for c in good
        ]
        return {"role": "assistant", "content": content.strip(), "tool_calls": tool_calls}

    def _turn_closing(
        self,
        messages: list[dict],
        tools: list[dict] | None,
        message: dict,
        generated: str,
        ended_with_eot: bool,
        turn_number: int,
    ) -> tuple[str, str]:
        """What the template writes after the generated tokens, and a drift note ("" if none): a
        template rendering of the turn that differs from the generation is drift (tokens kept)."""
        prompt_text = self.render(messages, tools, generation_prompt=True)
        rendered = self.render([*messages, message], tools, generation_prompt=False)
        eot = self.policy.end_of_turn
        turn = rendered[len(prompt_text) :] if rendered.startswith(prompt_text) else ""
        tail = turn[len(generated) :]
        if turn.startswith(generated) and (ended_with_eot or tail.startswith(eot)):
            return tail, ""  # e.g. "\n" after <|im_end|>, or "<|im_end|>\n" after a stop string
        # The template does not write the turn as generated: keep the model's tokens, close the turn
        # the way the template closes one, and say so.
        after_eot = turn.rsplit(eot, 1)[1] if eot in turn else ""
        at = _first_difference(generated, turn)
        return after_eot if ended_with_eot else eot + after_eot, (
            f"turn {turn_number}: the template renders the assistant turn as {turn[at : at + 40]!r} where "
            f"the model generated {generated[at : at + 40]!r} (character {at}); the generated tokens are kept"
        )

    def _response(
        self, rec: Recording, message: dict, finish: str, generated: int, added: int, req: ChatRequest
    ) -> dict:
        reason = (
            "tool_calls" if message.get("tool_calls") else finish if finish in ("stop", "length") else "stop"
        )
        return {
            "id": unguessable_id("chatcmpl-"),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": req.model or "tirl",
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
            why = self._gone.get(trajectory_id)
            raise ChatError(404, f"no trajectory {trajectory_id!r}" + (f" ({why})" if why else "")) from None

    async def finish(self, trajectory_id: str, problem_id: str = "", sample_index: int = 0) -> Trajectory:
        """End a trajectory: release its engine, hand back its tirl Trajectory (reward still 0)."""
        rec = self.recording(trajectory_id)
        if rec.lock.locked():
            raise ChatError(409, f"trajectory {trajectory_id!r} has a request in flight: finish it after")
        await self._drop(trajectory_id, "finished")
        return to_trajectory(
            rec, self.tokenizer, problem_id or trajectory_id, sample_index, self.max_response_tokens
        )

    async def _drop(self, trajectory_id: str, why: str) -> None:
        """Forget a trajectory and give its engine lease back."""
        rec = self._recordings.pop(trajectory_id, None)
        if why:
            self._note_gone(trajectory_id, why)
        if rec is not None:
            await rec.stack.aclose()

    def _note_gone(self, trajectory_id: str, why: str) -> None:
        """Remember why an id went, for its 404 (the last 4096)."""
        self._gone[trajectory_id] = why
        while len(self._gone) > 4096:
            self._gone.popitem(last=False)

    async def expire_idle(self, now: float | None = None) -> list[str]:
        """Drop the trajectories idle for longer than idle_timeout_s since their last request; their ids.
        An id issued but not yet used stays valid until its first request, however late the agent that
        holds it starts (before, it expired after idle_timeout_s and every request got 404)."""
        if self.idle_timeout_s is None:
            return []
        now = time.monotonic() if now is None else now
        cutoff = now - self.idle_timeout_s
        idle = [t for t, r in self._recordings.items() if not r.lock.locked() and r.last_used < cutoff]
        for tid in idle:
            await self._drop(tid, f"dropped after {self.idle_timeout_s:g} s without a request")
        return idle

    async def reap_forever(self) -> None:
        """expire_idle, a few times per idle_timeout_s, until cancelled."""
        if self.idle_timeout_s is None:
            return
        while True:
            await asyncio.sleep(min(self.idle_timeout_s / 4, 30.0))
            await self.expire_idle()

    async def close(self) -> None:
        for tid in list(self._recordings):
            await self._drop(tid, "the endpoint closed")


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
        model_turns=[
            tokenizer.decode(run, skip_special_tokens=False)
            for run in generated_runs(response_ids, rec.loss_mask)
        ],
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


def create_app(recorder: ChatRecorder, policy: GuardPolicy | None = None) -> FastAPI:
    """The FastAPI app: /t/{tid}/v1/chat/completions (or /v1/chat/completions with X-Trajectory-Id),
    /t/{tid}/finish (the trajectory as JSON), /t/{tid}/v1/models, /health; behind tirl's HTTP guard
    (`policy`: loopback names only, no token, 4 MiB bodies by default)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        reaper = asyncio.create_task(recorder.reap_forever())
        try:
            yield
        finally:
            reaper.cancel()
            with suppress(asyncio.CancelledError):
                await reaper

    app = FastAPI(
        title="tirl OpenAI-compatible endpoint",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )

    async def answer(tid: str | None, request: Request) -> JSONResponse:
        if not tid:
            return _error(400, "name the trajectory: base URL /t/<id>/v1 or header X-Trajectory-Id")
        if not recorder.known(tid):
            return _unknown(recorder, tid)
        try:
            body = json.loads(await request.body(), parse_constant=_reject_constant)
        except (ValueError, RecursionError) as e:
            return _error(400, f"the body is not JSON: {e}")
        work = asyncio.ensure_future(recorder.complete(tid, body, group=request.headers.get("x-tirl-group")))
        try:
            if not await _finished_before_disconnect(work, request):
                return _error(499, "the client disconnected: the request was cancelled and undone")
            return JSONResponse(work.result())
        except ChatError as e:
            return _error(e.status, str(e))
        except (ValueError, TemplateError) as e:  # a prompt longer than the engine's context, a template
            return _error(400, str(e))  # that cannot render these messages
        except Exception as e:  # the engine failed the turn: the request was undone, it may be sent again
            logging.getLogger(__name__).exception("trajectory %s: the request failed", tid)
            return _error(
                500, f"the engine failed this turn ({type(e).__name__}: {e}); the trajectory is as it was"
            )

    @app.post("/t/{tid}/v1/chat/completions")
    async def chat_by_path(tid: str, request: Request) -> JSONResponse:
        return await answer(tid, request)

    @app.post("/v1/chat/completions")
    async def chat_by_header(request: Request) -> JSONResponse:
        return await answer(request.headers.get("x-trajectory-id"), request)

    @app.post("/t/{tid}/finish")
    async def finish(tid: str, problem_id: str = "", sample_index: int = 0) -> JSONResponse:
        if not recorder.known(tid):
            return _unknown(recorder, tid)
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

    app.add_middleware(HTTPGuard, policy=policy or GuardPolicy(), render=_refusal_body)
    return app


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def _unknown(recorder: ChatRecorder, tid: str) -> JSONResponse:
    why = recorder._gone.get(tid)
    return _error(
        404,
        f"no trajectory {tid!r}"
        + (
            f" ({why})"
            if why
            else ": ids are issued by the endpoint (OpenAIEndpoint.base_url or trajectory_id)"
        ),
    )


async def _finished_before_disconnect(work: asyncio.Future, request: Request) -> bool:
    """Wait for `work`; if the client disconnects first, cancel it (the recorder undoes the request,
    or drops a trajectory whose first request it was, lease included) and say so."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            with suppress(asyncio.CancelledError):
                await work
    return not work.cancelled()


def _error(status: int, message: str) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def _refusal_body(refusal: Refusal) -> dict:
    """The guard's refusals in the OpenAI error shape, like the endpoint's own errors."""
    return {"error": {"message": refusal.message, "type": "invalid_request_error", "code": refusal.status}}


# An agent's connection idles while its tools run. Whichever side closes an idle connection first races
# the other's next use of it: a server closing it just as the client sends drops that request (the
# client sees a connection error, not a status). Servers conventionally wait longer than clients
# (httpx, under the openai client, drops idle connections after 5 s; uvicorn's default is also 5 s).
KEEP_ALIVE_S = 75


class OpenAIEndpoint:
    """The app served by uvicorn on its own thread and event loop (the recorder and its engine leases
    live on that loop); `base_url`, `trajectory_id` and `finish` are callable from any thread.

    The HTTP guard (docs/security.md): Host names beyond loopback and `host` must be listed in
    `allowed_hosts`; with a `token`, every request but /health needs `Authorization: Bearer <token>`
    (an OpenAI client sends its api_key so: `AsyncOpenAI(base_url=..., api_key=token)`); bodies are
    limited to `max_body_bytes`."""

    def __init__(
        self,
        recorder: ChatRecorder,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        token: str | None = None,
        allowed_hosts: tuple[str, ...] | list[str] = (),
        max_body_bytes: int = 4 << 20,
    ):
        import uvicorn

        if port == 0:
            port = free_port(host)
        self.recorder = recorder
        self.url = f"http://{host}:{port}"
        self._names: dict[str, str] = {}  # trajectory name -> the id issued for it
        self._names_lock = threading.Lock()
        policy = GuardPolicy.for_server(host, allowed_hosts, token, max_body_bytes)
        config = uvicorn.Config(
            create_app(recorder, policy),
            host=host,
            port=port,
            log_level="warning",
            timeout_keep_alive=KEEP_ALIVE_S,
            http=header_deadline_protocol(),  # uvicorn has no deadline for a request's headers
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

    def trajectory_id(self, name: str = "") -> str:
        """The unguessable id of the trajectory called `name` (issued on first use; a new one each call
        when no name is given): for the header X-Trajectory-Id, or `finish`."""
        if not name:
            return self.recorder.issue()
        with self._names_lock:
            if name not in self._names:
                self._names[name] = self.recorder.issue(name)
            return self._names[name]

    def base_url(self, trajectory: str = "") -> str:
        """What an OpenAI client takes as base_url for one trajectory: an id from `trajectory_id`, or
        a name (its id issued on first use). The URL holds the unguessable id, never the bare name."""
        tid = trajectory if self.recorder.known(trajectory) else self.trajectory_id(trajectory)
        return f"{self.url}/t/{tid}/v1"

    def finish(self, trajectory: str, problem_id: str = "", sample_index: int = 0) -> Trajectory:
        """End a trajectory (by name or id) and hand back its tirl Trajectory; a name is its default
        problem id."""
        with self._names_lock:
            tid = self._names.pop(trajectory, trajectory)
        name = trajectory if tid != trajectory else ""
        coro = self.recorder.finish(tid, problem_id or name, sample_index)
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self.recorder.close(), self._loop).result()
            self._server.should_exit = True
            self._thread.join(timeout=30)
