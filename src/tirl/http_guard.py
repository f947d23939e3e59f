"""The guard in front of every HTTP server tirl starts (the OpenAI-compatible endpoint, the sandbox
service, `tirl view --serve`): what a request must show before any handler sees it.

A web page the user has open can make the browser talk to a server on this machine: a "simple"
cross-site POST (a form, or fetch with a text/plain body) is sent without asking the server first,
and a DNS-rebinding page reads the answers under its own host name. So, in this order:

- Host: without a bearer token, the Host header must name this server (the loopback names, the host
  it binds to, and the names configured); a rebinding page's requests carry the attacker's name (421).
- Origin: without a token, a request a browser sent from another origin is refused (403); tirl's own
  clients (httpx, the openai client, curl) send none.
- Token: when one is configured, every path but the public ones (/health) needs
  `Authorization: Bearer <token>` (401), compared in constant time. A token proves the caller, so it
  replaces the Host, Origin and media checks (a remote client may address the server by any name).
  The token lives in memory only: `GuardPolicy`'s repr hides it, and nothing here writes it down.
- Media: without a token, a POST must say `Content-Type: application/json` (415): a page cannot send
  that cross-site without the browser asking the server first (a CORS preflight, never answered).
- Body: a declared length over the limit is refused before reading (413), and the bytes are counted
  while the app reads them, so a body without a length (chunked) stops at the limit, not after it.
- Time: a body not complete `body_timeout_s` after its headers is answered 408 and its connection
  closed (a client sending a byte a minute would hold a connection, and a few of them the server);
  `header_deadline_protocol` closes a uvicorn connection whose request headers do not arrive whole
  within HEADER_TIMEOUT_S, and `DeadlineReader` bounds a stdlib server's reads the same way.
- Scope: HTTP only. A websocket is refused at its handshake (403) and any other ASGI scope but
  lifespan raises, so a route added later cannot skip these checks.

Ids a caller must not guess (trajectories, sessions) come from `unguessable_id` (the secrets module).
"""

from __future__ import annotations

import asyncio
import hmac
import io
import json
import math
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})  # bind addresses, never a Host a client sends
PUBLIC_PATHS = frozenset({"/health"})
MiB = 1 << 20
BODY_TIMEOUT_S = 30.0  # a request body must arrive whole within this after its headers (else 408)
HEADER_TIMEOUT_S = 10.0  # a connection must send a request's headers whole within this (else closed)
MAX_HEADER_BYTES = 64 << 10  # a request line and headers larger than this are refused (431)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


@dataclass(frozen=True)
class GuardPolicy:
    """What one server accepts. `for_server` builds the usual one."""

    allowed_hosts: frozenset[str] = LOOPBACK_HOSTS
    token: str | None = field(default=None, repr=False)  # never in a repr, a log line or a file
    max_body_bytes: int = 4 * MiB
    public_paths: frozenset[str] = PUBLIC_PATHS
    body_timeout_s: float = BODY_TIMEOUT_S

    @classmethod
    def for_server(
        cls,
        host: str = "127.0.0.1",
        allowed_hosts: Iterable[str] = (),
        token: str | None = None,
        max_body_bytes: int = 4 * MiB,
        body_timeout_s: float = BODY_TIMEOUT_S,
    ) -> GuardPolicy:
        """Loopback names, the host the server binds to (unless a wildcard) and the names given."""
        names = {h.strip().lower() for h in (host, *allowed_hosts)} - WILDCARD_HOSTS
        if token is not None and not token.strip():
            raise ValueError("the bearer token is empty: give a non-empty token or none")
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes={max_body_bytes}: the body limit must be >= 1 byte")
        if not (math.isfinite(body_timeout_s) and body_timeout_s > 0):
            raise ValueError(
                f"body_timeout_s={body_timeout_s}: the body deadline must be a number of seconds > 0"
            )
        return cls(LOOPBACK_HOSTS | names, token, max_body_bytes, body_timeout_s=body_timeout_s)


@dataclass(frozen=True)
class Refusal:
    status: int
    message: str


