"""tirl.http_guard's rules on their own (each server's tests attack them over real HTTP: the endpoint in
tests/agent/test_endpoint_hostile.py and test_endpoint_browser.py, the sandbox service in
tests/sandbox, the viewer in tests/view/test_serve_guard.py), and its deadlines and scope rule
against real servers here: uvicorn on a free port with the guard in front of a small ASGI app, and
the viewer's stdlib server, attacked over raw sockets."""

from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import httpx
import pytest
import uvicorn
import websockets.exceptions
import websockets.sync.client

from tirl.http_guard import (
    GuardPolicy,
    HTTPGuard,
    check,
    header_deadline_protocol,
    host_name,
    unguessable_id,
)
from tirl.ports import free_port

JSON = {"content-type": "application/json"}


@pytest.mark.parametrize(
    ("host", "name"),
    [
        ("127.0.0.1:8080", "127.0.0.1"),
        ("LocalHost", "localhost"),
        ("[::1]:80", "[::1]"),
        ("[::1]", "[::1]"),
        ("example.org", "example.org"),
        ("", ""),
    ],
)
def test_host_name(host, name):
    assert host_name(host) == name


def test_without_a_token_the_host_must_name_this_machine():
    policy = GuardPolicy.for_server("0.0.0.0", ["box.lan"])
    assert policy.allowed_hosts >= {"localhost", "127.0.0.1", "[::1]", "box.lan"}
    assert "0.0.0.0" not in policy.allowed_hosts, "a wildcard bind address is no Host name"
    for host in ("127.0.0.1:9", "localhost", "[::1]:9", "BOX.lan:80"):
        assert check(policy, "GET", "/", {"host": host}) is None, host
    for host in ("attacker.example", "127.0.0.1.attacker.example", "", "localhost.:80"):
        refusal = check(policy, "GET", "/", {"host": host})
        assert refusal is not None and refusal.status == 421, host


def test_a_foreign_origin_is_refused_and_our_own_is_not():
    policy = GuardPolicy.for_server()
    base = {"host": "127.0.0.1:8000", **JSON}
    assert check(policy, "POST", "/x", {**base, "origin": "http://127.0.0.1:8000"}) is None
    for origin in ("http://attacker.example", "null", "http://rebind.test:8000", "http://[::1", ""):
        refusal = check(policy, "POST", "/x", {**base, "origin": origin})
        assert refusal is not None and refusal.status == 403, origin


@pytest.mark.parametrize(
    "media", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", ""]
)
def test_without_a_token_a_post_must_be_json(media):
    policy = GuardPolicy.for_server()
    refusal = check(policy, "POST", "/x", {"host": "localhost", "content-type": media})
    assert refusal is not None and refusal.status == 415
    assert (
        check(policy, "POST", "/x", {"host": "localhost", "content-type": "application/json; charset=utf-8"})
        is None
    )


def test_a_token_replaces_the_host_origin_and_media_rules_but_is_needed_everywhere_else():
    policy = GuardPolicy.for_server(token="t0k")
    assert "t0k" not in repr(policy)
    remote = {"host": "10.0.0.5:8000", "content-type": "text/plain"}
    assert check(policy, "POST", "/run", {**remote, "authorization": "Bearer t0k"}) is None
    for given in ("", "Bearer t0", "Bearer t0k ", "t0k", "Bearer \u00e9"):
        refusal = check(policy, "POST", "/run", {**remote, "authorization": given})
        assert refusal is not None and refusal.status == 401, given
    assert check(policy, "GET", "/health", remote) is None  # public
    with pytest.raises(ValueError, match="token is empty"):
        GuardPolicy.for_server(token=" ")


def test_a_declared_body_over_the_limit_is_refused_before_it_is_read():
    policy = GuardPolicy.for_server(max_body_bytes=100)
    headers = {"host": "localhost", **JSON}
    assert check(policy, "POST", "/x", {**headers, "content-length": "100"}) is None
    refusal = check(policy, "POST", "/x", {**headers, "content-length": "101"})
    assert refusal is not None and refusal.status == 413 and "limit 100 bytes" in refusal.message


def test_ids_are_unguessable():
    ids = {unguessable_id("t-") for _ in range(1000)}
    assert len(ids) == 1000 and all(i.startswith("t-") and len(i) == 2 + 22 for i in ids)


def test_the_body_deadline_must_be_a_positive_number_of_seconds():
    assert GuardPolicy.for_server().body_timeout_s == 30.0
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="body_timeout_s"):
            GuardPolicy.for_server(body_timeout_s=bad)


