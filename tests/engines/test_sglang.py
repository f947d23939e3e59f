"""engine.backend=sglang: the server command, the install hint, the server's API key (through a
stand-in `sglang.launch_server` that keeps SGLang's key rule), and (when an SGLang Python is given in
$TIRL_SGLANG_PYTHON and SGLang runs here) a real SGLang server on the tiny model."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
import torch

from tirl.engines.base import Engine, SamplingParams
from tirl.engines.config import EngineConfig
from tirl.engines.factory import build_engines
from tirl.engines.sglang import PYTHON_ENV, SGLangEngine, require_sglang, sglang_server_command


def test_server_command_follows_the_engine_config(monkeypatch):
    monkeypatch.delenv(PYTHON_ENV, raising=False)
    cfg = EngineConfig(
        backend="sglang", model="/m", device="cpu", max_model_len=2048, seed=3, dtype="float32"
    )
    argv = sglang_server_command(cfg, 1234)
    assert argv[:2] == [sys.executable, "-c"] and "sglang.launch_server" in argv[2]
    assert argv[3:5] == ["--model-path", "/m"]
    text = " ".join(argv)
    for flag in (
        "--port 1234",
        "--context-length 2048",
        "--random-seed 3",
        "--dtype float32",
        "--device cpu",
    ):
        assert flag in text
    assert "--disable-radix-cache" not in argv and "--enable-memory-saver" not in argv
    off = cfg.model_copy(update={"enable_prefix_caching": False, "enable_sleep_mode": True})
    assert {"--disable-radix-cache", "--enable-memory-saver"} <= set(sglang_server_command(off, 1))
    monkeypatch.setenv(PYTHON_ENV, "/envs/sglang/bin/python")
    assert sglang_server_command(cfg, 1)[0] == "/envs/sglang/bin/python"


def test_without_sglang_the_factory_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setenv(PYTHON_ENV, sys.executable)
    try:
        require_sglang()
        pytest.skip("SGLang is installed in this environment")
    except ImportError:
        pass
    with pytest.raises(ImportError, match=r"tirl\[sglang\]"):
        build_engines(EngineConfig(backend="sglang", model=str(tmp_path)))


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get(PYTHON_ENV), reason=f"set {PYTHON_ENV} to a Python with SGLang")
def test_a_real_sglang_server_generates_token_ids_with_logprobs(tiny_model_dir):
    [engine] = build_engines(EngineConfig(backend="sglang", model=str(tiny_model_dir), max_model_len=512))
    try:
        assert isinstance(engine, Engine)
        assert engine.capacity().total_tokens
        prompt = [1, 5, 6, 7, 8]
        params = SamplingParams(temperature=1.0, max_tokens=8, seed=4)
        first = asyncio.run(engine.generate(prompt, params))
        again = asyncio.run(engine.generate(prompt, params))
        assert first.token_ids == again.token_ids and len(first.logprobs) == len(first.token_ids)
    finally:
        asyncio.run(engine.close())


# SGLang's launch_server, as far as tirl uses it: its flags, its API-key rule (every path but /health and
# /metrics needs `Authorization: Bearer KEY` when started with --api-key; sglang.srt.utils
# add_api_key_middleware) and the native endpoints tirl calls. It records how it was started.
STAND_IN = """
import argparse, json, os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

p = argparse.ArgumentParser()
p.add_argument("--model-path"); p.add_argument("--host"); p.add_argument("--port", type=int)
p.add_argument("--api-key")
args, _ = p.parse_known_args()
LOG = os.path.join(os.environ["STAND_IN_LOGS"], str(args.port))
STARTS = os.path.join(os.environ["STAND_IN_LOGS"], "starts")
with open(STARTS, "a") as f:
    f.write(str(args.port) + "\\n")
FAIL = os.environ.get("STAND_IN_FAIL")  # first: the first start exits as if its port were taken; always
if FAIL == "always" or (FAIL == "first" and open(STARTS).read().count("\\n") == 1):
    sys.exit(3)