def host_name(host: str) -> str:
    """'Example.org:8080' -> 'example.org', '[::1]:80' -> '[::1]'."""
    host = host.strip().lower()
    if host.startswith("["):
        return host.split("]", 1)[0] + "]"
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def check(policy: GuardPolicy, method: str, path: str, headers: Mapping[str, str]) -> Refusal | None:
    """Why this request is refused before any handler runs, or None. `headers`: lower-case names."""
    if policy.token is None:
        host = headers.get("host", "")
        if host_name(host) not in policy.allowed_hosts:
            return Refusal(
                421,
                f"Host {host!r} is not this service: without a token only {sorted(policy.allowed_hosts)} "
                "are accepted (configure a token, or add the name to the allowed hosts)",
            )
        origin = headers.get("origin")
        if origin is not None and _origin_host(origin) not in policy.allowed_hosts:
            return Refusal(403, f"requests from the web page origin {origin!r} are refused")
    elif path not in policy.public_paths:
        given = headers.get("authorization", "").encode("latin-1", "replace")
        if not hmac.compare_digest(given, f"Bearer {policy.token}".encode()):
            return Refusal(401, "missing or wrong bearer token (send 'Authorization: Bearer <token>')")
    media = headers.get("content-type", "").split(";")[0].strip().lower()
    if policy.token is None and method.upper() == "POST" and media != "application/json":
        return Refusal(
            415,
            "POST bodies must be sent as Content-Type: application/json (a web page can make a browser "
            "send any other type here without asking)",
        )
    declared = headers.get("content-length", "")
    if declared.isdigit() and int(declared) > policy.max_body_bytes:
        return body_too_large(policy)
    return None


def _origin_host(origin: str) -> str:
    """The host name of an Origin header ("" for "null" or one that is not a URL)."""
    try:
        return host_name(urlsplit(origin).netloc)
    except ValueError:
        return ""


def body_too_large(policy: GuardPolicy) -> Refusal:
    return Refusal(413, f"request body too large (limit {policy.max_body_bytes} bytes)")


def unguessable_id(prefix: str = "") -> str:
    """An id no web page or other client can guess: 128 random bits, URL-safe."""
    return prefix + secrets.token_urlsafe(16)


def body_too_slow(policy: GuardPolicy) -> Refusal:
    return Refusal(408, f"request body not received within {policy.body_timeout_s:g} s")


class BodyTooLarge(Exception):
    """Raised from the guarded `receive` once a body passes the limit; the guard answers 413."""


class BodyTooSlow(Exception):
    """Raised from the guarded `receive` when a body is not whole by its deadline; the guard answers 408.
    Not a TimeoutError, so an app's own timeout handling cannot take it for one of its own."""


def error_body(refusal: Refusal) -> dict:
    """{"error": message}: the sandbox service's and the viewer's error shape."""
    return {"error": refusal.message}


