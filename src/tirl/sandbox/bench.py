"""Speed of tirl's service (through HTTP) vs a process per call, side by side in one run.

The baseline is what code-judge and SandboxFusion do: write the code to a file and run
`python file.py` per call. Both run the same workloads at the same concurrency levels on the
same machine, so the ratio is meaningful even on a noisy shared machine. The CPU time per call of
each side (every process involved, summed) is the steadier ratio under load: once the cores are
busy, it is what bounds throughput.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from tirl.sandbox.client import SandboxClient
from tirl.sandbox.result import ExecResult, Status
from tirl.sandbox.service import SandboxConfig, open_executor

WORKLOADS = {
    "trivial print": "print(sum(range(10)))",
    "numpy cell": "import numpy as np\na = np.arange(1, 2501, dtype=float).reshape(50, 50) % 7\nprint(int(np.linalg.matrix_rank(a @ a.T)))",
    "sympy cell": "import sympy as sp\nx = sp.symbols('x')\nprint(sp.solve(x**2 - 5*x + 6, x), sp.expand((x + 2)**4))",
    "session print": "print(sum(range(10)))",  # a cell of a persistent session (one per worker)
}  # fmt: skip
SESSION_PREFIX = "session"


@dataclass
class Measured:
    calls: int
    seconds: float
    latencies: list[float]
    failures: int
    cpu_ms: float = 0.0  # CPU per call, every process involved: what bounds throughput on a busy machine

    @property
    def rate(self) -> float:
        return self.calls / self.seconds

    def pct(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


async def measure(
    run: Callable[[str], Awaitable[ExecResult]], code: str, calls: int, concurrency: int
) -> Measured:
    latencies: list[float] = []
    failures = 0
    todo = iter(range(calls))

    async def worker() -> None:
        nonlocal failures
        for _ in todo:
            t = time.perf_counter()
            r = await run(code)
            latencies.append(time.perf_counter() - t)
            failures += r.status != Status.OK

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return Measured(calls, time.perf_counter() - start, latencies, failures)


async def process_per_call(code: str, timeout: float = 60.0) -> ExecResult:
    """The baseline: a fresh interpreter per call, code in a script file."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(code)
    start = time.perf_counter()
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, f.name, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    finally:
        os.unlink(f.name)
    status = Status.OK if proc.returncode == 0 else Status.RUNTIME_ERROR
    return ExecResult(
        status, out.decode(), err.decode(), proc.returncode, (time.perf_counter() - start) * 1000
    )


async def service_health(url: str, token: str | None) -> dict:
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {token}"} if token else {}) as http:
        return (await http.get(f"{url}/health")).json()