with open(LOG, "w") as f:
    json.dump({"name": __name__, "argv": sys.argv, "key": args.api_key,
               "key_in_env": "TIRL_SGLANG_API_KEY" in os.environ}, f)
ANSWERS = {
    "/model_info": {"model_path": args.model_path},
    "/server_info": {"context_length": 512},
    "/v1/loads": {"loads": [{"max_total_num_tokens": 4096, "num_used_tokens": 0}]},
    "/generate": {"meta_info": {"output_token_logprobs": [[-0.5, 7, None], [-0.25, 8, None]],
                                "finish_reason": {"type": "length"}}},
    "/update_weights_from_disk": {"success": True}, "/flush_cache": {},
}

class Handler(BaseHTTPRequestHandler):
    def answer(self):
        path = self.path.split("?")[0]
        size = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(size)
        public = path.startswith(("/health", "/metrics"))
        if args.api_key and not public and self.headers.get("Authorization") != "Bearer " + args.api_key:
            code, body = 401, {"error": "Unauthorized"}
        else:
            code, body = (200, ANSWERS.get(path, {})) if public or path in ANSWERS else (404, {})
            with open(LOG + ".calls", "a") as f:
                f.write(path + "\\n")
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    do_GET = do_POST = answer
    def log_message(self, *a): pass

ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
"""


@pytest.fixture
def stand_in(tmp_path, monkeypatch) -> Path:
    """A Python whose `sglang.launch_server` is STAND_IN; the folder of its records (one per port)."""
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "__init__.py").write_text("")
    (tmp_path / "sglang" / "launch_server.py").write_text(textwrap.dedent(STAND_IN))
    monkeypatch.setenv(PYTHON_ENV, sys.executable)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    )
    logs = tmp_path / "logs"
    logs.mkdir()
    monkeypatch.setenv("STAND_IN_LOGS", str(logs))
    return logs


def test_the_server_takes_a_random_key_that_only_tirl_sends(stand_in, tiny_model_dir):
    cfg = EngineConfig(backend="sglang", model=str(tiny_model_dir), device="cpu", max_model_len=512)
    engines = [SGLangEngine(cfg, f"sglang{i}") for i in range(2)]
    try:
        started = [json.loads((stand_in / str(e.port)).read_text()) for e in engines]
        key = started[1]["key"]
        assert key and len(key) >= 32 and started[0]["key"] != key  # random, one per server
        assert started[1]["name"] == "__main__"  # run as `python -m sglang.launch_server` runs it
        assert not started[1]["key_in_env"]  # SGLang's own worker processes do not inherit it
        cmdline = Path(f"/proc/{engines[1]._proc.pid}/cmdline").read_bytes().decode()
        assert "sglang.launch_server" in cmdline and key not in cmdline  # `ps` shows no key

        # tirl's own client sends it: a generation and a weight reload go through.
        gen = asyncio.run(engines[1].generate([1, 5, 6], SamplingParams(max_tokens=2)))
        assert gen.token_ids == [7, 8] and gen.logprobs == [-0.5, -0.25]
        engines[1].load_weights([("w", torch.zeros(2))])
        calls = (stand_in / f"{engines[1].port}.calls").read_text().split()
        assert "/generate" in calls and "/update_weights_from_disk" in calls

        # Anyone else (another local program, a web page rebinding a name to 127.0.0.1) is refused.
        url = engines[1]._server.url
        for host in ("127.0.0.1", "attacker.example"):
            headers = {"Host": host}
            reload = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": "/x"}, headers=headers)
            assert reload.status_code == 401
            assert httpx.post(f"{url}/generate", json={"input_ids": [1]}, headers=headers).status_code == 401
        wrong = {"Authorization": "Bearer " + key[:-1]}
        assert httpx.get(f"{url}/server_info", headers=wrong).status_code == 401
    finally:
        for engine in engines:
            asyncio.run(engine.close())


def test_a_key_that_starts_with_a_dash_reaches_the_server_whole(stand_in, tiny_model_dir, monkeypatch):
    """A url-safe key starts with '-' one time in 64 (a CI run met one): argparse must take it as the
    key's value, not as a flag, or that server never starts."""
    import secrets

    import tirl.engines.sglang as sglang

    key = "-" + secrets.token_urlsafe(32)
    monkeypatch.setattr(sglang.secrets, "token_urlsafe", lambda nbytes=None: key)
    cfg = EngineConfig(backend="sglang", model=str(tiny_model_dir), device="cpu", max_model_len=512)
    engine = SGLangEngine(cfg)
    try:
        assert json.loads((stand_in / str(engine.port)).read_text())["key"] == key
        assert len((stand_in / "starts").read_text().split()) == 1
        gen = asyncio.run(engine.generate([1, 5, 6], SamplingParams(max_tokens=2)))
        assert gen.token_ids == [7, 8]
    finally:
        asyncio.run(engine.close())