class HTTPGuard:
    """ASGI middleware: HTTP only; `check` on the headers, then the body counted and timed as the app
    reads it. `render` shapes a refusal's JSON body like the app's own errors."""

    def __init__(self, app: Any, policy: GuardPolicy, render: Callable[[Refusal], dict] = error_body) -> None:
        self.app, self.policy, self.render = app, policy, render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await self.app(scope, receive, send)
        if scope["type"] != "http":
            return await refuse_scope(scope, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        refusal = check(self.policy, scope.get("method", "GET"), scope.get("path", ""), headers)
        if refusal is not None:
            return await send_refusal(send, refusal, self.render)
        body = _GuardedBody(receive, self.policy, has_body(headers))
        started = False

        async def tracked(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, body.receive, tracked)
        except (BodyTooLarge, BodyTooSlow) as exc:
            if started:
                raise
            slow = isinstance(exc, BodyTooSlow)
            refusal = body_too_slow(self.policy) if slow else body_too_large(self.policy)
            await send_refusal(send, refusal, self.render, close=slow)


def has_body(headers: Mapping[str, str]) -> bool:
    """Whether a request announces a body (HTTP/1.1: a non-zero Content-Length, or Transfer-Encoding)."""
    return "transfer-encoding" in headers or headers.get("content-length", "0").strip() not in ("0", "")


class _GuardedBody:
    """The app's `receive`: bytes counted against the limit, and the body due whole by its deadline.
    Once the body is whole, messages pass untimed (what follows is a disconnect, whenever it comes)."""

    def __init__(self, receive: Receive, policy: GuardPolicy, pending: bool) -> None:
        self._receive, self.policy, self.pending, self.seen = receive, policy, pending, 0
        self.deadline = asyncio.get_running_loop().time() + policy.body_timeout_s

    async def receive(self) -> dict:
        if not self.pending:
            return await self._receive()
        try:
            async with asyncio.timeout_at(self.deadline):
                message = await self._receive()
        except TimeoutError:
            raise BodyTooSlow from None
        self.seen += len(message.get("body", b""))
        if self.seen > self.policy.max_body_bytes:
            raise BodyTooLarge
        self.pending = message["type"] == "http.request" and message.get("more_body", False)
        return message


async def refuse_scope(scope: Scope, send: Send) -> None:
    """Every ASGI scope but http and lifespan is refused: a websocket at its handshake (the server
    answers 403), anything else by raising (the server drops it)."""
    if scope["type"] == "websocket":
        reason = "tirl's servers speak HTTP only: websocket connections are refused"
        return await send({"type": "websocket.close", "code": 1008, "reason": reason})
    raise ValueError(f"ASGI scope type {scope['type']!r} refused: tirl's servers speak HTTP only")


async def send_refusal(
    send: Send, refusal: Refusal, render: Callable[[Refusal], dict] = error_body, close: bool = False
) -> None:
    """The refusal as a JSON answer, sent straight through ASGI; `close` ends the connection after it."""
    body = json.dumps(render(refusal)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def header_deadline_protocol(
    http: str = "auto", header_timeout_s: float = HEADER_TIMEOUT_S, max_header_bytes: int = MAX_HEADER_BYTES
) -> type:
    """uvicorn's HTTP protocol (`http`: a name of uvicorn's `--http`), closing a connection that does
    not send a request's headers whole within `header_timeout_s` of connecting or of the request's
    first byte, or sends more than `max_header_bytes` before they end (431). uvicorn has no deadline at all (an
    idle or dripping connection is held for ever), and its httptools parser no size limit (h11's is
    16 KiB)."""
    from uvicorn.config import HTTP_PROTOCOLS
    from uvicorn.importer import import_from_string

    base = import_from_string(HTTP_PROTOCOLS[http])
    text = f"request line and headers over {max_header_bytes} bytes\n".encode()
    too_large = (
        b"HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Type: text/plain\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(text), text)
    )

    class HeaderDeadline(base):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._header_bytes = self._raw_header_bytes = 0  # parsed, and raw while incomplete
            self._in_headers = False
            self._arm()  # a new connection owes its first request's headers at once

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # Idle between requests, uvicorn's keep-alive timeout rules (the endpoint's is long on
            # purpose); the next request's headers are due from its first byte on.
            self._armed, self._timer = self.cycle, None

        def data_received(self, data: bytes) -> None:
            if self._timer is None:
                self._arm()
            super().data_received(data)
            if self._in_headers:  # still arriving (dripped, or in large pieces): the raw bytes count
                self._raw_header_bytes += len(data)
                if self._raw_header_bytes > max_header_bytes and not self.transport.is_closing():
                    self._refuse_headers()

        # The size is counted between httptools' own callbacks, so that only a request's line and
        # headers count, never the rest of an earlier request's body still arriving (h11 has its own
        # limit and none of these callbacks).
        def on_message_begin(self) -> None:
            self._header_bytes = self._raw_header_bytes = 0
            self._in_headers = True
            super().on_message_begin()

        def on_url(self, url: bytes) -> None:
            self._header_bytes += len(url)
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._header_bytes += len(name) + len(value) + 4  # ": " and CRLF
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._in_headers = False
            if self._header_bytes > max_header_bytes:
                self._refuse_headers()
                raise ValueError("request headers too large")  # stops the parser: no app call
            super().on_headers_complete()

        def send_400_response(self, msg: str) -> None:
            if not self.transport.is_closing():  # not after this class's 431
                super().send_400_response(msg)

        def _refuse_headers(self) -> None:
            self.transport.write(too_large)
            self.transport.close()

        def _arm(self) -> None:
            self._armed = self.cycle
            self._timer = self.loop.call_later(header_timeout_s, self._expire, self.cycle)

        def _expire(self, cycle: Any) -> None:
            idle = cycle is None or cycle.response_complete  # not a pipelined request being answered
            if self.cycle is cycle and idle and not self.transport.is_closing():  # none started since
                self.transport.close()

    return HeaderDeadline


class DeadlineReader(io.RawIOBase):
    """A socket's reads for a stdlib HTTP server, all due by one deadline (each read waits at most the
    time left, then raises TimeoutError, which `BaseHTTPRequestHandler` answers by closing): a per-read
    socket timeout alone lets a client that sends a byte now and then hold its thread for ever."""

    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        super().__init__()
        self.sock, self.deadline = sock, time.monotonic() + timeout_s

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request was not received in time")
        self.sock.settimeout(left)
        return self.sock.recv_into(buffer)
