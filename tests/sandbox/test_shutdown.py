"""Ctrl-C on `tirl sandbox serve`: calls that finish in the grace period are answered, the rest get a
clear 503 (retried elsewhere by SandboxClient), never a 500 with a traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import httpx
from tests.terminal import foreground, tirl_argv

from tirl.ports import free_port
from tirl.sandbox.server import STOPPED


def test_ctrl_c_answers_inflight_calls_with_503_not_500():
    port = free_port()
    proc = subprocess.Popen(
        foreground(tirl_argv("sandbox", "serve", "--port", str(port), "--slots", "2")),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert "listening on" in proc.stdout.readline()
        url = f"http://127.0.0.1:{port}/run"
        quick = httpx.post(url, json={"code": "print(6 * 7)"}, timeout=60)
        assert quick.status_code == 200 and quick.json()["stdout"] == "42\n"
        answers: list[httpx.Response] = []
        started = threading.Event()

        def long_call() -> None:
            started.set()
            answers.append(
                httpx.post(url, json={"code": "import time; time.sleep(60)", "timeout": 90}, timeout=120)
            )

        caller = threading.Thread(target=long_call)
        caller.start()
        started.wait()
        # the call is in flight once the service reports a busy slot (the deadline only stops a hang)
        deadline = time.monotonic() + 120
        while httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).json()["busy"] < 1:
            assert time.monotonic() < deadline, "the long call never started"
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends to the whole group
        caller.join(timeout=120)
        assert len(answers) == 1
        assert answers[0].status_code == 503 and answers[0].json() == {"error": STOPPED}
        assert proc.wait(timeout=60) is not None
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