# The guard against real servers. The app reads a body and answers its length; /late waits on the
# connection (as the endpoint's disconnect watch does) well past the body deadline before answering.
HEADERS = b"Host: 127.0.0.1\r\nContent-Type: application/json\r\n"
GET = b"GET /echo HTTP/1.1\r\n" + HEADERS + b"\r\n"


async def echo(scope: dict, receive, send) -> None:
    if scope["type"] == "websocket":  # what a websocket route added later would do, were it unguarded
        await receive()
        await send({"type": "websocket.accept"})
        await send({"type": "websocket.send", "text": "open"})
        await receive()
        return
    if scope["type"] != "http":
        return
    size, more = 0, True
    while more:
        message = await receive()
        size, more = size + len(message.get("body", b"")), message.get("more_body", False)
    if scope["path"] == "/late":
        with suppress(TimeoutError):
            await asyncio.wait_for(receive(), 1.5)
    body = json.dumps({"bytes": size}).encode()
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]}
    )
    await send({"type": "http.response.body", "body": body})


@contextmanager
def served(app, **config) -> Iterator[int]:
    """`app` under uvicorn on a free loopback port, on its own thread; yields the port."""
    port = free_port()
    options = {"log_level": "warning", "lifespan": "off", "timeout_graceful_shutdown": 5, **config}
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, **options))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(30)


def until_closed(conn: socket.socket, within_s: float = 30.0) -> bytes:
    """Everything the server sends until it closes the connection (a socket timeout if it never does)."""
    conn.settimeout(within_s)
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    return data


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_a_stalled_body_gets_408_and_a_closed_connection_while_others_are_answered(http):
    policy = GuardPolicy.for_server(body_timeout_s=1.0)
    with served(HTTPGuard(echo, policy), http=header_deadline_protocol(http)) as port:
        with socket.create_connection(("127.0.0.1", port)) as slow:
            start = time.monotonic()
            slow.sendall(b"POST /echo HTTP/1.1\r\n" + HEADERS + b"Content-Length: 1000\r\n\r\n[1, 2")
            normal = httpx.post(
                f"http://127.0.0.1:{port}/echo", content=b"[1, 2, 3]", headers=JSON, timeout=30
            )
            assert normal.status_code == 200 and normal.json() == {"bytes": 9}
            answer = until_closed(slow)  # the socket times out if the server keeps the connection
            waited = time.monotonic() - start
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert b"request body not received within 1 s" in answer and b"connection: close" in answer.lower()
        assert 0.9 < waited < 25, waited
        # the deadline is for the body: a request whose body came whole may be answered much later
        late = httpx.post(f"http://127.0.0.1:{port}/late", json=[1], timeout=30)
        assert late.status_code == 200 and late.json() == {"bytes": 3}


