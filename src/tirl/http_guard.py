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

Ids a caller must not guess (trajectories, sessions) come from `unguessable_id` (the secrets module).
"""

from __future__ import annotations

import hmac
import json
import secrets
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})  # bind addresses, never a Host a client sends
PUBLIC_PATHS = frozenset({"/health"})
MiB = 1 << 20

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

    @classmethod
    def for_server(
        cls,
        host: str = "127.0.0.1",
        allowed_hosts: Iterable[str] = (),
        token: str | None = None,
        max_body_bytes: int = 4 * MiB,
    ) -> GuardPolicy:
        """Loopback names, the host the server binds to (unless a wildcard) and the names given."""
        names = {h.strip().lower() for h in (host, *allowed_hosts)} - WILDCARD_HOSTS
        if token is not None and not token.strip():
            raise ValueError("the bearer token is empty: give a non-empty token or none")
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes={max_body_bytes}: the body limit must be >= 1 byte")
        return cls(LOOPBACK_HOSTS | names, token, max_body_bytes)


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


class BodyTooLarge(Exception):
    """Raised from the counted `receive` once a body passes the limit; the guard answers 413."""


def error_body(refusal: Refusal) -> dict:
    """{"error": message}: the sandbox service's and the viewer's error shape."""
    return {"error": refusal.message}


class HTTPGuard:
    """ASGI middleware: `check` on the headers, then the body counted as the app reads it.
    `render` shapes a refusal's JSON body like the app's own errors."""

    def __init__(self, app: Any, policy: GuardPolicy, render: Callable[[Refusal], dict] = error_body) -> None:
        self.app, self.policy, self.render = app, policy, render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        refusal = check(self.policy, scope.get("method", "GET"), scope.get("path", ""), headers)
        if refusal is not None:
            return await send_refusal(send, refusal, self.render)
        seen = 0
        started = False

        async def counted() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.policy.max_body_bytes:
                raise BodyTooLarge
            return message

        async def tracked(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except BodyTooLarge:
            if started:
                raise
            await send_refusal(send, body_too_large(self.policy), self.render)


async def send_refusal(send: Send, refusal: Refusal, render: Callable[[Refusal], dict] = error_body) -> None:
    """The refusal as a JSON answer, sent straight through ASGI."""
    body = json.dumps(render(refusal)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
