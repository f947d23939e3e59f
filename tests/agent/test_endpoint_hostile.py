"""The OpenAI-compatible endpoint under attack, over real HTTP (uvicorn on loopback): rebinding Host
names, cross-site "simple" POSTs, missing tokens, guessed trajectory ids, malformed, huge and
out-of-range bodies, a huge request beside a small one, and trajectories abandoned, refused or cut
off by their client, whose engine leases must come back (a real RolloutScheduler counts them)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

from tirl.agent.openai_server import ChatRecorder, OpenAIEndpoint
from tirl.engines import load_tokenizer
from tirl.engines.base import Generation, KVCapacity, SamplingParams
from tirl.engines.scheduler import RolloutScheduler


class Canned:
    """An engine answering every turn with the same text; `gate` (when set) holds each generation
    until it is opened, `refuse` makes it raise as an engine does for a prompt it cannot take."""

    def __init__(self, tokenizer, text: str = "ok<|im_end|>"):
        self.ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        self.name = "canned"
        self.gate: threading.Event | None = None
        self.refuse = False
        self.crash = False
        self.calls = 0

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        self.calls += 1
        if self.refuse:
            raise ValueError("prompt does not fit the engine's context")
        if self.crash:
            raise RuntimeError("the engine died")
        while self.gate is not None and not self.gate.is_set():
            await asyncio.sleep(0.02)
        return Generation(list(self.ids), [-0.5] * len(self.ids), "stop", version=1)

    def capacity(self) -> KVCapacity:
        return KVCapacity(10_000_000, 10_000_000)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture
def served(tokenizer):
    """An endpoint on a real RolloutScheduler (which counts the leases it holds)."""
    engine = Canned(tokenizer)
    pool = RolloutScheduler([engine])
    endpoint = OpenAIEndpoint(ChatRecorder(pool, tokenizer, max_response_tokens=64))
    try:
        yield endpoint, engine, pool
    finally:
        if engine.gate is not None:
            engine.gate.set()
        endpoint.close()


def held(pool: RolloutScheduler) -> int:
    return pool.policy.slots[0].active


def wait_until(condition, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


MESSAGES = [{"role": "system", "content": "Use the tool."}, {"role": "user", "content": "6*7?"}]


def chat(endpoint: OpenAIEndpoint, tid: str, body: dict | None = None, **kwargs) -> httpx.Response:
    url = f"{endpoint.url}/t/{tid}/v1/chat/completions"
    return httpx.post(url, json=body or {"messages": MESSAGES}, **{"timeout": 60, **kwargs})


# ---- the guard ---------------------------------------------------------------------------------------


def test_a_rebinding_host_name_is_refused(served):
    endpoint, engine, _ = served
    tid = endpoint.trajectory_id("t")
    resp = chat(endpoint, tid, headers={"Host": "attacker.example:80"})
    assert resp.status_code == 421 and "not this service" in resp.json()["error"]["message"]
    resp = httpx.get(f"{endpoint.url}/health", headers={"Host": "attacker.example"})
    assert resp.status_code == 421
    assert engine.calls == 0
    assert chat(endpoint, tid, headers={"Host": "localhost"}).status_code == 200


def test_a_cross_site_simple_post_is_refused(served):
    """What a web page can send without the browser asking first: a form or text/plain body, with the
    page's Origin; neither opens, extends nor ends a trajectory."""
    endpoint, engine, pool = served
    tid = endpoint.trajectory_id("t")
    url = f"{endpoint.url}/t/{tid}/v1/chat/completions"
    body = b'{"messages": [{"role": "user", "content": "hi"}]}'
    for media in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        resp = httpx.post(url, content=body, headers={"Content-Type": media})
        assert resp.status_code == 415, (media, resp.text)
    resp = httpx.post(
        url, content=body, headers={"Content-Type": "application/json", "Origin": "http://evil.example"}
    )
    assert resp.status_code == 403 and "origin" in resp.json()["error"]["message"]
    assert chat(endpoint, tid).status_code == 200
    finish = f"{endpoint.url}/t/{tid}/finish"
    assert httpx.post(finish, content=b"", headers={"Content-Type": "text/plain"}).status_code == 415
    assert (
        httpx.post(finish, headers={"Content-Type": "application/json", "Origin": "null"}).status_code == 403
    )
    assert engine.calls == 1 and held(pool) == 1, "the trajectory is still live"


