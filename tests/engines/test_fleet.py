"""One failover fleet (tirl.engines.fleet) for the Ray engine actors and the inference servers: the
same counters, rerouting and revival; and the servers' weights directory, which must not outlive them
(a whole model copy per run: ~30 GB at 14B)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from tirl.engines.base import Generation, KVCapacity, SamplingParams
from tirl.engines.config import EngineConfig, RemoteServers
from tirl.engines.fleet import EngineFleet, NoLiveEngineError
from tirl.engines.remote import NoLiveServerError, ServerFleet, build_server_engines


class Member:
    """An engine of a fleet that answers with its name."""

    def __init__(self, name: str, free: int):
        self.name, self.free, self.up, self.revived = name, free, True, False
        self.url = f"http://{name}"  # what a server fleet names

    def capacity(self) -> KVCapacity:
        return KVCapacity(100, self.free if self.up else 0)

    async def generate(self, prompt_ids, params) -> Generation:
        return Generation([len(self.name)], [0.0], "stop")


@pytest.mark.parametrize("kind", [EngineFleet, ServerFleet])
async def test_a_lost_engine_is_counted_once_its_turns_rerouted_and_it_rejoins_by_a_sync(kind):
    fleet = kind()
    small, big, lost = (Member(n, f) for n, f in (("a", 10), ("bbb", 50), ("cc", 90)))
    fleet.engines += [small, big, lost]
    assert fleet.lost(lost, "connection refused") and not fleet.lost(lost, "again")
    turn = await fleet.reroute(lost, [1], SamplingParams())
    assert turn.token_ids == [3]  # the live engine with the most free KV
    fleet.synced([small, lost])
    assert lost.up and fleet.counters == {"engine_failures": 1, "engine_restarts": 1, "rerouted_turns": 1}
    for e in fleet.engines:
        fleet.lost(e, "gone")
    with pytest.raises(NoLiveEngineError):
        await fleet.reroute(small, [1], SamplingParams())


class FakeVLLMServer(BaseHTTPRequestHandler):
    """The control endpoints of `vllm serve` a weight sync uses; reloads are recorded."""

    reloads: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        body = {"/v1/models": {"data": [{"id": "tiny", "max_model_len": 256}]}}.get(self.path, {})
        self._answer(json.dumps(body) if self.path != "/metrics" else "")

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        if self.path == "/collective_rpc":
            self.reloads.append(body["kwargs"]["weights_path"])
        self._answer("{}")

    def _answer(self, text: str) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(text)))
        self.end_headers()
        self.wfile.write(text.encode())

    def log_message(self, *args) -> None:
        pass


async def test_the_last_weights_directory_goes_with_the_last_server(tmp_path, tiny_model_dir):
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), FakeVLLMServer) for _ in range(2)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    urls = [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
    remote = RemoteServers(urls=urls, weights_dir=str(tmp_path / "sync"), poll_s=0.2)
    engines = build_server_engines(EngineConfig(backend="remote", model=str(tiny_model_dir), remote=remote))
    try:
        for _ in range(2):
            weights = [("model.norm.weight", torch.ones(4))]
            for e in engines:
                e.load_weights(weights)
        dirs = sorted(Path(p).name for p in set(FakeVLLMServer.reloads))
        assert len(FakeVLLMServer.reloads) == 4 and len(dirs) == 2  # one directory per sync, both servers
        assert [p.name for p in (tmp_path / "sync").iterdir()] == [dirs[-1]]  # the previous one removed
        await engines[0].close()
        assert (tmp_path / "sync" / dirs[-1]).is_dir()  # the other server may still reload it
    finally:
        for e in engines:
            await e.close()
        for s in servers:
            s.shutdown()
    assert list((tmp_path / "sync").iterdir()) == []
    assert issubclass(NoLiveServerError, NoLiveEngineError)
