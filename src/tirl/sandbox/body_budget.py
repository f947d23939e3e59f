"""One byte budget for the request bodies the sandbox service holds, reserved before bytes are read.

An ASGI middleware (inside the HTTP guard, so the token is checked first). A request reserves its
body's bytes from the budget *before* it reads any of them: the declared Content-Length at once,
a body without one (chunked) step by step ahead of each chunk it reads. A request that does not fit
is answered 429 while its bytes are still in the client's socket (the server reads a connection
only as far as the app asks, plus one small buffer), so concurrent uploads cannot grow the
service's memory past the budget: before, a body was counted only after it was read whole, and
uploads that started together all passed the check. The reservation is held until the answer is
sent (a waiting request keeps its body), then given back. A body larger than `max_body_bytes`
answers 413. (A body that does not arrive in time is the HTTP guard's to answer: tirl.http_guard.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse

STEP_BYTES = 1 << 20  # a body without a declared length reserves this much ahead of each read


class _Refused(Exception):
    def __init__(self, status: int, message: str, retry: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.retry = status, message, retry

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.retry else None
        return JSONResponse({"error": self.message}, status_code=self.status, headers=headers)


@dataclass
class _Holding:
    bytes: int = 0  # what one request holds of the budget


class BodyBudget:
    """ASGI middleware: reserve, read (bounded in size), hand the body on, give it back."""

    def __init__(self, app: Any, budget_bytes: int, max_body_bytes: int) -> None:
        self.app, self.budget_bytes, self.max_body_bytes = app, budget_bytes, max_body_bytes
        self.reserved = 0  # bytes held by requests reading or holding their bodies

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        holding = _Holding()
        try:
            try:
                declared = _declared_length(scope)
                if declared is not None and declared > self.max_body_bytes:
                    raise self._too_large()
                self._reserve(holding, declared if declared is not None else STEP_BYTES)
                body = await self._read(receive, holding, declared)
            except _Refused as refused:
                return await refused.response()(scope, receive, send)
            await self.app(scope, _replay(body, receive), send)
        finally:
            self.reserved -= holding.bytes  # given back once, however the request ended

    def _reserve(self, holding: _Holding, more: int) -> None:
        """Take `more` bytes of the budget for `holding`, or refuse (429) when they do not fit."""
        if more and self.reserved + more > self.budget_bytes:
            raise _Refused(
                429,
                f"request bodies in flight: {self.reserved >> 20} MiB held, {more >> 20} MiB more exceed "
                f"the budget of {self.budget_bytes >> 20} MiB: retry later",
                retry=True,
            )
        self.reserved += more
        holding.bytes += more

    async def _read(self, receive: Any, holding: _Holding, declared: int | None) -> bytes:
        """The body, never reading more bytes than were reserved beforehand."""
        chunks, seen = [], 0
        while True:
            if declared is None and seen + STEP_BYTES > holding.bytes:
                self._reserve(holding, STEP_BYTES)  # before the next chunk is read
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Refused(400, "the client disconnected before sending its whole body")
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.max_body_bytes:
                raise self._too_large()
            if seen > holding.bytes and declared is not None:
                raise _Refused(400, f"the body is longer than its Content-Length ({declared} bytes)")
            if seen > holding.bytes:  # one chunk larger than a step (the server reads in small ones)
                self._reserve(holding, seen - holding.bytes)
            chunks.append(chunk)
            if not message.get("more_body"):
                return b"".join(chunks)

    def _too_large(self) -> _Refused:
        return _Refused(413, f"request body too large (limit {self.max_body_bytes} bytes)")


def _declared_length(scope: dict) -> int | None:
    """The body's declared length; None for a chunked body; 0 when the request says it has none."""
    headers = {name.lower(): value for name, value in scope.get("headers", [])}
    if (value := headers.get(b"content-length")) is not None:
        if not value.strip().isdigit():
            raise _Refused(400, f"invalid Content-Length {value[:40]!r}")
        return int(value)
    return None if b"transfer-encoding" in headers else 0


def _replay(body: bytes, receive: Any) -> Any:
    """A `receive` that gives the app the body once, then whatever the connection says next."""
    replayed = False

    async def replayed_receive() -> dict:
        nonlocal replayed
        if replayed:
            return await receive()  # disconnect notices
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed_receive
