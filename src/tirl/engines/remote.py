"""engine.backend=remote: inference servers that run elsewhere (`vllm serve`, an SGLang server).

Token ids in, token ids and log-probs out, never text: vLLM's /v1/completions takes the prompt as a
list of token ids and answers with the sampled ids (`return_token_ids`) and each one's log-prob
(`logprobs=0`, tokens spelled `token_id:N` by `return_tokens_as_token_ids`, checked against the ids);
SGLang's /generate takes `input_ids` and returns `output_ids` with `output_token_logprobs`.

Each URL is one Engine. A poller per server reads its health and KV usage (vLLM's Prometheus
/metrics, SGLang's /v1/loads), so `capacity()` never blocks the event loop and the KV-aware
RolloutScheduler spreads trajectories over the servers as over in-process engines. A turn whose
server fails (connection refused, 5xx) goes to the live server with the most free KV (the failover
of tirl.engines.fleet, which the Ray runtime's engine actors share); a server that comes back rejoins
at the next weight sync (its weights are stale until then) or at once if no sync happened yet.

Weights move through storage both sides see (`engine.remote.weights_dir`): `load_weights` writes one
safetensors file there ONCE per sync (not once per server) and every server reloads that directory in
place (vLLM: `reload_weights` through /collective_rpc, which needs VLLM_SERVER_DEV_MODE=1 on the
server; SGLang: /update_weights_from_disk), then drops its prefix cache (KV computed with the old
weights). `load_weights_from_path` reloads a checkpoint directory the trainer already wrote.

A server's reply is checked at this boundary (`check_generation`): token ids are integers inside the
model's vocabulary, no more tokens than were asked for, one log-prob per token, each finite and <= 0.
A reply that breaks one of these raises InvalidReplyError, naming the server and what was wrong,
instead of failing deep inside training (a NaN log-prob would reach the importance weights).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import shutil
import threading
import time
import weakref
from collections.abc import Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import httpx
import torch

from tirl.engines.base import Generation, KVCapacity, SamplingParams
from tirl.engines.config import EngineConfig, RemoteServers
from tirl.engines.fleet import EngineFleet, NoLiveEngineError

log = logging.getLogger(__name__)
T = TypeVar("T")
CONTROL_TIMEOUT_S = 30.0  # health, metrics, cache resets
HEALTH_TIMEOUT_S = 10.0  # a server busy decoding on loaded CPUs can take seconds to answer /health
FAILED_POLLS_DOWN = 3  # consecutive failed polls before a server counts as down (one slow answer is not)
RELOAD_TIMEOUT_S = 1800.0  # a weight reload reads the whole model from storage


class ServerError(RuntimeError):
    """A server answered with an error, or could not be reached; `status`: the HTTP status, if any."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class ServerExited(ServerError):
    """A server this process started exited before it answered its health check."""


class NoLiveServerError(ServerError, NoLiveEngineError):
    """Every server is down: no turn can run."""


class InvalidReplyError(ServerError):
    """A server answered a generation with something that is not one (ids outside the vocabulary, more
    tokens than asked for, log-probs that are not log-probabilities, a malformed body). Not retried on
    another server: a server answering garbage is misconfigured, and the error says how."""


@dataclass
class ServerLoad:
    """What a poll of one server saw."""

    healthy: bool
    total_tokens: int | None = None
    used_share: float | None = None  # KV cache in use, 0..1
    preemptions: int = 0


class ServerAPI(Protocol):
    """How one kind of server spells generation, load, weight reload, cache reset and sleep."""

    def generate_body(self, prompt_ids: list[int], params: SamplingParams, max_tokens: int) -> dict: ...

    generate_path: str

    def parse_generation(self, body: dict) -> Generation: ...

    async def describe(self, http: httpx.AsyncClient) -> tuple[str, int | None]: ...

    async def load(self, http: httpx.AsyncClient) -> ServerLoad: ...

    def reload(self, http: httpx.Client, path: str) -> None: ...

    def reset_prefix_cache(self, http: httpx.Client) -> None: ...

    def sleep(self, http: httpx.Client) -> None: ...

    def wake_up(self, http: httpx.Client) -> None: ...


def _check(resp: httpx.Response, what: str) -> httpx.Response:
    if resp.status_code >= 400:
        raise ServerError(
            f"{what}: {resp.request.url} answered HTTP {resp.status_code}: {resp.text[:500]}",
            resp.status_code,
        )
    return resp