def _cpu_s(pid: int) -> tuple[float, float]:
    """(CPU seconds of the process itself, of its reaped children) from /proc/<pid>/stat."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0.0
    hz = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / hz, (int(fields[13]) + int(fields[14])) / hz


def _children(pid: int) -> list[int]:
    try:
        return [
            int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()
        ]
    except OSError:
        return []


def cpu_by_part(service_pid: int) -> dict[str, float]:
    """CPU seconds so far of each part of the service: where a call's milliseconds go.

    service: HTTP + pool (asyncio); supervisors: moving bytes, watching, classifying; fork servers:
    forking and reaping; calls: every call process (confinement, the code, exit), counted when reaped;
    session processes: the live interpreters of persistent sessions (their cells and their children).
    """
    zygotes = [z for z in _children(service_pid) if b"tirl.sandbox.zygote" in _cmdline(z)]
    servers = [f for z in zygotes for f in _children(z) if _uid(f) == _uid(z)]  # a call runs as a sandbox uid
    parts = {
        "service (HTTP + pool)": _cpu_s(service_pid)[0],
        "supervisors": sum(_cpu_s(z)[0] for z in zygotes),
        "fork servers": sum(_cpu_s(f)[0] for f in servers),
        # reaped by the fork servers (by the zygotes themselves in a layout without fork servers)
        "call processes": sum(_cpu_s(p)[1] for p in (*servers, *zygotes)),
        # a persistent session's interpreter lives on between cells: read while alive, never reaped
        "session processes": sum(sum(_cpu_s(c)) for f in servers for c in _children(f)),
    }
    parts["client (this process)"] = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
    return parts


def _uid(pid: int) -> int | None:
    try:  # the real uid (/proc/<pid> itself is root's once a process is no longer dumpable)
        status = Path(f"/proc/{pid}/status").read_text()
        return int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
    except (OSError, StopIteration, ValueError):
        return None


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


async def run_bench(
    calls: int, levels: list[int], slots: int | None, rss_calls: int, workloads: list[str] | None = None
) -> str:
    cfg = SandboxConfig(mode="local", slots=slots, timeout_s=30, concurrency=max(levels) * 2)
    rows, split = [], []
    async with open_executor(cfg) as client:
        await client.run_batch([{"code": c} for c in WORKLOADS.values()] * 4)  # first connections, page cache
        service_pid = (await service_health(client.endpoints[0], client.token))["service_pid"]
        for name, code in WORKLOADS.items():
            if workloads and not any(w in name for w in workloads):
                continue
            base_calls = max(16, calls // (3 if "print" in name else 8))
            for c in levels:
                async with _runner(client, name, c) as run:
                    before = cpu_by_part(service_pid)
                    ours = await measure(run, code, calls, c)
                    after = cpu_by_part(service_pid)
                split.append((name, c, {k: (after[k] - before[k]) * 1000 / calls for k in after}))
                ours.cpu_ms = sum(split[-1][2].values())
                children = _children_cpu_s()
                theirs = await measure(process_per_call, code, base_calls, c)
                theirs.cpu_ms = (_children_cpu_s() - children) * 1000 / base_calls
                rows.append((name, c, ours, theirs))
                print(
                    f"  {name} @ {c}: tirl {ours.rate:.0f}/s, baseline {theirs.rate:.1f}/s", file=sys.stderr
                )
        rss = ""
        if rss_calls:
            url = client.endpoints[0]
            before = (await service_health(url, client.token))["service_rss_mb"]
            m = await measure(client.run, WORKLOADS["trivial print"], rss_calls, max(levels))
            after = (await service_health(url, client.token))["service_rss_mb"]
            rss = (
                f"\nService RSS: {before:.1f} MiB before, {after:.1f} MiB after {rss_calls} more calls "
                f"({m.rate:.0f} calls/s, {m.failures} failed)."
            )
    return table(rows) + "\n\nCPU per call, by part (ms):\n" + cpu_table(split) + rss


@contextlib.asynccontextmanager
async def _runner(
    client: SandboxClient, name: str, concurrency: int
) -> AsyncIterator[Callable[[str], Awaitable[ExecResult]]]:
    """How the workload runs its calls: stateless, or as cells of one live session per worker."""
    if not name.startswith(SESSION_PREFIX):
        yield client.run
        return
    sessions: asyncio.Queue = asyncio.Queue()
    for _ in range(concurrency):
        sessions.put_nowait(await client.open_session())

    async def run(code: str) -> ExecResult:
        session = await sessions.get()
        try:
            return await session.run(code)
        finally:
            sessions.put_nowait(session)

    try:
        yield run
    finally:
        while not sessions.empty():
            await sessions.get_nowait().aclose()


def _children_cpu_s() -> float:
    """CPU seconds of this process's reaped children (the baseline's interpreters)."""
    return sum(resource.getrusage(resource.RUSAGE_CHILDREN)[:2])


def cpu_table(split: list[tuple[str, int, dict[str, float]]]) -> str:
    parts = list(split[0][2]) if split else []
    out = [
        "| workload | concurrency | " + " | ".join(parts) + " | total |",
        "|---|---:|" + "---:|" * (len(parts) + 1),
    ]
    for name, c, ms in split:
        out.append(
            f"| {name} | {c} | " + " | ".join(f"{ms[p]:.2f}" for p in parts) + f" | {sum(ms.values()):.2f} |"
        )
    return "\n".join(out)


def table(rows: list[tuple[str, int, Measured, Measured]]) -> str:
    out = [
        "| workload | concurrency | tirl calls/s | tirl p50 ms | tirl p99 ms | per-call python calls/s | p50 ms | p99 ms "
        "| speed-up | CPU ms per call, tirl | python | CPU ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, c, ours, theirs in rows:
        fail = f" ({ours.failures} failed)" if ours.failures else ""
        out.append(
            f"| {name} | {c} | {ours.rate:.0f}{fail} | {ours.pct(0.5):.1f} | {ours.pct(0.99):.1f} | "
            f"{theirs.rate:.1f} | {theirs.pct(0.5):.0f} | {theirs.pct(0.99):.0f} | {ours.rate / theirs.rate:.1f}x | "
            f"{ours.cpu_ms:.1f} | {theirs.cpu_ms:.1f} | {theirs.cpu_ms / max(ours.cpu_ms, 1e-9):.1f}x |"
        )
    return "\n".join(out)


def main(
    calls: int = 300,
    levels: list[int] | None = None,
    slots: int | None = None,
    rss_calls: int = 5000,
    workloads: list[str] | None = None,
) -> None:
    """`workloads`: run only those whose name contains one of these words (e.g. ["trivial"])."""
    unknown = [w for w in workloads or [] if not any(w in name for name in WORKLOADS)]
    if unknown:
        raise SystemExit(f"unknown workload {unknown}: choose among {list(WORKLOADS)}")
    print(f"tirl sandbox bench: {os.cpu_count()} cores, {calls} calls per cell", file=sys.stderr)
    print(asyncio.run(run_bench(calls, levels or [1, 4, 32], slots, rss_calls, workloads)))
