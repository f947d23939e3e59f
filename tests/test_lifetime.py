"""A tirl command's children die with it, even under SIGKILL, and Ctrl-C stops a command cleanly, saying
how to continue (real commands in subprocesses: the sandbox service, vLLM's engine core, the trainer)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from tests.terminal import foreground, tirl_argv, tirl_env
from tests.tied import tied
from tests.train_config import write_train_config


def descendants(pid: int) -> dict[int, str]:
    """Live descendants of `pid`: pid -> command line."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if fields[0] != "Z":
                parents[int(entry.name)] = int(fields[1])
    found, frontier = {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent and child not in found:
                try:
                    found[child] = (
                        (Path("/proc") / str(child) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                    )
                except OSError:
                    continue
                frontier.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Output:
    """Collects a process's merged output on a thread; `wait_for` blocks until a text appears (woken by
    each chunk read, not by polling), `drain` until the output ends."""

    def __init__(self, proc: subprocess.Popen):
        self.text, self.proc, self.ended = "", proc, False
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for chunk in iter(lambda: self.proc.stdout.read1(4096), b""):
            with self._changed:
                self.text += chunk.decode(errors="replace")
                self._changed.notify_all()
        with self._changed:
            self.ended = True
            self._changed.notify_all()

    def wait_for(self, text: str, timeout: float = 600) -> None:
        """Until `text` is printed; fails if the output ends without it (timeout: a hang guard only)."""
        with self._changed:
            self._changed.wait_for(lambda: text in self.text or self.ended, timeout)
            assert text in self.text, f"never printed {text!r}:\n{self.text[-3000:]}"

    def drain(self, timeout: float = 120) -> str:
        """Everything the process printed: waits for the end of its output (EOF), not for a time."""
        self._reader.join(timeout)
        assert self.ended, f"the output never ended (a child still holds it):\n{self.text[-3000:]}"
        return self.text


@pytest.mark.parametrize(
    "engine",
    [
        "hf",
        pytest.param(
            "vllm",
            marks=[
                pytest.mark.vllm,
                pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
            ],
        ),
    ],
)
@pytest.mark.timeout(900)  # vLLM's engine takes minutes to start on a busy 2-core machine
def test_kill_9_of_a_command_takes_its_children_along(tiny_model_dir, engine):
    """`tirl chat` starts a sandbox service (an exec'd tirl process) and, on vLLM, an engine core (a
    forked process); SIGKILL of chat alone leaves neither behind."""
    argv = tirl_argv("chat", "--model", str(tiny_model_dir), "--engine", engine)
    proc = subprocess.Popen(
        tied([*argv, "--max-tokens", "16"]),
        env=tirl_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        Output(proc).wait_for("problem>")
        children = descendants(proc.pid)
        assert any("sandbox serve" in cmd for cmd in children.values()), children
        if engine == "vllm":
            assert any("sandbox serve" not in cmd for cmd in children.values()), children  # the engine core
        proc.kill()  # SIGKILL to chat alone, not to its process group
        proc.wait()
        deadline = time.monotonic() + 60
        while left := {pid: cmd for pid, cmd in children.items() if alive(pid)}:
            assert time.monotonic() < deadline, f"still running after their parent was killed: {left}"
            time.sleep(0.1)
    finally:
        with contextlib.suppress(ProcessLookupError):  # whatever the test left (nothing, when it passes)
            os.killpg(proc.pid, signal.SIGKILL)


VLLM = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]
# What only third-party code prints: a tirl command shows none of it unless run with --verbose.
FOREIGN = ("Traceback", "EngineDead", "leaked", "WARNING", "Warning:", "Loading safetensors", "Triton")


@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=VLLM)])
@pytest.mark.timeout(900)  # vLLM's engine takes minutes to start on a busy 2-core machine
def test_ctrl_c_stops_training_and_says_how_to_resume(tiny_model_dir, tmp_path, engine):
    """One Ctrl-C: the run stops (vLLM's engine core, which vLLM spawns on CPU, does not take the
    terminal's SIGINT and die first), its checkpoint is there, the resume command is printed, and
    nothing else: no traceback, no library warning, no leaked-resource report."""
    config = write_train_config(
        tmp_path,
        tiny_model_dir,
        steps=1000,
        engine={"backend": engine, "device": "cpu", "max_model_len": 1024, "kv_cache_gb": 0.1},
    )
    argv = tirl_argv("train", "--config", str(config), "seed=3")
    proc = subprocess.Popen(
        foreground(argv),
        env=tirl_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    output = Output(proc)
    try:
        output.wait_for("step 2 ")
        sockets = list(Path(tempfile.gettempdir()).glob(f"tirl-vllm-{proc.pid}-*/*"))  # vLLM's ZMQ files
        assert bool(sockets) == (engine == "vllm"), sockets
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal sends to its foreground group on Ctrl-C
        assert proc.wait(timeout=120) == 130, output.text[-3000:]  # at once, not after a hang
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
    output.drain()
    foreign = [line for line in output.text.splitlines() if any(f in line for f in FOREIGN)]
    assert not foreign, output.text[-3000:]
    expected = f"continue with: {shlex.join(argv)} --resume"  # the tirl that ran: it runs as printed
    assert expected in output.text and "is saved at step_00000" in output.text, output.text[-3000:]
    assert not any(p.exists() for p in sockets), "vLLM's socket files outlived the command"


def test_ctrl_c_in_eval_keeps_the_finished_trajectories(tiny_model_dir, tmp_path):
    data = tmp_path / "problems.jsonl"
    data.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "problem": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
            for i in range(8)
        )
    )
    out = tmp_path / "eval"
    argv = tirl_argv(
        "eval",
        "--model",
        str(tiny_model_dir),
        "--data",
        str(data),
        "--samples",
        "16",
        "--max-tokens",
        "48",
        "--max-turns",
        "2",
        "--out",
        str(out),
        "--reward-workers",
        "1",
    )
    proc = subprocess.Popen(
        foreground(argv),
        env=tirl_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    output = Output(proc)
    try:
        output.wait_for("eval: 13/128 trajectories")  # a progress line: the output is not a terminal
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=300) == 130, output.text[-3000:]
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
    output.drain()
    assert "Traceback" not in output.text, output.text[-3000:]
    kept = (out / "trajectories.partial.jsonl").read_text().splitlines()
    assert f"interrupted: {len(kept)} of 128 trajectories had finished" in output.text, output.text[-3000:]
    assert 13 <= len(kept) < 128 and all(json.loads(line)["response_ids"] for line in kept)