def test_a_server_that_exits_while_starting_is_started_again_on_a_new_port(
    stand_in, tiny_model_dir, monkeypatch
):
    """The port tirl picked can be taken before the server binds it (another process's connection or
    server): the server exits at once. tirl starts it again on a new port, instead of waiting
    remote.start_timeout_s (30 min) for a health check nothing will answer."""
    monkeypatch.setenv("STAND_IN_FAIL", "first")
    cfg = EngineConfig(backend="sglang", model=str(tiny_model_dir), device="cpu", max_model_len=512)
    engine = SGLangEngine(cfg)
    try:
        first, second = (stand_in / "starts").read_text().split()
        assert second == str(engine.port) != first
        gen = asyncio.run(engine.generate([1, 5, 6], SamplingParams(max_tokens=2)))
        assert gen.token_ids == [7, 8]
    finally:
        asyncio.run(engine.close())


def test_a_server_that_always_exits_while_starting_is_one_error_not_a_wait(
    stand_in, tiny_model_dir, monkeypatch
):
    """A server that exits on every start (bad flags, a broken install): an error naming its exit code
    after START_TRIES starts, and nothing left behind (its weight-transfer directory is removed)."""
    from tirl.engines.remote import ServerExited
    from tirl.engines.sglang import START_TRIES

    monkeypatch.setenv("STAND_IN_FAIL", "always")
    weights = stand_in.parent / "weights"
    weights.mkdir()
    monkeypatch.setenv("TIRL_WEIGHTS_DIR", str(weights))
    cfg = EngineConfig(backend="sglang", model=str(tiny_model_dir), device="cpu", max_model_len=512)
    with pytest.raises(ServerExited, match="exited with code 3 while starting"):
        SGLangEngine(cfg)
    assert len((stand_in / "starts").read_text().split()) == START_TRIES
    assert not any(weights.iterdir())


def test_the_server_dies_with_tirl_even_by_sigkill(stand_in, tiny_model_dir):
    """The server sets its own parent-death signal after exec (no Python between fork and exec): a
    SIGKILLed tirl leaves no server behind."""
    import signal
    import subprocess
    import time

    code = textwrap.dedent(f"""
        import threading
        from tirl.engines.config import EngineConfig
        from tirl.engines.sglang import SGLangEngine
        cfg = EngineConfig(backend="sglang", model={str(tiny_model_dir)!r}, device="cpu", max_model_len=512)
        print(SGLangEngine(cfg)._proc.pid, flush=True)
        threading.Event().wait()
    """)
    tirl = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    server = int(tirl.stdout.readline())
    assert Path(f"/proc/{server}").exists()
    tirl.send_signal(signal.SIGKILL)
    tirl.wait()
    deadline = time.monotonic() + 60  # a hang guard: the kernel kills it at once
    while Path(f"/proc/{server}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{server}").exists()
