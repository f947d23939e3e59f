"""engine.backend=sglang: the server command, the install hint, and (when an SGLang Python is given in
$TIRL_SGLANG_PYTHON and SGLang runs here) a real SGLang server on the tiny model."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from tirl.engines.base import Engine, SamplingParams
from tirl.engines.config import EngineConfig
from tirl.engines.factory import build_engines
from tirl.engines.sglang import PYTHON_ENV, require_sglang, sglang_server_command


def test_server_command_follows_the_engine_config(monkeypatch):
    monkeypatch.delenv(PYTHON_ENV, raising=False)
    cfg = EngineConfig(
        backend="sglang", model="/m", device="cpu", max_model_len=2048, seed=3, dtype="float32"
    )
    argv = sglang_server_command(cfg, 1234)
    assert argv[:5] == [sys.executable, "-m", "sglang.launch_server", "--model-path", "/m"]
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
