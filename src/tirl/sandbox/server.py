"""`tirl sandbox serve`: the sandbox pool behind HTTP (FastAPI + uvicorn).

POST /run (one call), POST /run/batch (many, results in order), POST /run_code (SandboxFusion),
POST /sessions, POST /sessions/{id}/run, DELETE /sessions/{id} (persistent Python sessions),
GET /health (no token needed: it shows load, limits and active isolation, nothing a caller could
abuse), GET /metrics (Prometheus). Overload answers 429 / `queue_timeout` quickly.

Every request passes tirl's HTTP guard (tirl/http_guard.py, shared by every server tirl starts)
before the app sees it: the Host header must name this machine when no token is set (a
DNS-rebinding web page cannot reach a token-less local service), and so must a browser's Origin;
the token is checked before the body is read; the body must fit in `max_body_bytes` (413, counted
while it is read) and arrive within BODY_TIMEOUT_S; a connection that does not finish its request
headers within HEADER_TIMEOUT_S is closed (slowloris). With a token, bodies are JSON whatever the
Content-Type says (so `curl -d` works); without one, a POST must say Content-Type:
application/json (a web page the user visits can make the browser send a plain-text POST to a
local service without asking; a JSON one it cannot). The bytes of all request bodies in flight share one budget, counted as they
arrive (body_budget.py; beyond it: 429), replies are capped on the JSON sent (reply.py), and
a call or cell that could not even queue (queue full) is refused before its body is parsed.
Anything that is not a valid request answers 4xx with a message; anything unexpected answers 503
(SandboxClient retries it elsewhere), never 500. There are no /docs or /openapi.json pages.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tirl.http_guard import (
    HEADER_TIMEOUT_S,  # noqa: F401 (this service's, named in its docstring)
    LOOPBACK_HOSTS,
    GuardPolicy,
    HTTPGuard,
    header_deadline_protocol,
)
from tirl.sandbox.body_budget import BodyBudget
from tirl.sandbox.fusion import PYTHON_NAMES, RunCodeRequest, to_fusion
from tirl.sandbox.limits import MiB, host_memory_bytes
from tirl.sandbox.metrics import ServiceMetrics
from tirl.sandbox.pool import Sandbox, SessionError
from tirl.sandbox.reply import fit
from tirl.sandbox.result import ExecResult, Status
from tirl.sandbox.session import Session

MAX_BODY_BYTES = 64 * MiB
MAX_BATCH = 4096
MAX_RESPONSE_BYTES = 32 * MiB  # the JSON of a reply, as sent (reply.py); larger batches are refused up front
# Request bodies held at once, queued and running: room for the largest body and more. A waiting
# request holds its body about three times (raw, parsed JSON, validated model).
MAX_INFLIGHT_BYTES = 2 * MAX_BODY_BYTES
BODY_TIMEOUT_S = 60.0  # a 64 MiB body on a slow link; HEADER_TIMEOUT_S is the guard's (10 s)
Model = TypeVar("Model", bound=BaseModel)


class LimitsOverride(BaseModel):
    """Per-call limits; each is clamped to the server's maxima."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    memory_mb: int | None = Field(None, ge=32)
    output_bytes: int | None = Field(None, ge=1024)
    keep_bytes: int | None = Field(None, ge=256)
    max_procs: int | None = Field(None, ge=1)
    file_size_mb: int | None = Field(None, ge=1)
    open_files: int | None = Field(None, ge=16)


class RunRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    code: str
    stdin: str = ""
    timeout: float | None = Field(None, gt=0, description="seconds; clamped to the server maximum")
    language: str = "python"
    limits: LimitsOverride | None = None


class SessionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    limits: LimitsOverride | None = None
    timeout: float | None = Field(None, gt=0, description="default per-cell time limit, seconds")


class BatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    calls: list[RunRequest] = Field(max_length=MAX_BATCH)


def _json_error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


STOPPED = (
    "the sandbox service stopped before this call finished (Ctrl-C or SIGTERM on the server): "
    "retry it on another endpoint or after a restart"
)


