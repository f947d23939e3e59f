"""Verification off the training loop's critical path: worker processes with a hard per-call timeout.

Each worker (tirl.reward.worker) is a subprocess that imported math-verify once and checks one
(answer, reference) pair at a time. The event loop awaits the workers' pipes, so thousands of responses
are scored while rollouts go on. A worker interrupts Python-level work itself shortly before the
deadline (SIGALRM works there: verification runs in the worker's main thread); work stuck in C code
cannot be interrupted that way, so past the deadline the worker is SIGKILLed and a fresh one is started
in the background. A timeout scores 0 and is counted.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

import tirl
from tirl.reward.extract import extract_answer
from tirl.reward.verify import quick_verdict

SOFT_DEADLINE_FRACTION = 0.8  # the worker gives up itself at 80% of the hard timeout


class RewardConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    workers: int = Field(default_factory=lambda: min(4, os.cpu_count() or 1), ge=1)
    timeout: float = Field(5.0, gt=0)  # hard limit per verification (s): past it the worker is killed
    soft_timeout: bool = True  # let the worker interrupt Python-level work first (no restart needed)
    memory_mb: int | None = Field(4096, ge=256)  # address-space limit per worker (sympy can explode)
    start_timeout: float = Field(120.0, gt=0)  # a worker must have imported math-verify within this


@dataclass
class RewardStats:
    responses: int = 0  # responses scored
    no_answer: int = 0  # no boxed answer found: 0 without verification
    fast: int = 0  # decided without math-verify (both sides plain integers)
    verified: int = 0  # sent to a worker
    timeouts: int = 0  # verifications past their deadline (scored 0), killed or not
    killed: int = 0  # workers killed because they did not answer by the hard deadline
    errors: int = 0  # verification raised (e.g. MemoryError) or a worker died: scored 0
    verify_s: float = 0.0  # total wall time of the verifications sent to workers (queueing included)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


class WorkerDied(RuntimeError):
    pass


class _Worker:
    def __init__(self, process: asyncio.subprocess.Process):
        self.process = process

    @classmethod
    async def spawn(cls, cfg: RewardConfig) -> _Worker:
        soft = cfg.timeout * SOFT_DEADLINE_FRACTION if cfg.soft_timeout else 0.0
        env = dict(os.environ)
        src = str(Path(tirl.__file__).resolve().parent.parent)  # works for source checkouts, too
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
        process = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "tirl.reward.worker", "--soft-timeout", str(soft)),
            *("--memory-mb", str(cfg.memory_mb or 0)),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
        )
        return cls(process)

    async def receive(self, timeout: float) -> dict:
        """The worker's next reply; TimeoutError if none within `timeout`, WorkerDied if it exited."""
        line = await asyncio.wait_for(self.process.stdout.readline(), timeout)
        if not line:
            raise WorkerDied(f"reward worker exited with code {await self.process.wait()}")
        return json.loads(line)

    async def ask(self, answer: str, reference: str, timeout: float) -> dict:
        self.process.stdin.write((json.dumps([answer, reference]) + "\n").encode())
        await self.process.stdin.drain()
        return await self.receive(timeout)

    async def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()
        await self.process.wait()


class RewardPool:
    """Async batch reward: `async with RewardPool(cfg) as pool: rewards = await pool.score_many(pairs)`."""

    def __init__(self, cfg: RewardConfig | None = None):
        self.cfg = cfg or RewardConfig()
        self.stats = RewardStats()
        self._idle: asyncio.Queue[_Worker | None] = asyncio.Queue()  # None: every worker is gone
        self._workers: set[_Worker] = set()
        self._background: set[asyncio.Task] = set()
        self._started = False
        self._closed = False
        self._failure: RuntimeError | None = None

    async def __aenter__(self) -> RewardPool:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def start(self) -> None:
        self._started = True
        await asyncio.gather(*(self._add_worker() for _ in range(self.cfg.workers)))

    async def close(self) -> None:
        self._closed = True
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*(w.kill() for w in self._workers), return_exceptions=True)
        self._workers.clear()

    async def score(self, response: str | Sequence[str], reference: str) -> float:
        """1.0 if the response's final boxed answer equals `reference`, else 0.0 (also on timeout).
        `response`: the model's own turns (Trajectory.model_turns), never text a tool wrote
        (tirl.reward.extract)."""
        self.stats.responses += 1
        answer = extract_answer(response)
        if answer is None:
            self.stats.no_answer += 1
            return 0.0
        return float(await self.equivalent(answer, reference))

    async def score_many(self, pairs: list[tuple[str | Sequence[str], str]]) -> list[float]:
        """Rewards for (response, reference) pairs, in input order."""
        return list(await asyncio.gather(*(self.score(r, ref) for r, ref in pairs)))

    async def equivalent(self, answer: str, reference: str) -> bool:
        """Equivalence of two extracted answers under the hard timeout (False on timeout)."""
        verdict = quick_verdict(answer, reference)
        if verdict is not None:
            self.stats.fast += 1
            return verdict
        return await self._verify(answer, reference)

    async def _verify(self, answer: str, reference: str) -> bool:
        if self._closed:
            raise RuntimeError("RewardPool is closed")
        if not self._started:
            await self.start()  # used without `async with`: start on first need
        start = time.perf_counter()
        try:
            return await self._verify_on_worker(answer, reference)
        finally:
            self.stats.verify_s += time.perf_counter() - start

    async def _verify_on_worker(self, answer: str, reference: str) -> bool:
        worker = await self._idle.get()
        if worker is None:  # no worker left and none can be started
            self._idle.put_nowait(None)  # wake the next waiter, too
            raise RuntimeError(f"no reward worker is running: {self._failure}") from self._failure
        self.stats.verified += 1
        try:
            reply = await worker.ask(answer, reference, self.cfg.timeout)
        except TimeoutError:
            self.stats.timeouts += 1
            self.stats.killed += 1
            self._replace(worker)
            return False
        except (WorkerDied, ConnectionError, ValueError):
            self.stats.errors += 1
            self._replace(worker)
            return False
        except asyncio.CancelledError:
            self._replace(worker)  # its late reply would otherwise be read by the next job
            raise
        self._idle.put_nowait(worker)
        if reply["status"] == "timeout":
            self.stats.timeouts += 1
        elif reply["status"] == "error":
            self.stats.errors += 1
        return reply["status"] == "ok" and bool(reply["equal"])

    async def _add_worker(self) -> None:
        worker = await _Worker.spawn(self.cfg)
        self._workers.add(worker)
        try:
            ready = await worker.receive(self.cfg.start_timeout)
            if ready.get("status") != "ready":
                raise WorkerDied(f"unexpected first message {ready}")
        except (TimeoutError, WorkerDied, ValueError) as e:
            self._workers.discard(worker)
            await worker.kill()
            raise RuntimeError(
                f"reward worker did not start within {self.cfg.start_timeout:g} s ({e}); check that "
                "`python -m tirl.reward.worker` runs and that memory_mb is large enough"
            ) from e
        if self._closed:
            await worker.kill()
        else:
            self._idle.put_nowait(worker)

    def _replace(self, worker: _Worker) -> None:
        self._workers.discard(worker)
        task = asyncio.create_task(self._restart(worker))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _restart(self, worker: _Worker) -> None:
        await worker.kill()
        if self._closed:
            return
        try:
            await self._add_worker()
        except RuntimeError as e:
            self._failure = e
            if not self._workers:
                self._idle.put_nowait(None)