@pytest.mark.parametrize("group", [False, True])
def test_stop_child_kills_what_ignores_sigterm_after_the_grace_period(group: bool) -> None:
    """A child that ignores SIGTERM is killed once the grace period is out; with `group`, the worker it
    started goes too (an inference server's workers), and without it the worker is left alone."""
    from tirl.lifetime import stop_child

    code = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "w = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'])\n"
        "print(w.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen(
        tied([sys.executable, "-c", code]), stdout=subprocess.PIPE, text=True, process_group=0
    )
    worker = int(proc.stdout.readline())
    start = time.monotonic()
    try:
        stop_child(proc, 0.5, group=group)
        assert proc.returncode == -signal.SIGKILL and time.monotonic() - start >= 0.5
        deadline = time.monotonic() + 10
        while group and _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.05)  # killed with the group; reaped by init once its parent is gone
        assert _alive(worker) is not group
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)
        proc.stdout.close()


def test_stop_child_of_an_exited_child_only_reaps_it() -> None:
    from tirl.lifetime import stop_child

    proc = subprocess.Popen(tied([sys.executable, "-c", "pass"]), process_group=0)
    while not os.path.exists(f"/proc/{proc.pid}/stat") or _state(proc.pid) != "Z":
        time.sleep(0.01)
    stop_child(proc, 5, group=True)  # exited before the call: reaped, no signal to a gone group
    assert proc.returncode == 0


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _alive(pid: int) -> bool:
    """Running or stopped, not a zombie waiting for its reaper."""
    try:
        return _state(pid) != "Z"
    except FileNotFoundError:
        return False