async def _answer_unless_stopped(app: Any, scope: dict, receive: Any, send: Any) -> None:
    """Run the app; a request that the server's shutdown cancels before it answered gets a 503 (which
    SandboxClient retries elsewhere) instead of uvicorn's bare 500 and a traceback in the log."""
    answered = False

    async def tracking_send(message: dict) -> None:
        nonlocal answered
        answered = answered or message["type"] == "http.response.start"
        await send(message)

    try:
        await app(scope, receive, tracking_send)
    except asyncio.CancelledError:
        if answered:
            raise
        await _json_error(503, STOPPED, {"Retry-After": "1"})(scope, receive, send)
    except Exception as exc:  # a bug or a broken slot: this request fails, retryable, the service serves on
        logging.getLogger(__name__).exception("unexpected error in %s", scope.get("path"))
        if answered:
            raise
        await _json_error(503, f"sandbox error: {exc!r} (retry)", {"Retry-After": "1"})(scope, receive, send)


class _AnswerUnlessStopped:
    """ASGI middleware: `_answer_unless_stopped` around everything inside it (503, never a bare 500)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        await _answer_unless_stopped(self.app, scope, receive, send)


class _SessionCells:
    """ASGI middleware: POST /sessions/{id}/run answered by `run_cell(id, body)` directly; every other
    request goes on to the app. A refused cell (HTTPException) is answered by `refusal`, as the app's
    own exception handler answers the other routes."""

    PATH = re.compile(r"/sessions/([^/]+)/run")

    def __init__(
        self,
        app: Any,
        run_cell: Callable[[str, bytes], Awaitable[JSONResponse]],
        refusal: Callable[[HTTPException], JSONResponse],
    ) -> None:
        self.app, self.run_cell, self.refusal = app, run_cell, refusal

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        match = self.PATH.fullmatch(scope["path"]) if scope["type"] == "http" else None
        if match is None:
            return await self.app(scope, receive, send)
        if scope["method"] != "POST":
            response = _json_error(405, "Method Not Allowed", {"Allow": "POST"})
            return await response(scope, receive, send)
        try:
            response = await self.run_cell(match[1], await _body(receive))
        except HTTPException as exc:
            response = self.refusal(exc)
        await response(scope, receive, send)


async def _body(receive: Any) -> bytes:
    """A request's whole body (the body budget hands it over in one message)."""
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if message["type"] != "http.request" or not message.get("more_body"):
            return b"".join(chunks)


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


async def _parse(request: Request, model: type[Model]) -> Model:
    """The body as `model`, whatever the Content-Type says; 400/422 with a message otherwise."""
    return _parse_body(await request.body(), model)


def _parse_body(body: bytes, model: type[Model]) -> Model:
    try:
        data = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise HTTPException(
            400, f'the body is not JSON ({exc}); send a JSON object such as {{"code": "print(1)"}}'
        ) from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"body.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:10]
        )
        raise HTTPException(422, f"invalid request: {problems}") from None


def _check_language(language: str) -> None:
    if language.lower() not in PYTHON_NAMES:
        raise HTTPException(
            400, f"unsupported language {language!r}: this service runs Python only (use 'python')"
        )


def _check_fits(sandbox: Sandbox, calls: list[RunRequest], cap: int = MAX_RESPONSE_BYTES) -> None:
    """Refuse what the machine cannot hold: stdin beyond the call's memory, batches whose results
    (head and tail of two streams per call, raw) could not fit in one reply even unescaped. What is
    sent is capped on its JSON (escapes included) by reply.fit."""
    response = 0
    for i, call in enumerate(calls):
        limits = sandbox.call_limits(
            call.timeout, call.limits.model_dump(exclude_none=True) if call.limits else None
        )
        stdin = len(call.stdin.encode("utf-8", "surrogatepass"))
        if stdin > limits.memory_mb * MiB // 2:
            where = f"calls.{i}." if len(calls) > 1 else ""
            raise HTTPException(
                413,
                f"{where}stdin is {stdin >> 20} MiB: more than half the call's memory limit ({limits.memory_mb} MiB)",
            )
        response += 4 * limits.keep_bytes
    if response > cap:
        raise HTTPException(
            413,
            f"the batch's results could reach {response >> 20} MiB (4 x keep_bytes per call): "
            f"send smaller batches or a smaller keep_bytes (at most {cap >> 20} MiB per batch)",
        )