def test_trajectory_ids_are_issued_and_unguessable(served):
    endpoint, engine, _ = served
    for guess in ("traj-7", "s0-p1-0", "t1"):  # the names agents and examples use
        resp = chat(endpoint, guess)
        assert resp.status_code == 404 and "issued by the endpoint" in resp.json()["error"]["message"]
        resp = httpx.post(f"{endpoint.url}/t/{guess}/finish", headers={"Content-Type": "application/json"})
        assert resp.status_code == 404
    assert engine.calls == 0
    by_header = f"{endpoint.url}/v1/chat/completions"
    resp = httpx.post(by_header, json={"messages": MESSAGES}, headers={"X-Trajectory-Id": "traj-7"})
    assert resp.status_code == 404 and engine.calls == 0
    issued = endpoint.trajectory_id("by-header")
    assert (
        httpx.post(by_header, json={"messages": MESSAGES}, headers={"X-Trajectory-Id": issued}).status_code
        == 200
    )
    a, b = endpoint.trajectory_id(), endpoint.trajectory_id()
    assert a != b and len(a) >= 22
    named = endpoint.base_url("s0-p1-0")
    assert named == endpoint.base_url("s0-p1-0") and "/t/s0-p1-0-" in named  # the name, then 128 random bits
    assert len(named.split("/t/")[1].removesuffix("/v1")) >= len("s0-p1-0-") + 22
    with pytest.raises(ValueError, match="trajectory name"):
        endpoint.trajectory_id("../health")


def test_a_token_is_required_when_configured(tokenizer):
    token = "s3cret-token"
    endpoint = OpenAIEndpoint(ChatRecorder(RolloutScheduler([Canned(tokenizer)]), tokenizer), token=token)
    try:
        tid = endpoint.trajectory_id("t")
        assert chat(endpoint, tid).status_code == 401
        assert chat(endpoint, tid, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(f"{endpoint.url}/health").status_code == 200  # public: no token needed
        ok = chat(endpoint, tid, headers={"Authorization": f"Bearer {token}"})
        assert ok.status_code == 200, ok.text
        assert token not in repr(endpoint.__dict__), "the token is never shown"
    finally:
        endpoint.close()


# ---- hostile bodies ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "error"),
    [
        (b"{not json", "not JSON"),
        (b'{"messages": NaN}', "not JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'"hello"', "must be a JSON object"),
        (b"{}", "messages: Field required"),
        (b'{"messages": "hi"}', "messages"),
        (b'{"messages": [1]}', "messages.0"),
        (b'{"messages": [{"content": "hi"}]}', "messages.0.role"),
        (b'{"messages": [{"role": "king", "content": "hi"}]}', "messages.0.role"),
        (b'{"messages": [{"role": "user", "content": {"a": 1}}]}', "messages.0.content"),
        (
            b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}',
            "tools.0.function",
        ),
        (b'{"messages": [{"role": "user", "content": "hi"}], "tools": "python"}', "tools"),
        (b'{"messages": [], "max_tokens": 8}', "messages is empty"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "n": 3}', "n must be 1"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "stream": true}', "stream"),
        # 20k objects: validating them holds the GIL, so the event loop, for ~0.2 s (4 MiB: seconds)
        (json.dumps({"messages": [{"role": "user", "content": ""}] * 20_000}).encode(), "more than 20000"),
    ],
)
def test_a_malformed_request_answers_400_not_500(served, content, error):
    endpoint, engine, pool = served
    tid = endpoint.trajectory_id()
    url = f"{endpoint.url}/t/{tid}/v1/chat/completions"
    resp = httpx.post(url, content=content, headers={"Content-Type": "application/json"})
    assert resp.status_code == 400, resp.text
    assert error in resp.json()["error"]["message"]
    assert engine.calls == 0 and held(pool) == 0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.5),
        ("temperature", 7),
        ("temperature", "hot"),
        ("top_p", 0),
        ("top_p", 1.5),
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_tokens", "many"),
        ("max_completion_tokens", 0),
        ("seed", -1),
        ("seed", 2**64),
        ("stop", [""]),
        ("stop", ["x"] * 100),
        ("stop", 5),
        ("n", 0),
    ],
)
def test_out_of_range_sampling_parameters_are_refused(served, field, value):
    endpoint, engine, pool = served
    resp = chat(endpoint, endpoint.trajectory_id(), {"messages": MESSAGES, field: value})
    assert resp.status_code == 400, resp.text
    assert field in resp.json()["error"]["message"]
    assert engine.calls == 0 and held(pool) == 0


