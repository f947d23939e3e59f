"""engine.backend=remote against a hostile inference server: a real HTTP server in this process that
answers generations with ids outside the vocabulary, more tokens than asked for, NaN, infinite or
positive log-probs, or bodies that are not generations. Each is refused at the engine's boundary with
one clear error naming the server, never handed to training."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tirl.engines.base import SamplingParams
from tirl.engines.config import EngineConfig, RemoteServers
from tirl.engines.remote import InvalidReplyError, ServerEngine, ServerError

VOCAB = 100


class HostileServer:
    """A vLLM-shaped server (/health, /v1/models, /metrics, /v1/completions) whose next generation
    answer is whatever the test sets in `reply` (raw text, sent as JSON)."""

    def __init__(self) -> None:
        self.reply = ""
        self.drip_s = 0.0  # > 0: the reply's body is sent one byte per drip_s seconds
        self.requests: list[dict] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self._send('{"data": [{"id": "tiny", "max_model_len": 1024}]}')
                elif self.path == "/metrics":
                    self._send("", "text/plain")
                else:
                    self._send("{}")

            def do_POST(self) -> None:
                server.requests.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
                self._send(server.reply)

            def _send(self, text: str, media: str = "application/json") -> None:
                body = text.encode()
                self.send_response(200)
                self.send_header("Content-Type", media)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not (server.drip_s and self.command == "POST"):
                    self.wfile.write(body)
                    return
                for i in range(len(body)):
                    self.wfile.write(body[i : i + 1])
                    self.wfile.flush()
                    time.sleep(server.drip_s)

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def hostile(tmp_path: Path) -> Iterator[tuple[HostileServer, ServerEngine]]:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))  # the local model copy
    server = HostileServer()
    cfg = EngineConfig(backend="remote", model=str(tmp_path), remote=RemoteServers(urls=[server.url]))
    engine = ServerEngine(cfg, server.url, "remote0")
    try:
        yield server, engine
    finally:
        engine.close_now()
        server.close()


def completion(ids: list, logprobs: list, reason: str = "stop") -> str:
    """vLLM's answer shape (token ids, log-probs spelled as ids), as raw JSON text (NaN allowed)."""
    spelled = [f"token_id:{t}" for t in ids]
    choice = {
        "token_ids": ids,
        "logprobs": {"tokens": spelled, "token_logprobs": logprobs},
        "finish_reason": reason,
    }
    return json.dumps({"choices": [choice]})


async def generate(engine: ServerEngine, max_tokens: int = 4):
    return await engine.generate([1, 2, 3], SamplingParams(max_tokens=max_tokens))


async def test_a_good_reply_passes(hostile):
    server, engine = hostile
    server.reply = completion([5, VOCAB - 1, 0], [-0.5, 0.0, 5e-5])  # a hair above 0: rounding
    gen = await generate(engine)
    assert (gen.token_ids, gen.logprobs, gen.finish_reason) == ([5, VOCAB - 1, 0], [-0.5, 0.0, 5e-5], "stop")
    assert server.requests[-1]["prompt"] == [1, 2, 3]


@pytest.mark.parametrize(
    ("ids", "logprobs", "error"),
    [
        (
            [5, VOCAB],
            [-0.5, -0.5],
            rf"token 1 has id {VOCAB}, outside the model's vocabulary \(0\.\.{VOCAB - 1}\)",
        ),
        ([-1], [-0.5], "token 0 has id -1, outside"),
        ([1, 2, 3, 4, 5], [-0.1] * 5, "answered 5 tokens where at most 4 were asked for"),
        ([5, 6], [-0.5, float("nan")], "token 1 has log-prob nan"),
        ([5], [float("-inf")], "token 0 has log-prob -inf"),
        ([5, 6], [-0.5, 0.25], "token 1 has log-prob 0.25: a log-probability is finite and <= 0"),
        ([5, 6], [-0.5], "2 tokens but 1 log-probs"),
    ],
    ids=[
        "id-beyond-vocab",
        "negative-id",
        "more-tokens-than-asked",
        "nan",
        "minus-inf",
        "positive",
        "too-few",
    ],
)
async def test_a_hostile_reply_is_refused_at_the_boundary(hostile, ids, logprobs, error):
    server, engine = hostile
    server.reply = completion(ids, logprobs)
    with pytest.raises(InvalidReplyError, match=error) as err:
        await generate(engine)
    assert server.url in str(err.value), "the error names the server"
    assert engine.up, "a refused reply is this turn's error: the server is not rerouted around silently"


@pytest.mark.parametrize(
    ("reply", "error"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "not a JSON object"),
        ('{"choices": []}', "IndexError"),
        (completion([5.5], [-0.5]), "token id 5.5 is not an integer"),
        (completion([True], [-0.5]), "token id True is not an integer"),
        (completion([5], ["-0.5"]), "log-prob '-0.5' is not a number"),
        (completion([5], [None]), "log-prob None is not a number"),
    ],
    ids=["text", "list", "no-choice", "float-id", "bool-id", "string-logprob", "null-logprob"],
)
async def test_a_malformed_reply_is_one_clear_error(hostile, reply, error):
    server, engine = hostile
    server.reply = reply
    with pytest.raises(InvalidReplyError, match=error):
        await generate(engine)


async def test_a_reply_dripped_a_byte_at_a_time_is_cut_at_the_request_deadline(hostile):
    """Round 5, item 6: httpx's timeout applies per read, so a server sending its reply one byte every
    0.1 s (here: ~15 s for the whole answer) was waited for until the reply ended; request_timeout_s
    is now one deadline for the whole request."""
    server, engine = hostile
    engine.cfg.remote.request_timeout_s = 1.5
    server.reply = completion([5, 6], [-0.5, -0.25])
    server.drip_s = 0.1
    start = time.monotonic()
    with pytest.raises(ServerError):
        await generate(engine)
    assert time.monotonic() - start < 10, "the dripping reply was waited for past the deadline"
