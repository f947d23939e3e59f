"""`SandboxClient`: async HTTP client over one or many sandbox services.

Calls are batched like the paper's send workers (a batch leaves when it is full or after
`max_wait_ms`, or at once when nothing is in flight), spread over endpoints by free capacity
(per-endpoint concurrency limits), endpoints that fail are marked down for a cool-down, and
infrastructure failures are retried with back-off. A call that still cannot run comes back as
`sandbox_error` / `queue_timeout`, never as a program error or empty output.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from dataclasses import dataclass, field

import aiohttp

from tirl.sandbox.result import ExecResult, Status

QUEUE_ALLOWANCE_S = 120.0  # how long the server may queue a batch before it answers
# What a request that never got its answer raises: the connection failed, broke or timed out.
TransportError = (aiohttp.ClientError, TimeoutError)


@dataclass
class _Reply:
    status_code: int
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def json(self) -> dict:
        return json.loads(self.body)


class _Http:
    """Keep-alive HTTP/1.1 to the services over aiohttp, whose client costs about a third of httpx's CPU
    per request (0.24 against 0.81 ms, measured on a session's cells: docs/sandbox-sessions.md). Bodies
    are JSON in ASCII, so a lone surrogate in a model's tool call ("\\ud800") travels escaped instead of
    failing to encode. Opened on first use, inside the event loop that uses it."""

    def __init__(self, headers: dict[str, str]) -> None:
        self._headers = {**headers, "Content-Type": "application/json"}
        self._session: aiohttp.ClientSession | None = None

    async def request(self, method: str, url: str, body: object = None, timeout: float = 30.0) -> _Reply:
        if self._session is None or self._session.closed:
            # No cap on connections (the client's per-endpoint concurrency is the cap); an idle one is
            # dropped before uvicorn's 5 s would close it under a request that reuses it.
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=4.0)
            self._session = aiohttp.ClientSession(headers=self._headers, connector=connector)
        data = None if body is None else json.dumps(body).encode()
        async with self._session.request(
            method, url, data=data, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            return _Reply(resp.status, await resp.read())

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


@dataclass
class _Endpoint:
    url: str
    limit: int
    inflight: int = 0
    down_until: float = 0.0
    failures: int = 0

    @property
    def free(self) -> int:
        return self.limit - self.inflight

    def up(self, now: float) -> bool:
        return now >= self.down_until


@dataclass
class _Pending:
    payload: dict
    future: asyncio.Future
    attempts: int = 0
    last_error: ExecResult | None = field(default=None, repr=False)


class SandboxClient:
    """`async with SandboxClient(["http://127.0.0.1:8080"]) as c: r = await c.run("print(1)")`"""

    def __init__(
        self,
        endpoints: str | list[str],
        *,
        token: str | None = None,
        concurrency: int = 64,
        batch_size: int = 64,
        max_wait_ms: float = 2.0,
        retries: int = 3,
        backoff_s: float = 0.2,
        cooldown_s: float = 2.0,
        timeout: float | None = None,
        limits: dict | None = None,
    ) -> None:
        urls = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        if not urls:
            raise ValueError("SandboxClient needs at least one endpoint URL")
        self._endpoints = [_Endpoint(u.rstrip("/"), concurrency) for u in urls]
        self.batch_size, self.max_wait_s = batch_size, max_wait_ms / 1000
        self.retries, self.backoff_s, self.cooldown_s = retries, backoff_s, cooldown_s
        self.default_timeout, self.default_limits = timeout, limits
        self.token = token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = _Http(headers)
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self._capacity = asyncio.Condition()
        self._batcher: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._sessions: set[RemoteSession] = set()

    @property
    def endpoints(self) -> list[str]:
        return [ep.url for ep in self._endpoints]

    async def __aenter__(self) -> SandboxClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for t in [self._batcher, *self._tasks]:
            if t is not None:
                t.cancel()
        for session in list(self._sessions):  # nothing of ours stays alive on the servers
            await session.aclose()
        while not self._queue.empty():  # nobody will send these any more: say so instead of hanging
            p = self._queue.get_nowait()
            if not p.future.done():
                p.future.set_result(ExecResult(Status.SANDBOX_ERROR, message="sandbox client closed"))
        await self._http.aclose()

    # ---- public calls ----

    async def run(
        self, code: str, stdin: str = "", timeout: float | None = None, limits: dict | None = None
    ) -> ExecResult:
        payload = {"code": code, "stdin": stdin}
        if (t := timeout if timeout is not None else self.default_timeout) is not None:
            payload["timeout"] = t
        if (lim := limits if limits is not None else self.default_limits) is not None:
            payload["limits"] = lim
        if self._batcher is None or self._batcher.done():
            self._batcher = asyncio.create_task(self._batch_loop())
        future = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Pending(payload, future))
        return await future

    async def run_batch(self, calls: list[dict]) -> list[ExecResult]:
        """Many calls ({code, stdin?, timeout?, limits?}); results in order."""
        return list(await asyncio.gather(*(self.run(**c) for c in calls)))

    async def open_session(self, limits: dict | None = None, timeout: float | None = None) -> RemoteSession:
        """A persistent Python session on the endpoint with the most free capacity (close it when done)."""
        now = time.monotonic()
        ep = max([e for e in self._endpoints if e.up(now)] or self._endpoints, key=lambda e: e.free)
        body: dict = {}
        if limits is not None or self.default_limits is not None:
            body["limits"] = limits if limits is not None else self.default_limits
        if (t := timeout if timeout is not None else self.default_timeout) is not None:
            body["timeout"] = t
        resp = await self._http.request("POST", f"{ep.url}/sessions", body, timeout=QUEUE_ALLOWANCE_S)
        if resp.status_code != 200:
            raise RuntimeError(
                f"{ep.url} could not open a session: HTTP {resp.status_code} {resp.text[:300]}"
            )
        session = RemoteSession(self, ep.url, resp.json()["session"])
        self._sessions.add(session)
        return session

    async def health(self) -> list[dict]:
        """Each endpoint's /health answer (or the error), plus this client's view of it."""
        out = []
        for ep in self._endpoints:
            info = {"url": ep.url, "inflight": ep.inflight, "down": not ep.up(time.monotonic())}
            try:
                info["health"] = (await self._http.request("GET", f"{ep.url}/health", timeout=5)).json()
            except (*TransportError, ValueError) as exc:
                info["error"] = repr(exc)
            out.append(info)
        return out

    # ---- batching and dispatch ----

    def _inflight(self) -> int:
        return sum(ep.inflight for ep in self._endpoints)

    async def _batch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            deadline = loop.time() + (self.max_wait_s if self._inflight() else 0.0)
            while len(batch) < self.batch_size:
                try:
                    batch.append(self._queue.get_nowait())
                    continue
                except asyncio.QueueEmpty:
                    pass
                if (left := deadline - loop.time()) <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(), left))
                except TimeoutError:
                    break
            while batch:
                ep = await self._acquire()
                take = min(len(batch), max(ep.free, 1))
                chunk, batch = batch[:take], batch[take:]
                ep.inflight += len(chunk)
                self._spawn(self._send(ep, chunk))

    async def _acquire(self) -> _Endpoint:
        """The healthy endpoint with the most free capacity (any endpoint if all are down)."""
        async with self._capacity:
            while True:
                now = time.monotonic()
                candidates = [ep for ep in self._endpoints if ep.up(now)] or self._endpoints
                best = max(candidates, key=lambda ep: ep.free)
                if best.free > 0:
                    return best
                await self._capacity.wait()

    def _spawn(self, coro: object) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, ep: _Endpoint, chunk: list[_Pending]) -> None:
        timeout = max(p.payload.get("timeout") or 30.0 for p in chunk) + QUEUE_ALLOWANCE_S
        try:
            body = {"calls": [p.payload for p in chunk]}
            resp = await self._http.request("POST", f"{ep.url}/run/batch", body, timeout=timeout)
            if resp.status_code == 200:
                results = [ExecResult.from_dict(d) for d in resp.json()["results"]]
                ep.failures = 0
            elif resp.status_code in (429, 502, 503, 504) or resp.status_code >= 500:
                raise _Infra(Status.SANDBOX_ERROR, f"{ep.url} answered HTTP {resp.status_code}")
            else:  # the request itself was refused: retrying will not help
                results = [
                    ExecResult(
                        Status.SANDBOX_ERROR,
                        message=f"request refused by {ep.url}: HTTP {resp.status_code} {resp.text[:300]}",
                    )
                ] * len(chunk)
                for p in chunk:
                    p.attempts = self.retries
        except (*TransportError, ValueError, KeyError, _Infra) as exc:
            ep.failures += 1
            ep.down_until = time.monotonic() + self.cooldown_s * min(ep.failures, 8)
            status, message = (
                (exc.status, exc.message)
                if isinstance(exc, _Infra)
                else (Status.SANDBOX_ERROR, f"{ep.url}: {exc!r}")
            )
            results = [ExecResult(status, message=message)] * len(chunk)
        finally:
            ep.inflight -= len(chunk)
            async with self._capacity:
                self._capacity.notify_all()
        for p, r in zip(chunk, results, strict=True):
            self._settle(p, r)

    def _settle(self, p: _Pending, r: ExecResult) -> None:
        if p.future.done():
            return
        if r.is_infra_error and p.attempts < self.retries:
            p.attempts += 1
            p.last_error = r
            self._spawn(self._retry(p))
        else:
            if r.is_infra_error:
                r = ExecResult(
                    r.status, message=f"{r.message} (after {p.attempts + 1} attempts)", extra=dict(r.extra)
                )
            p.future.set_result(r)

    async def _retry(self, p: _Pending) -> None:
        await asyncio.sleep(self.backoff_s * (2 ** (p.attempts - 1)) * (0.5 + random.random()))
        self._queue.put_nowait(p)


class _Infra(Exception):
    def __init__(self, status: Status, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class RemoteSession:
    """A persistent Python session on one service: `await s.run(code)` keeps variables between calls."""

    def __init__(self, client: SandboxClient, url: str, session_id: str) -> None:
        self._client, self.url, self.id = client, url, session_id

    async def run(self, code: str, stdin: str = "", timeout: float | None = None) -> ExecResult:
        payload: dict = {"code": code, "stdin": stdin}
        if timeout is not None:
            payload["timeout"] = timeout
        wait = (timeout or 30.0) + QUEUE_ALLOWANCE_S
        try:
            resp = await self._client._http.request(
                "POST", f"{self.url}/sessions/{self.id}/run", payload, timeout=wait
            )
        except TransportError as exc:
            return ExecResult(Status.SANDBOX_ERROR, message=f"{self.url}: {exc!r}")
        if resp.status_code == 404:  # closed, expired or its server restarted: the state is gone
            return ExecResult(
                Status.RUNTIME_ERROR,
                message=resp.json().get("error", "session gone"),
                extra={"session_lost": True},
            )
        if resp.status_code not in (200, 429):
            return ExecResult(
                Status.SANDBOX_ERROR,
                message=f"{self.url} answered HTTP {resp.status_code}: {resp.text[:300]}",
            )
        return ExecResult.from_dict(resp.json())

    async def aclose(self) -> None:
        self._client._sessions.discard(self)
        with contextlib.suppress(*TransportError):  # else the server's idle expiry ends it
            await self._client._http.request("DELETE", f"{self.url}/sessions/{self.id}", timeout=30)

    async def __aenter__(self) -> RemoteSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