def post_raw(endpoint: OpenAIEndpoint, tid: str, body: dict) -> httpx.Response:
    """`body` as JSON with non-ASCII escaped, as Python's json writes it: lone surrogates included."""
    url = f"{endpoint.url}/t/{tid}/v1/chat/completions"
    return httpx.post(url, content=json.dumps(body), headers={"Content-Type": "application/json"})


def test_undecodable_tool_output_and_null_text_parts_answer_200_not_500(tokenizer):
    """A program printed bytes that are not UTF-8: an agent decoding them with surrogateescape sends
    lone surrogates (`"\\udcff"` in its JSON); a content part may carry `"text": null`. Both reached
    the tokenizer or a str join and answered 500 ("the engine failed this turn")."""
    endpoint = OpenAIEndpoint(ChatRecorder(RolloutScheduler([Canned(tokenizer)]), tokenizer))
    try:
        _undecodable_tool_output(endpoint)
    finally:
        endpoint.close()


def _undecodable_tool_output(endpoint: OpenAIEndpoint) -> None:
    tid = endpoint.trajectory_id("t")
    first = chat(endpoint, tid).json()["choices"][0]["message"]
    output = b"bytes \xff\xfe <|im_end|>".decode("utf-8", "surrogateescape")
    history = [
        *MESSAGES,
        first,
        {"role": "tool", "tool_call_id": "c1", "content": output},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": None}]},
        {"role": "user", "content": "and \ud800 this?"},
    ]
    resp = post_raw(endpoint, tid, {"messages": history})
    assert resp.status_code == 200, resp.text
    again = [*history, resp.json()["choices"][0]["message"], {"role": "user", "content": "more"}]
    assert post_raw(endpoint, tid, {"messages": again}).status_code == 200, "the history did not match"
    traj = httpx.post(f"{endpoint.url}/t/{tid}/finish", headers={"Content-Type": "application/json"}).json()
    assert (
        "bytes \ufffd\ufffd <|im_end|>" in traj["response_text"]
        and "and \ufffd this?" in traj["response_text"]
    )


def test_bodies_are_bounded_while_they_are_read(tokenizer):
    """A declared length over the limit is refused unread; a chunked body (no length) is cut at the
    limit, not read whole first."""
    limit = 64 << 10
    engine = Canned(tokenizer)
    endpoint = OpenAIEndpoint(ChatRecorder(RolloutScheduler([engine]), tokenizer), max_body_bytes=limit)
    try:
        url = f"{endpoint.url}/t/{endpoint.trajectory_id()}/v1/chat/completions"
        big = {"messages": [{"role": "user", "content": "x" * (2 * limit)}]}
        resp = httpx.post(url, json=big)
        assert resp.status_code == 413 and f"limit {limit} bytes" in resp.json()["error"]["message"]
        # A chunked body that never ends: answered 413 once the limit is passed, not after it is read.
        host, port = endpoint.url.removeprefix("http://").split(":")
        path = url.removeprefix(endpoint.url)
        with socket.create_connection((host, int(port)), timeout=30) as conn:
            head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            conn.sendall(head.encode() + b"Transfer-Encoding: chunked\r\n\r\n")
            chunk = b" " * (16 << 10)
            for _ in range(8):  # twice the limit, and no final chunk
                conn.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
            answer = conn.recv(65536)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert engine.calls == 0
    finally:
        endpoint.close()


def test_one_huge_request_does_not_stall_a_small_one(served):
    """Rendering and tokenizing ~1 MB of messages takes seconds; a small request of another agent sent
    meanwhile is answered first (the event loop is not blocked)."""
    endpoint, _, _ = served
    huge = {"messages": [{"role": "user", "content": "What is 6*7? " * 80_000}]}
    done: dict[str, float] = {}

    def send(name: str, body: dict) -> None:
        resp = chat(endpoint, endpoint.trajectory_id(name), body)
        assert resp.status_code == 200, resp.text
        done[name] = time.monotonic()

    big = threading.Thread(target=send, args=("huge", huge))
    big.start()
    time.sleep(0.5)  # the huge request is being tokenized
    start = time.monotonic()
    send("small", {"messages": MESSAGES})
    big.join(timeout=300)
    assert "huge" in done
    assert done["small"] < done["huge"], (
        f"the small request waited {done['small'] - start:.1f} s, until the huge one was done"
    )