def _admit(sandbox: Sandbox) -> None:
    """429 at once, before the body is parsed, when the call could not even queue."""
    if (refused := sandbox.admission()) is not None:
        status = 429 if refused.status == Status.QUEUE_TIMEOUT else 503
        raise HTTPException(status, refused.message, headers={"Retry-After": "1"})


def create_app(
    sandbox: Sandbox,
    token: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    allowed_hosts: frozenset[str] | set[str] = frozenset(),
    max_inflight_bytes: int = MAX_INFLIGHT_BYTES,
    max_reply_bytes: int = MAX_RESPONSE_BYTES,
) -> FastAPI:
    """The HTTP app around a (not yet started) Sandbox; the app's lifespan starts and stops it."""
    metrics = ServiceMetrics(lambda: sandbox.health()["queued"], lambda: sandbox.health()["busy"])

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        async with sandbox:
            yield

    app = FastAPI(title="tirl sandbox", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def refusal(exc: HTTPException) -> JSONResponse:
        metrics.rejected.inc()
        return _json_error(exc.status_code, str(exc.detail), exc.headers)

    @app.exception_handler(HTTPException)
    async def refused(_: Request, exc: HTTPException) -> JSONResponse:
        return refusal(exc)

    async def run_one(req: RunRequest) -> ExecResult:
        """One call; whatever goes wrong stays this call's result (a batch never fails as a whole)."""
        start = time.monotonic()
        try:
            limits = req.limits.model_dump(exclude_none=True) if req.limits else None
            result = await sandbox.run(req.code, req.stdin, req.timeout, limits)
        except Exception as exc:  # reported as this call's infrastructure failure
            result = ExecResult(Status.SANDBOX_ERROR, message=f"sandbox error: {exc!r}")
        metrics.observe(result, time.monotonic() - start)
        return result

    @app.post("/run")
    async def run(request: Request) -> JSONResponse:
        _admit(sandbox)
        req = await _parse(request, RunRequest)
        _check_language(req.language)
        _check_fits(sandbox, [req], max_reply_bytes)
        [result] = fit([await run_one(req)], max_reply_bytes)
        overloaded = result.status == Status.QUEUE_TIMEOUT
        headers = {"Retry-After": "1"} if overloaded else None
        return JSONResponse(result.to_dict(), status_code=429 if overloaded else 200, headers=headers)

    @app.post("/run/batch")
    async def run_batch(request: Request) -> dict:
        _admit(sandbox)
        req = await _parse(request, BatchRequest)
        for call in req.calls:
            _check_language(call.language)
        _check_fits(sandbox, req.calls, max_reply_bytes)
        results = fit(list(await asyncio.gather(*(run_one(c) for c in req.calls))), max_reply_bytes)
        return {"results": [r.to_dict() for r in results]}

    @app.post("/run_code")
    async def run_code(request: Request) -> dict:
        _admit(sandbox)
        req = await _parse(request, RunCodeRequest)
        _check_language(req.language)
        if req.files or req.fetch_files:
            raise HTTPException(
                400, "files and fetch_files are not supported: pass data through code or stdin"
            )
        limits = (
            LimitsOverride(memory_mb=req.memory_limit_MB)
            if req.memory_limit_MB and req.memory_limit_MB > 0
            else None
        )
        call = RunRequest(code=req.code, stdin=req.stdin or "", timeout=req.run_timeout, limits=limits)
        _check_fits(sandbox, [call], max_reply_bytes)
        return to_fusion(fit([await run_one(call)], max_reply_bytes)[0])

    @app.post("/sessions")
    async def open_session(request: Request) -> dict:
        _admit(sandbox)
        body = await request.body()
        req = await _parse(request, SessionRequest) if body.strip() else SessionRequest()
        limits = req.limits.model_dump(exclude_none=True) if req.limits else {}
        if req.timeout is not None:
            limits["timeout_s"] = req.timeout
        try:
            session = await sandbox.open_session(limits or None)
        except SessionError as exc:
            raise HTTPException(429, str(exc)) from None
        return {"session": session.id, "limits": session.limits.model_dump()}

    def _live(session_id: str) -> Session:
        session = sandbox.session(session_id)
        if session is None:
            raise HTTPException(
                404,
                f"no live session {session_id!r} (closed, expired after being idle, or never opened): open a new one",
            )
        return session

    async def run_cell(session_id: str, body: bytes) -> JSONResponse:
        session = _live(session_id)
        _admit(sandbox)
        req = _parse_body(body, RunRequest)
        _check_language(req.language)
        if req.limits is not None:
            raise HTTPException(422, "a session's limits are set when it is opened (POST /sessions)")
        _check_fits(sandbox, [req], max_reply_bytes)
        start = time.monotonic()
        result = await sandbox.run_in_session(session, req.code, req.stdin, req.timeout)
        metrics.observe(result, time.monotonic() - start)
        [result] = fit([result], max_reply_bytes)
        overloaded = result.status == Status.QUEUE_TIMEOUT
        return JSONResponse(
            result.to_dict(),
            status_code=429 if overloaded else 200,
            headers={"Retry-After": "1"} if overloaded else None,
        )

    @app.delete("/sessions/{session_id}")
    async def close_session(session_id: str) -> dict:
        return {"closed": await sandbox.close_session(session_id)}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", **sandbox.health()}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    # POST /sessions/{id}/run, the route an agent calls every turn, is served here, before FastAPI's
    # routing and handler stack (a third of the service's HTTP work per cell); every guard below holds.
    app.add_middleware(_SessionCells, run_cell=run_cell, refusal=refusal)
    app.add_middleware(
        BodyBudget,
        budget_bytes=max_inflight_bytes,
        max_body_bytes=max_body_bytes,
    )
    # Outermost first: unexpected errors answer 503, then tirl's HTTP guard (Host, Origin, token,
    # media type, body size and deadline), then the body budget, then session cells, then the app.
    policy = GuardPolicy(
        LOOPBACK_HOSTS | set(allowed_hosts), token, max_body_bytes, body_timeout_s=BODY_TIMEOUT_S
    )
    app.add_middleware(HTTPGuard, policy=policy)
    app.add_middleware(_AnswerUnlessStopped)
    return app


def check_fits_machine(slots: int, max_memory_mb: int) -> None:
    """Refuse to start when the slots' memory could exceed the machine's (the OOM killer would pick)."""
    total = host_memory_bytes()
    if total and slots * max_memory_mb * MiB > total:
        raise ValueError(
            f"{slots} slots x {max_memory_mb} MiB (the largest memory limit a call may ask for) "
            f"exceed this machine's {total >> 20} MiB: lower --max-memory-mb or --slots"
        )


def _event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is installed (what uvicorn itself picks when it owns the loop):
    the service's sockets and pipes cost less CPU per call on it than on asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def serve(
    host: str = "127.0.0.1",
    port: int = 8080,
    token: str | None = None,
    allowed_hosts: list[str] | None = None,
    **sandbox_options: Any,
) -> None:
    """Run the service in the foreground until interrupted."""
    import importlib.util

    import uvicorn

    sandbox = Sandbox(**sandbox_options)
    check_fits_machine(sandbox.slots, sandbox.maxima.memory_mb)
    hosts = {*(allowed_hosts or ()), host.lower()} - {"0.0.0.0", "::"}
    app = create_app(sandbox, token=token, allowed_hosts=hosts)
    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        proxy_headers=False,  # no proxy in front: a forwarded address is not one to believe
        timeout_graceful_shutdown=5,
        http=header_deadline_protocol(http),
    )
    server = uvicorn.Server(config)

    async def main() -> None:
        async def announce() -> None:
            while not server.started and not server.should_exit:
                await asyncio.sleep(0.05)
            if server.started:
                auth = "bearer token required" if token else "no token: loopback Host names only"
                print(
                    f"tirl sandbox listening on http://{host}:{port} ({sandbox.slots} slots, {auth})",
                    flush=True,
                )

        task = asyncio.create_task(announce())
        await server.serve()
        task.cancel()

    with asyncio.Runner(loop_factory=_event_loop_factory()) as runner:
        runner.run(main())
