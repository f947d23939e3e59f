"""`tirl view --serve`: the written HTML file on localhost, for a browser on the same machine
(or through an SSH tunnel). It serves that one file and nothing else of the file system, to
requests that pass tirl's HTTP guard (tirl/http_guard.py): a Host header naming this machine (the
loopback names, the host it binds to, the names given in `allowed_hosts`) and no foreign Origin, so a
DNS-rebinding page cannot read the trajectories the page shows."""

from __future__ import annotations

import errno
import io
import json
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tirl.http_guard import HEADER_TIMEOUT_S, DeadlineReader, GuardPolicy, check


def make_server(
    page: Path, host: str = "127.0.0.1", port: int = 8765, allowed_hosts: Iterable[str] = ()
) -> ThreadingHTTPServer:
    body = Path(page).read_bytes()
    policy = GuardPolicy.for_server(host, allowed_hosts)

    class Handler(BaseHTTPRequestHandler):
        def setup(self) -> None:
            super().setup()  # a request's line and headers are due whole in HEADER_TIMEOUT_S (slowloris);
            self.rfile.close()  # its body is never read, and each connection serves one request (HTTP/1.0)
            self.rfile = io.BufferedReader(DeadlineReader(self.connection, HEADER_TIMEOUT_S))

        def do_GET(self) -> None:
            self.connection.settimeout(None)  # the deadline was for reading; the answer is written whole
            headers = {k.lower(): v for k, v in self.headers.items()}
            if (refusal := check(policy, "GET", self.path, headers)) is not None:
                answer = json.dumps({"error": refusal.message}).encode()
                self.send_response(refusal.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)
                return
            if self.path.split("?", 1)[0] not in ("/", "/index.html", f"/{Path(page).name}"):
                self.send_error(404, "only the viewer page is served here: open /")
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # quiet: the terminal shows the URL, not every request
            pass

    try:
        return ThreadingHTTPServer((host, port), Handler)
    except OSError as e:  # one line saying what to change, like tirl's other errors
        from tirl.view.records import ViewError

        busy = e.errno == errno.EADDRINUSE
        raise ViewError(
            f"--host {host} --port {port}: "
            + (
                "the port is in use: choose another --port (0 picks a free one)"
                if busy
                else f"cannot serve there ({e.strerror})"
            )
        ) from None


def serve(
    page: Path, host: str, port: int, announce: Callable[[str], None], allowed_hosts: Iterable[str] = ()
) -> None:
    """Serve until Ctrl-C; `announce` gets the URL once the socket is bound (port 0 picks a free one)."""
    server = make_server(page, host, port, allowed_hosts)
    announce(f"http://{host}:{server.server_address[1]}/")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