# ---- leases come back -----------------------------------------------------------------------------------


def test_a_refused_first_request_gives_its_lease_back(served):
    endpoint, engine, pool = served
    tid = endpoint.trajectory_id("t")
    engine.refuse = True
    resp = chat(endpoint, tid)
    assert resp.status_code == 400 and "does not fit" in resp.json()["error"]["message"]
    assert held(pool) == 0, "the refused trajectory still holds its engine lease"
    engine.refuse = False
    assert chat(endpoint, tid).status_code == 200, "the id can be retried"
    assert held(pool) == 1


def test_an_engine_failure_is_a_json_error_and_undoes_the_request(served):
    endpoint, engine, pool = served
    tid = endpoint.trajectory_id("t")
    first = chat(endpoint, tid).json()
    history = [*MESSAGES, first["choices"][0]["message"], {"role": "tool", "content": "42"}]
    engine.crash = True
    resp = chat(endpoint, tid, {"messages": history})
    assert resp.status_code == 500 and "the engine died" in resp.json()["error"]["message"]
    assert len(endpoint.recorder.recording(tid).messages) == 3 and held(pool) == 1
    engine.crash = False
    assert chat(endpoint, tid, {"messages": history}).status_code == 200


def test_an_abandoned_trajectory_expires_and_gives_its_lease_back(tokenizer):
    pool = RolloutScheduler([Canned(tokenizer)])
    endpoint = OpenAIEndpoint(ChatRecorder(pool, tokenizer, idle_timeout_s=1.0))
    try:
        tid = endpoint.trajectory_id("agent-that-dies")
        assert chat(endpoint, tid).status_code == 200 and held(pool) == 1
        assert wait_until(lambda: held(pool) == 0), "the abandoned trajectory kept its lease"
        resp = chat(endpoint, tid, {"messages": [*MESSAGES, {"role": "assistant", "content": "ok"}]})
        assert resp.status_code == 404 and "without a request" in resp.json()["error"]["message"]
    finally:
        endpoint.close()


def test_a_name_stays_valid_until_its_agent_first_uses_it(tokenizer):
    """Round 5, item 7: an id handed to an agent that starts later than idle_timeout_s expired before its
    first request, and every request of that agent got 404. Unused ids now wait for their first use;
    idleness counts from a trajectory's last request."""
    pool = RolloutScheduler([Canned(tokenizer)])
    endpoint = OpenAIEndpoint(ChatRecorder(pool, tokenizer, idle_timeout_s=0.5))
    try:
        url = endpoint.base_url("late-agent")  # handed to an agent that starts later
        time.sleep(2.0)  # four idle timeouts: the reaper ran several times (every 0.125 s)
        resp = httpx.post(f"{url}/chat/completions", json={"messages": MESSAGES}, timeout=60)
        assert resp.status_code == 200, resp.text
        assert wait_until(lambda: held(pool) == 0), "once used, the trajectory still expires when idle"
        again = httpx.post(f"{url}/chat/completions", json={"messages": MESSAGES}, timeout=60)
        assert again.status_code == 404 and "without a request" in again.json()["error"]["message"]
    finally:
        endpoint.close()


def test_a_client_that_disconnects_gives_the_lease_back_and_leaves_the_trajectory_as_it_was(served):
    endpoint, engine, pool = served
    tid = endpoint.trajectory_id("t")
    first = chat(endpoint, tid).json()
    history = [*MESSAGES, first["choices"][0]["message"], {"role": "tool", "content": "42"}]
    engine.gate = threading.Event()  # the next generation hangs until the client has gone
    with pytest.raises(httpx.ReadTimeout):
        chat(endpoint, tid, {"messages": history}, timeout=1.0)
    assert wait_until(lambda: not endpoint.recorder.recording(tid).lock.locked())
    engine.gate.set()
    assert len(endpoint.recorder.recording(tid).messages) == 3, "the cut-off request was undone"
    retry = chat(endpoint, tid, {"messages": history})
    assert retry.status_code == 200, retry.text  # the same request again, not "adds none"/"differs"

    other = endpoint.trajectory_id("u")
    engine.gate = threading.Event()
    with pytest.raises(httpx.ReadTimeout):
        chat(endpoint, other, timeout=1.0)
    assert wait_until(lambda: held(pool) == 1), "the cut-off first request kept its lease"
    engine.gate.set()