# ---- vLLM's OpenAI-compatible server ------------------------------------------------------------------


class VLLMServerAPI:
    """`vllm serve` (start it with --logprobs-mode processed_logprobs: log-probs under the sampling
    distribution, as the in-process engine reports; --generation-config vllm: no sampling defaults
    from the model's generation_config; VLLM_SERVER_DEV_MODE=1 for weight reloads and cache resets)."""

    generate_path = "/v1/completions"

    def __init__(self, served_model: str = ""):
        self.model = served_model

    def generate_body(self, prompt_ids: list[int], params: SamplingParams, max_tokens: int) -> dict:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": list(prompt_ids),  # token ids: the server never tokenizes text of ours
            "max_tokens": max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": -1,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "stop_token_ids": list(params.stop_token_ids),
            "include_stop_str_in_output": True,  # "</tool_call>" stays in the turn's tokens
            "skip_special_tokens": False,
            "logprobs": 0,  # the sampled token's log-prob only
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
        }
        if params.stop_strings:
            body["stop"] = list(params.stop_strings)
        if params.seed is not None:
            body["seed"] = params.seed
        return body

    def parse_generation(self, body: dict) -> Generation:
        with _malformed("a vLLM /v1/completions answer"):
            choice = body["choices"][0]
            token_ids = _ids(choice.get("token_ids") or [])
            lp = choice.get("logprobs") or {}
            spelled = [_token_id(t) for t in lp.get("tokens") or []]
            if spelled != token_ids:
                raise ServerError(
                    "the server's log-prob tokens do not match its token ids: serve a vLLM that supports "
                    "return_token_ids and return_tokens_as_token_ids"
                )
            logprobs = _floats(lp.get("token_logprobs") or [])
            reason = choice.get("finish_reason")
        return Generation(token_ids, logprobs, reason if reason in ("stop", "length") else "abort")

    async def describe(self, http: httpx.AsyncClient) -> tuple[str, int | None]:
        resp = _check(await http.get("/v1/models", timeout=CONTROL_TIMEOUT_S), "list models")
        models = resp.json().get("data") or []
        if not models:
            raise ServerError(f"{http.base_url} serves no model")
        chosen = next((m for m in models if m.get("id") == self.model), models[0])
        if not self.model:
            self.model = chosen["id"]
        return self.model, chosen.get("max_model_len")

    async def load(self, http: httpx.AsyncClient) -> ServerLoad:
        resp = await http.get("/metrics", timeout=CONTROL_TIMEOUT_S)
        if resp.status_code != 200:
            return ServerLoad(healthy=False)
        return parse_vllm_metrics(resp.text)

    def reload(self, http: httpx.Client, path: str) -> None:
        # vLLM's own in-place reload from a checkpoint directory (no tirl code on the server needed).
        body = {"method": "reload_weights", "kwargs": {"weights_path": path}}
        _check(http.post("/collective_rpc", json=body, timeout=RELOAD_TIMEOUT_S), _dev_mode("reload weights"))
        self.reset_prefix_cache(http)

    def reset_prefix_cache(self, http: httpx.Client) -> None:
        # Running requests too: their cached blocks were computed with the old weights.
        resp = http.post(
            "/reset_prefix_cache", params={"reset_running_requests": "true"}, timeout=CONTROL_TIMEOUT_S
        )
        _check(resp, _dev_mode("reset the prefix cache"))

    def sleep(self, http: httpx.Client) -> None:
        _check(http.post("/sleep", params={"level": "1"}, timeout=RELOAD_TIMEOUT_S), _dev_mode("sleep"))

    def wake_up(self, http: httpx.Client) -> None:
        _check(http.post("/wake_up", timeout=RELOAD_TIMEOUT_S), _dev_mode("wake up"))


def _dev_mode(what: str) -> str:
    return f"{what} (start `vllm serve` with VLLM_SERVER_DEV_MODE=1: the endpoint is a development one)"


def _token_id(spelled: str) -> int:
    """'token_id:123' -> 123 (vLLM's return_tokens_as_token_ids spelling)."""
    prefix = "token_id:"
    if not isinstance(spelled, str) or not spelled.startswith(prefix):
        raise ServerError(
            f"log-prob token {spelled!r} is not an id: the server ignored return_tokens_as_token_ids"
        )
    return int(spelled[len(prefix) :])