def drip_until_closed(port: int, first: bytes = b"", seconds: float = 20.0) -> float | None:
    """Headers sent a byte every 0.2 s, never finished (after the whole request `first`, if given):
    how long until the server closed the connection (None: it was still open after `seconds`)."""
    with socket.create_connection(("127.0.0.1", port)) as conn:
        start = time.monotonic()
        conn.sendall(first + b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        while time.monotonic() - start < seconds:
            try:
                if select.select([conn], [], [], 0.2)[0] and not conn.recv(65536):
                    return time.monotonic() - start
                conn.sendall(b"a")
            except OSError:  # reset by the server
                return time.monotonic() - start
    return None


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_headers_that_never_end_are_cut_off_by_their_deadline(http):
    """uvicorn alone holds a connection whose headers trickle in for ever; the guard's protocol closes it."""
    protocol = header_deadline_protocol(http, header_timeout_s=1.0)
    with served(HTTPGuard(echo, GuardPolicy.for_server()), http=protocol) as port:
        closed_after = drip_until_closed(port)
        assert closed_after is not None and closed_after > 0.9, closed_after
        # a kept-alive connection: the same deadline for its next request's headers
        closed_after = drip_until_closed(port, first=GET)
        assert closed_after is not None and closed_after > 0.9, closed_after


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_an_idle_kept_alive_connection_is_left_to_the_keep_alive_timeout(http):
    """Between requests a connection idles as long as uvicorn's keep-alive allows (the endpoint's is
    75 s, longer than its clients', so that the server does not close one a client is reusing)."""
    protocol = header_deadline_protocol(http, header_timeout_s=1.0)
    app = HTTPGuard(echo, GuardPolicy.for_server())
    with (
        served(app, http=protocol, timeout_keep_alive=60) as port,
        socket.create_connection(("127.0.0.1", port)) as conn,
    ):
        conn.settimeout(30)
        for _ in range(2):
            conn.sendall(GET)
            answer = b""
            while not answer.endswith(b'{"bytes": 0}') and (chunk := conn.recv(65536)):
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200 "), answer
            time.sleep(2.5)  # idle past the header deadline


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_a_pipelined_request_is_not_cut_off_while_it_is_answered(http):
    """The second of two pipelined requests starts when the first is answered, its headers long
    received: the header deadline must not close the connection while the app works on it."""
    protocol = header_deadline_protocol(http, header_timeout_s=1.0)
    request = b"POST /late HTTP/1.1\r\n" + HEADERS + b"Content-Length: 2\r\n\r\n[]"
    with served(HTTPGuard(echo, GuardPolicy.for_server()), http=protocol) as port:
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.sendall(request + request)  # each is answered 1.5 s after its body
            conn.settimeout(30)
            answers = b""
            while answers.count(b'{"bytes": 2}') < 2 and (chunk := conn.recv(65536)):
                answers += chunk
        assert answers.count(b"HTTP/1.1 200 ") == 2, answers


def test_headers_over_the_size_limit_are_refused_and_large_bodies_are_not():
    """httptools, uvicorn's default parser, reads headers of any size (h11 stops at 16 KiB)."""
    protocol = header_deadline_protocol("httptools", max_header_bytes=4096)
    with served(HTTPGuard(echo, GuardPolicy.for_server()), http=protocol) as port:
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.sendall(b"GET /echo HTTP/1.1\r\n" + HEADERS + b"X-Big: " + b"a" * 8192 + b"\r\n")
            answer = until_closed(conn)  # the headers have not ended: without a limit, it waits
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
        assert b"request line and headers over 4096 bytes" in answer
        with socket.create_connection(("127.0.0.1", port)) as conn:  # whole, in one piece: no app call
            conn.sendall(b"GET /echo HTTP/1.1\r\n" + HEADERS + b"X-Big: " + b"a" * 8192 + b"\r\n\r\n")
            answer = until_closed(conn)
        assert answer.startswith(b"HTTP/1.1 431 ") and answer.count(b"HTTP/1.1") == 1, answer[:200]
        big = b"[" + b"1," * (1 << 20) + b"1]"  # 2 MiB: the limit is for headers only, per request
        headers = {**JSON, "X-Pad": "p" * 3000}
        with httpx.Client(timeout=30) as client:
            for _ in range(2):
                response = client.post(f"http://127.0.0.1:{port}/echo", content=big, headers=headers)
                assert response.status_code == 200 and response.json() == {"bytes": len(big)}


@pytest.mark.parametrize("token", [None, "t0k"])
def test_a_websocket_handshake_is_refused_with_403(token):
    """The app behind the guard would accept a websocket; the guard refuses it, token or not."""
    policy = GuardPolicy.for_server(token=token)
    headers = {"Authorization": f"Bearer {token}"} if token else None
    url = "ws://127.0.0.1:{}/ws"
    with (
        served(HTTPGuard(echo, policy)) as port,
        pytest.raises(websockets.exceptions.InvalidStatus) as refused,
    ):
        websockets.sync.client.connect(url.format(port), additional_headers=headers, open_timeout=30)
    assert refused.value.response.status_code == 403


def test_other_scopes_are_refused_and_lifespan_passes():
    seen = []

    async def app(scope, receive, send) -> None:
        seen.append(scope["type"])

    async def nothing() -> dict:
        return {}

    async def discard(message: dict) -> None:
        pass

    guard = HTTPGuard(app, GuardPolicy.for_server())
    asyncio.run(guard({"type": "lifespan"}, nothing, discard))
    with pytest.raises(ValueError, match="'webtransport' refused: tirl's servers speak HTTP only"):
        asyncio.run(guard({"type": "webtransport"}, nothing, discard))
    assert seen == ["lifespan"]


def test_the_viewer_cuts_off_headers_that_never_end(tmp_path, monkeypatch):
    """`tirl view --serve` (a stdlib server, a thread per connection): a per-read timeout would let a
    byte now and then hold the thread for ever; the whole request line and headers have one deadline."""
    from tirl.view import serve

    monkeypatch.setattr(serve, "HEADER_TIMEOUT_S", 1.0)
    page = tmp_path / "page.html"
    page.write_text("<p>runs</p>")
    server = serve.make_server(page, port=0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        closed_after = drip_until_closed(port)
        assert closed_after is not None and closed_after > 0.9, closed_after
        response = httpx.get(f"http://127.0.0.1:{port}/", timeout=30)
        assert response.status_code == 200 and response.text == "<p>runs</p>"
    finally:
        server.shutdown()
        server.server_close()
