"""One byte budget for the request bodies the sandbox service holds, counted as their bytes arrive.

An ASGI middleware (inside the HTTP guard, so the token is checked first). A request holds of the
budget exactly the body bytes it has received: each chunk the server hands over is counted before
the next is asked for, and a chunk that would pass the budget is answered 429 (the rest of the body
stays in the client's socket: the server reads a connection only as far as the app asks, plus one
small buffer). A declared Content-Length reserves nothing: before, it was reserved whole before a
byte was read, so two connections that declared 64 MiB bodies and sent nothing held the whole
128 MiB budget, and every other client got 429 until the body deadline (no bandwidth needed).
Each connection is capped: one body holds at most `max_body_bytes` (413 beyond), and a body that
stops arriving for `stall_s` while it holds bytes is answered 408 and its connection closed, so a
client must keep sending to keep what it holds. The bytes are held until the answer is sent (a
waiting request keeps its body), then given back. (The whole body's deadline is the HTTP guard's:
tirl.http_guard.)
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse

STALL_S = 10.0  # a body holding bytes of the budget must send more within this (else 408)


class _Refused(Exception):
    def __init__(self, status: int, message: str, retry: bool = False, close: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.retry, self.close = status, message, retry, close

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.retry else {}
        if self.close:
            headers["Connection"] = "close"
        return JSONResponse({"error": self.message}, status_code=self.status, headers=headers or None)


@dataclass
class _Holding:
    bytes: int = 0  # what one request holds of the budget


class BodyBudget:
    """ASGI middleware: read the body (counted as it arrives, bounded in size and stall), hand it on,
    give its bytes back."""

    def __init__(self, app: Any, budget_bytes: int, max_body_bytes: int, stall_s: float = STALL_S) -> None:
        self.app, self.budget_bytes, self.max_body_bytes = app, budget_bytes, max_body_bytes
        self.stall_s = stall_s
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
                body = await self._read(receive, holding, declared)
            except _Refused as refused:
                return await refused.response()(scope, receive, send)
            await self.app(scope, _replay(body, receive), send)
        finally:
            self.reserved -= holding.bytes  # given back once, however the request ended

    def _hold(self, holding: _Holding, more: int) -> None:
        """Count `more` received bytes for `holding`, or refuse (429) when they do not fit."""
        if self.reserved + more > self.budget_bytes:
            raise _Refused(
                429,
                f"request bodies in flight: {self.reserved >> 20} MiB held, {more >> 10} KiB more exceed "
                f"the budget of {self.budget_bytes >> 20} MiB: retry later",
                retry=True,
                close=True,  # the rest of this body is never read
            )
        self.reserved += more
        holding.bytes += more

    async def _read(self, receive: Any, holding: _Holding, declared: int | None) -> bytes:
        """The body, each chunk counted against the budget as it arrives."""
        chunks = []
        while True:
            message = await self._next(receive, holding)
            if message["type"] == "http.disconnect":
                raise _Refused(400, "the client disconnected before sending its whole body")
            chunk = message.get("body", b"")
            if holding.bytes + len(chunk) > self.max_body_bytes:
                raise self._too_large()
            if declared is not None and holding.bytes + len(chunk) > declared:
                raise _Refused(400, f"the body is longer than its Content-Length ({declared} bytes)")
            self._hold(holding, len(chunk))
            chunks.append(chunk)
            if not message.get("more_body"):
                return b"".join(chunks)

    async def _next(self, receive: Any, holding: _Holding) -> dict:
        """The next message; a body that holds bytes and stops sending for `stall_s` is cut (408)."""
        if not holding.bytes:
            return await receive()  # holds nothing yet: the guard's deadline alone applies
        try:
            async with asyncio.timeout(self.stall_s):
                return await receive()
        except TimeoutError:
            raise _Refused(
                408,
                f"the request body stopped arriving for {self.stall_s:g} s while it held "
                f"{holding.bytes >> 10} KiB of the service's body budget",
                close=True,
            ) from None

    def _too_large(self) -> _Refused:
        return _Refused(413, f"request body too large (limit {self.max_body_bytes} bytes)", close=True)


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