# ---- a reply, checked at the boundary -----------------------------------------------------------------


@contextlib.contextmanager
def _malformed(what: str) -> Iterator[None]:
    """A reply missing its fields, or with fields of the wrong type: one InvalidReplyError saying so."""
    try:
        yield
    except InvalidReplyError:
        raise
    except ServerError as e:
        raise InvalidReplyError(str(e)) from None
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        raise InvalidReplyError(f"{what} that is not one ({type(e).__name__}: {e})") from None


def _ids(values: list) -> list[int]:
    """Token ids as JSON integers (a float, a string or a bool is not an id)."""
    if not isinstance(values, list):
        raise TypeError(f"token ids must be a list, not {type(values).__name__}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"token id {v!r} is not an integer")
    return list(values)


def _floats(values: list) -> list[float]:
    if not isinstance(values, list):
        raise TypeError(f"log-probs must be a list, not {type(values).__name__}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise TypeError(f"log-prob {v!r} is not a number")
    return [float(v) for v in values]


# A log-softmax is <= 0 in floating point too, but a server's fused kernels may round a certain token's
# log-prob a hair above 0: that is noise, not a probability above 1.
LOGPROB_ROUNDING = 1e-4


def check_generation(gen: Generation, max_tokens: int, vocab_size: int | None, server: str) -> Generation:
    """The reply as training may take it: ids in [0, vocab_size), at most max_tokens of them, one
    finite log-prob <= 0 per token (LOGPROB_ROUNDING above it allowed). Otherwise InvalidReplyError
    naming the first thing wrong."""
    ids, lps = gen.token_ids, gen.logprobs
    if len(ids) > max_tokens:
        raise InvalidReplyError(
            f"{server}: answered {len(ids)} tokens where at most {max_tokens} were asked for"
        )
    if len(lps) != len(ids):
        raise InvalidReplyError(f"{server}: {len(ids)} tokens but {len(lps)} log-probs")
    top = vocab_size if vocab_size is not None else math.inf
    for i, t in enumerate(ids):
        if not 0 <= t < top:
            raise InvalidReplyError(
                f"{server}: token {i} has id {t}, outside the model's vocabulary (0..{vocab_size - 1 if vocab_size else '?'}): "
                "is the server serving the model of engine.model?"
            )
    for i, lp in enumerate(lps):
        if not (math.isfinite(lp) and lp <= LOGPROB_ROUNDING):
            raise InvalidReplyError(
                f"{server}: token {i} has log-prob {lp!r}: a log-probability is finite and <= 0 "
                "(start vLLM with --logprobs-mode processed_logprobs)"
            )
    return gen


def vocab_size(model_dir: str) -> int | None:
    """The vocabulary of the local copy of the served model (config.json's vocab_size), if it says."""
    config = Path(model_dir) / "config.json" if model_dir else None
    if config is None or not config.is_file():
        return None
    try:
        size = json.loads(config.read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None
    return size if isinstance(size, int) and size > 0 else None


def parse_vllm_metrics(text: str) -> ServerLoad:
    """KV usage, total KV tokens (cache_config_info: blocks x block size) and preemptions from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    load = ServerLoad(healthy=True)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:kv_cache_usage_perc":
                load.used_share = max(load.used_share or 0.0, float(sample.value))
            elif sample.name == "vllm:num_preemptions_total":
                load.preemptions += int(sample.value)
            elif sample.name == "vllm:cache_config_info":
                blocks = sample.labels.get("num_gpu_blocks")
                size = sample.labels.get("block_size")
                if blocks not in (None, "None") and size not in (None, "None"):
                    load.total_tokens = int(blocks) * int(size)
    return load


# ---- SGLang's native server ---------------------------------------------------------------------------


class SGLangServerAPI:
    """`python -m sglang.launch_server` (its native /generate: token ids in and out)."""

    generate_path = "/generate"

    def __init__(self, served_model: str = ""):
        self.model = served_model

    def generate_body(self, prompt_ids: list[int], params: SamplingParams, max_tokens: int) -> dict:
        sampling: dict[str, Any] = {
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_new_tokens": max_tokens,
            "stop_token_ids": list(params.stop_token_ids),
            "no_stop_trim": True,  # keep "</tool_call>" and the stop token in the output
            "skip_special_tokens": False,
        }
        if params.stop_strings:
            sampling["stop"] = list(params.stop_strings)
        if params.seed is not None:
            sampling["sampling_seed"] = params.seed
        return {"input_ids": list(prompt_ids), "sampling_params": sampling, "return_logprob": True}

    def parse_generation(self, body: dict) -> Generation:
        with _malformed("an SGLang /generate answer"):
            meta = body.get("meta_info") or {}
            pairs = meta.get("output_token_logprobs") or []  # [[logprob, token_id, text|None], ...]
            token_ids = _ids([p[1] for p in pairs])
            output_ids = body.get("output_ids")
            if output_ids is not None and _ids(output_ids) != token_ids:
                raise ServerError("SGLang's output_ids and output_token_logprobs disagree")
            logprobs = _floats([p[0] for p in pairs])
            reason = (meta.get("finish_reason") or {}).get("type")
        return Generation(token_ids, logprobs, reason if reason in ("stop", "length") else "abort")

    async def describe(self, http: httpx.AsyncClient) -> tuple[str, int | None]:
        info = _check(await http.get("/model_info", timeout=CONTROL_TIMEOUT_S), "model info").json()
        server = _check(await http.get("/server_info", timeout=CONTROL_TIMEOUT_S), "server info").json()
        self.model = self.model or info.get("model_path", "")
        return self.model, server.get("context_length") or server.get("max_total_num_tokens")

    async def load(self, http: httpx.AsyncClient) -> ServerLoad:
        resp = await http.get("/v1/loads", params={"include": "core"}, timeout=CONTROL_TIMEOUT_S)
        if resp.status_code != 200:
            return ServerLoad(healthy=False)
        return parse_sglang_load(resp.json())

    def reload(self, http: httpx.Client, path: str) -> None:
        resp = http.post("/update_weights_from_disk", json={"model_path": path}, timeout=RELOAD_TIMEOUT_S)
        body = _check(resp, "reload weights").json()
        if body.get("success") is False:
            raise ServerError(f"SGLang could not load {path}: {body.get('message')}")
        self.reset_prefix_cache(http)

    def reset_prefix_cache(self, http: httpx.Client) -> None:
        _check(http.post("/flush_cache", timeout=CONTROL_TIMEOUT_S), "flush the cache")

    def sleep(self, http: httpx.Client) -> None:
        _check(http.post("/release_memory_occupation", json={}, timeout=RELOAD_TIMEOUT_S), "release memory")

    def wake_up(self, http: httpx.Client) -> None:
        _check(http.post("/resume_memory_occupation", json={}, timeout=RELOAD_TIMEOUT_S), "resume memory")


def parse_sglang_load(body: dict) -> ServerLoad:
    """/v1/loads answers one record per data-parallel rank: KV tokens in use of the pool's size."""
    total = used = 0
    for rank in body.get("loads") or []:
        total += int(rank.get("max_total_num_tokens") or 0)
        used += int(rank.get("num_used_tokens") or 0)
    return ServerLoad(True, total or None, used / total if total else None)


API_KINDS: dict[str, type] = {"vllm": VLLMServerAPI, "sglang": SGLangServerAPI}


# ---- one server = one Engine ----------------------------------------------------------------------------


def _headers(servers: RemoteServers) -> dict[str, str]:
    key = servers.api_key  # null in the config: $TIRL_ENGINE_API_KEY (tirl.config.secret_or_env)
    return {"Authorization": f"Bearer {key}"} if key else {}


class ServerEngine:
    """The Engine interface on one inference server. HTTP runs on the engine's own event-loop thread,
    so callers on any loop share one connection pool and the sync methods never block a loop."""

    def __init__(
        self,
        cfg: EngineConfig,
        url: str,
        name: str,
        fleet: ServerFleet | None = None,
        exited: Callable[[], int | None] | None = None,
    ):
        """`exited`: for a server this process started, its exit code or None while it runs, so that a
        server that died while starting is an error at once, not a wait of remote.start_timeout_s."""
        servers = cfg.remote
        self.cfg, self.url, self.name = cfg, url.rstrip("/"), name
        self._exited = exited
        self.fleet = fleet or ServerFleet()
        self.fleet.engines.append(self)
        self.api: ServerAPI = API_KINDS[servers.api](servers.served_model)
        self._asleep = False
        self._failed_polls = 0
        self.up = False  # answering and holding the fleet's current weights
        self.revived = False  # answering again after a failure, weights not yet synced
        self._down_since = 0.0
        self._load = ServerLoad(healthy=False)
        self._preemptions_seen = 0
        self.max_model_len: int | None = None
        self.vocab_size = vocab_size(cfg.model)  # token ids a reply may hold (None: not checked)
        self._control = httpx.Client(base_url=self.url, headers=_headers(servers))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"{name}-http", daemon=True)
        self._thread.start()
        self._http: httpx.AsyncClient | None = None
        self._poller: asyncio.Task | None = None
        try:
            self._call(self._start())
        except BaseException:
            self._stop()
            raise

    # --- life cycle -------------------------------------------------------------------------------
    async def _start(self) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self._http = httpx.AsyncClient(base_url=self.url, headers=_headers(self.cfg.remote), limits=limits)
        await self._wait_healthy(self.cfg.remote.start_timeout_s)
        _, self.max_model_len = await self.api.describe(self._http)
        self._load = await self.api.load(self._http)
        self.up = True
        self._poller = asyncio.get_running_loop().create_task(self._poll_forever())

    async def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            if self._exited is not None and (code := self._exited()) is not None:
                raise ServerExited(
                    f"{self.name}: the server for {self.url} exited with code {code} while starting"
                )
            try:
                if (await self._http.get("/health", timeout=5.0)).status_code == 200:  # type: ignore[union-attr]
                    return
                last = "unhealthy"
            except httpx.HTTPError as e:
                last = repr(e)
            await asyncio.sleep(0.5)
        raise ServerError(f"{self.name}: {self.url} was not healthy within {timeout_s:g} s ({last})")

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _on_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def close(self) -> None:
        if self._thread.is_alive():
            await self._on_loop(self._shutdown())
            await asyncio.to_thread(self._stop)
        self.fleet.closed(self)

    def close_now(self) -> None:
        """close() for callers outside any event loop (or inside one they may block)."""
        if self._thread.is_alive():
            self._call(self._shutdown())
            self._stop()
        self.fleet.closed(self)

    async def _shutdown(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        if self._http is not None:
            await self._http.aclose()

    def _stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        self._control.close()

    # --- health and load --------------------------------------------------------------------------
    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.remote.poll_s)
            await self.poll()

    async def poll(self) -> None:
        """One look at the server: load when healthy; a failed server that answers again is revived."""
        try:
            health = await self._http.get("/health", timeout=HEALTH_TIMEOUT_S)  # type: ignore[union-attr]
            healthy = health.status_code == 200
            load = await self.api.load(self._http) if healthy else ServerLoad(healthy=False)  # type: ignore[arg-type]
        except (httpx.HTTPError, ValueError) as e:
            log.debug("%s: poll failed: %r", self.name, e)
            load = ServerLoad(healthy=False)
        if load.healthy:
            self._load, self._failed_polls = load, 0
            if not self.up and time.monotonic() - self._down_since >= self.cfg.remote.down_cooldown_s:
                self.fleet.answering(self)
            return
        self._failed_polls += 1
        if self.up and self._failed_polls >= FAILED_POLLS_DOWN:
            self.fleet.lost(self, f"failed {self._failed_polls} health checks in a row")

    def capacity(self) -> KVCapacity:
        # The last poll's view: a remote call here would block the scheduler's event loop.
        total, share = self._load.total_tokens, self._load.used_share
        free = None if total is None or share is None else total - round(share * total)
        if not self.up:
            free = 0  # a down server offers no room
        return KVCapacity(total, free, self._load.preemptions)

    # --- generation -------------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        if not prompt_ids:
            raise ValueError("generate() needs at least one prompt token")
        max_tokens = params.max_tokens
        if self.max_model_len is not None:
            room = self.max_model_len - len(prompt_ids)
            if room <= 0:
                raise ValueError(
                    f"prompt of {len(prompt_ids)} tokens does not fit the server's max_model_len="
                    f"{self.max_model_len}: start the server with a longer context or shorten it"
                )
            max_tokens = min(max_tokens, room)
        if self.up:
            try:
                return await self._on_loop(self._generate(prompt_ids, params, max_tokens))
            except (httpx.TransportError, ServerError) as e:
                if isinstance(e, InvalidReplyError):
                    raise  # a misconfigured server: its error says what to fix
                if isinstance(e, ServerError) and e.status is not None and e.status < 500:
                    raise  # our request is wrong: another server would refuse it too
                self.fleet.lost(self, repr(e))
        return await self.fleet.reroute(self, prompt_ids, params)

    async def _generate(self, prompt_ids: list[int], params: SamplingParams, max_tokens: int) -> Generation:
        body = self.api.generate_body(prompt_ids, params, max_tokens)
        deadline_s = self.cfg.remote.request_timeout_s
        try:
            # One deadline for the whole request: httpx's timeout applies to each read, so a server
            # that drips its reply a byte at a time would never reach it.
            async with asyncio.timeout(deadline_s):
                resp = await self._http.post(  # type: ignore[union-attr]
                    self.api.generate_path, json=body, timeout=deadline_s
                )
        except TimeoutError:
            raise ServerError(
                f"{self.name} ({self.url}): no whole generation answer within {deadline_s:g} s "
                "(engine.remote.request_timeout_s)"
            ) from None
        _check(resp, f"{self.name}: generate")
        try:
            body = resp.json()
        except ValueError as e:
            raise InvalidReplyError(
                f"{self.name} ({self.url}): the generation answer is not JSON ({e})"
            ) from None
        if not isinstance(body, dict):
            raise InvalidReplyError(f"{self.name} ({self.url}): the generation answer is not a JSON object")
        try:
            generation = self.api.parse_generation(body)
        except InvalidReplyError as e:
            raise InvalidReplyError(f"{self.name} ({self.url}): {e}") from None
        return check_generation(generation, max_tokens, self.vocab_size, f"{self.name} ({self.url})")

    # --- weights, cache, sleep --------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Write the weights to engine.remote.weights_dir (once per sync for all servers), then reload."""
        path = self.fleet.write_weights(self.cfg, weights)
        self.load_weights_from_path(path)

    def load_weights_from_path(self, path: str | Path) -> None:
        """Reload in place from a checkpoint directory on storage the server sees, then drop its prefix cache."""
        if not (self.up or self.revived):
            log.warning("%s is down: it skips this weight sync and rejoins at a later one", self.name)
            return
        self.api.reload(self._control, str(path))
        self.fleet.synced([self])

    def reset_prefix_cache(self) -> None:
        self.api.reset_prefix_cache(self._control)

    def sleep(self) -> bool:
        """Free the server's memory while a colocated trainer runs (engine.enable_sleep_mode, a server
        started with --enable-sleep-mode); False where it was not asked for or the server cannot."""
        if not (self.cfg.enable_sleep_mode and self.up):
            return False
        try:
            self.api.sleep(self._control)
        except (ServerError, httpx.HTTPError) as e:
            log.warning("%s: the server could not sleep (%s); its memory stays in use", self.name, e)
            return False
        self._asleep = True
        return True

    def wake_up(self) -> None:
        if self._asleep:
            self.api.wake_up(self._control)
            self._asleep = False


# ---- the servers together: failover and one weights file per sync ----------------------------------


class ServerFleet(EngineFleet):
    """All servers of one run: failover (tirl.engines.fleet), a failed server's cool-down, and the
    weights written once per sync; the last sync's directory (a whole model) goes when the last server
    closes."""

    def __init__(self, counters: dict[str, int] | None = None):
        super().__init__(counters)
        self.syncs = 0  # weight syncs so far: a revived server with stale weights waits for the next
        self._written: tuple[_SyncKey, str] | None = None
        self._lock = threading.Lock()

    def lost(self, engine: ServerEngine, why: str) -> bool:
        if not super().lost(engine, f"{engine.url}: {why}"):
            return False
        engine._down_since = time.monotonic()
        return True

    def answering(self, engine: ServerEngine) -> None:
        """A failed server answers again: at once if no weights were ever synced, else after the next sync."""
        if self.syncs == 0:
            self.synced([engine])
        else:
            engine.revived = True

    def none_live(self) -> Exception:
        return NoLiveServerError(f"every inference server is down ({', '.join(e.url for e in self.engines)})")

    def closed(self, engine: ServerEngine) -> None:
        """`engine` closed; after the last one, the last sync's weights directory is removed."""
        if engine in self.engines:
            self.engines.remove(engine)
        with self._lock:
            if not self.engines and self._written is not None:
                shutil.rmtree(self._written[1], ignore_errors=True)
                self._written = None

    def write_weights(self, cfg: EngineConfig, weights: Iterable[tuple[str, torch.Tensor]]) -> str:
        """One directory per sync under weights_dir; the previous one is removed. The runtime hands every
        engine the same list, so the servers after the first reuse the file instead of writing it again."""
        if not isinstance(weights, list):
            weights = list(weights)
        if not weights:
            raise ValueError("load_weights() got no tensors")
        with self._lock:
            if self._written is not None and self._written[0].same(weights):
                return self._written[1]
            root = Path(cfg.remote.weights_dir or "")
            if not cfg.remote.weights_dir:
                raise ValueError(
                    "engine.remote.weights_dir is empty: give a directory both tirl and the servers see "
                    "(shared storage) for weight syncs"
                )
            self.syncs += 1
            target = root / f"tirl-sync-{os.getpid()}-{self.syncs}"
            save_checkpoint(weights, target, tied=_tied(cfg.model))
            if self._written is not None:
                shutil.rmtree(self._written[1], ignore_errors=True)
            self._written = (_SyncKey.of(weights), str(target))
            return str(target)


@dataclass(frozen=True)
class _SyncKey:
    """Which weights a sync wrote, without keeping them alive (a whole model on the host): weak
    references to the very tensors, with their in-place version counters. An id() would do neither: a
    later sync's list or tensor can reuse a freed one's address, and the servers would reload stale
    weights."""

    names: tuple[str, ...]
    refs: tuple[weakref.ref, ...]
    versions: tuple[int, ...]

    @classmethod
    def of(cls, weights: list[tuple[str, torch.Tensor]]) -> _SyncKey:
        return cls(
            tuple(n for n, _ in weights),
            tuple(weakref.ref(t) for _, t in weights),
            tuple(t._version for _, t in weights),
        )

    def same(self, weights: list[tuple[str, torch.Tensor]]) -> bool:
        return len(weights) == len(self.refs) and all(
            name == n and ref() is t and t._version == v
            for (name, t), n, ref, v in zip(weights, self.names, self.refs, self.versions, strict=True)
        )


def _tied(model_dir: str) -> bool:
    """Whether the model ties its output head to the embedding (config.json next to the tokenizer)."""
    import json

    config = Path(model_dir) / "config.json"
    if not model_dir or not config.is_file():
        return False
    return bool(json.loads(config.read_text()).get("tie_word_embeddings", False))


def save_checkpoint(weights: list[tuple[str, torch.Tensor]], target: Path, tied: bool) -> None:
    """One safetensors file a server reloads in place. A tied head is written out as lm_head.weight:
    an in-place reload unties it, and the trainer names the tied tensor once (as the embedding)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in weights:
        t = tensor.detach().to("cpu").contiguous()
        if t.data_ptr() in seen:
            t = t.clone()  # safetensors refuses shared storage
        seen.add(t.data_ptr())
        tensors[name] = t
    embed = next((n for n in tensors if n.endswith("embed_tokens.weight")), None)
    if tied and embed and "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = tensors[embed].clone()
    scratch = target.with_name(target.name + ".partial")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    save_file(tensors, str(scratch / "model.safetensors"))
    scratch.rename(target)  # a server never sees a half-written file


def build_server_engines(cfg: EngineConfig, counters: dict[str, int] | None = None) -> list[ServerEngine]:
    """One engine per URL in engine.remote.urls, sharing one fleet (failover, one weights file per sync)."""
    urls = cfg.remote.urls
    if not urls:
        raise ValueError("engine.backend=remote needs engine.remote.urls, e.g. ['http://10.0.0.5:8000']")
    if not cfg.model:
        raise ValueError(
            "engine.model is empty: with engine.backend=remote it names a local copy of the served model's "
            "tokenizer and config (the prompts are tokenized here)"
        )
    fleet = ServerFleet(counters)
    engines: list[ServerEngine] = []
    try:
        for i, url in enumerate(urls):
            engines.append(ServerEngine(cfg, url, f"remote{i}", fleet))
    except BaseException:
        for e in engines:
            e.close_now()
        raise
    return engines
