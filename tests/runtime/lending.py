"""Stand-ins for a GPU's memory and what lives in it, for the colocation guards: CPU runs never walk the
offload/sleep path (offload returns early without CUDA), so these account for device memory the way a
GPU does and fail the way it fails.

`Device` is one accelerator: holders acquire and release blocks; more than it holds is CUDA's out of
memory. `RecordingEngine` is a vLLM engine in sleep mode: level 2 (discard) gives its weights' memory
back without a copy, so on wake they hold whatever was there (NaN here, detectable); level 1 keeps a
host copy. `RecordingLearner` is one FSDP2 rank: its parameters and AdamW state are on the device or
offloaded to the host, and a checkpoint's all-gather of host shards fails as NCCL does. Every call,
and the device of every tensor an engine gets, is recorded with its start and end times.
"""

from __future__ import annotations

import threading
import time

import torch

NCCL_CPU_ERROR = "No backend type associated with device type cpu"


class Events:
    """(who, what, start, end) of every call, thread-safe; monotonic times compare across processes."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, float, float]] = []
        self._lock = threading.Lock()

    def span(self, who: str, what: str, start: float) -> None:
        with self._lock:
            self.rows.append((who, what, start, time.monotonic()))

    def find(self, who: str, what: str) -> list[tuple[float, float]]:
        return [(s, e) for w, k, s, e in self.rows if w == who and k == what]


class Device:
    """One accelerator's memory in units: more than `capacity` is the allocator's out-of-memory."""

    def __init__(self, name: str, capacity: int) -> None:
        self.name, self.capacity = name, capacity
        self.held: dict[str, int] = {}
        self._lock = threading.Lock()

    def acquire(self, block: str, size: int) -> None:
        with self._lock:
            used = sum(self.held.values())
            if used + size > self.capacity:
                raise RuntimeError(
                    f"CUDA out of memory on {self.name}: {block} needs {size}, {self.capacity - used} free "
                    f"(held: {self.held})"
                )
            self.held[block] = size

    def release(self, block: str) -> None:
        with self._lock:
            self.held.pop(block, None)


class RecordingEngine:
    """A vLLM engine in sleep mode on `device` (weights and KV cache), with named weight tensors."""

    WEIGHTS, KV = 20, 40  # device units

    def __init__(self, name: str, device: Device, weights: dict[str, torch.Tensor], events: Events) -> None:
        self.name, self.device, self.events = name, device, events
        self.weights = {k: v.detach().clone().float() for k, v in weights.items()}
        self.received: list[tuple[str, str]] = []  # (name, device) of every tensor a sync brought
        self.discarded = False
        self.asleep: set[str] = set()
        device.acquire(f"{name}.weights", self.WEIGHTS)
        device.acquire(f"{name}.kv", self.KV)

    def _timed(self, what: str, fn) -> None:
        start = time.monotonic()
        time.sleep(0.05)  # an engine call takes a while: a race shows
        fn()
        self.events.span(self.name, what, start)

    async def generate(self, prompt_ids, params):
        raise AssertionError("no generation in these tests")

    def capacity(self):
        from tirl.engines.base import KVCapacity

        return KVCapacity(None, None)

    def sleep(self, discard_weights: bool = False) -> bool:
        def go() -> None:
            self.discarded = discard_weights  # level 2: no host copy of the weights
            self.asleep = {"weights", "kv"}
            self.device.release(f"{self.name}.weights")
            self.device.release(f"{self.name}.kv")

        self._timed("sleep_discard" if discard_weights else "sleep_keep", go)
        return True

    def _wake(self, part: str) -> None:
        if part not in self.asleep:
            return
        self.device.acquire(f"{self.name}.{part}", self.WEIGHTS if part == "weights" else self.KV)
        self.asleep.discard(part)
        if part == "weights" and self.discarded:  # fresh memory, never written: garbage
            self.weights = {k: torch.full_like(v, float("nan")) for k, v in self.weights.items()}

    def wake_weights(self) -> None:
        self._timed("wake_weights", lambda: self._wake("weights"))

    def wake_up(self) -> None:
        self._timed("wake_up", lambda: (self._wake("weights"), self._wake("kv")))

    def load_weights(self, weights) -> None:
        def go() -> None:
            if "weights" in self.asleep:
                raise RuntimeError(f"{self.name}: a weight sync into an engine whose weights are asleep")
            for name, t in weights:
                self.received.append((name, str(t.device)))
                self.weights[name].copy_(t.detach().float())

        self._timed("load", go)

    def uninitialised(self) -> list[str]:
        """The weights that hold memory nobody wrote (they would be sampled from)."""
        return [k for k, v in self.weights.items() if torch.isnan(v).any()]

    async def close(self) -> None:
        pass


class RecordingLearner:
    """One FSDP2 rank's learner on `device`: parameters and optimizer state on it or on the host.
    `delay`: seconds each memory move takes (a slow rank)."""

    PARAMS, OPTIMIZER = 20, 40  # device units

    def __init__(
        self,
        name: str,
        device: Device,
        events: Events,
        sends: str = "full",
        resident: bool = False,
        delay: float = 0.0,
        sharded: bool = True,
    ) -> None:
        self.name, self.gpu, self.events, self.sends = name, device, events, sends
        self.delay, self.sharded = delay, sharded
        self.where = {"params": "cpu", "optimizer": "cpu"}
        self.saved_from: list[dict[str, str]] = []
        self.published: list[int] = []
        self.reference_from: list[str] = []  # where the parameters were at each reference snapshot
        if resident:
            self._move("params", "cuda")
            self._move("optimizer", "cuda")

    def _move(self, part: str, to: str) -> None:
        if self.where[part] == to:
            return
        if to == "cuda":
            self.gpu.acquire(f"{self.name}.{part}", self.PARAMS if part == "params" else self.OPTIMIZER)
        else:
            self.gpu.release(f"{self.name}.{part}")
        self.where[part] = to

    def _timed(self, what: str, fn) -> bool:
        start = time.monotonic()
        time.sleep(self.delay)
        fn()
        self.events.span(self.name, what, start)
        return True

    def onload(self) -> bool:
        return self._timed("onload", lambda: (self._move("params", "cuda"), self._move("optimizer", "cuda")))

    def offload(self, what: str = "all") -> bool:
        parts = ["params", "optimizer"] if what == "all" else [what]
        return self._timed(f"offload_{what}", lambda: [self._move(p, "cpu") for p in parts])

    def update(self, samples, alg) -> dict:
        def go() -> None:
            if "cpu" in self.where.values():
                raise RuntimeError(f"{self.name}: an update with its state on the host {self.where}")

        self._timed("update", go)
        return {"train/trained_tokens": 1}

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")  # where its recorded tensors are (`gpu` accounts for the memory)

    def sync_tensors(self) -> dict:
        """What a sync carries, made when it is sent (an FSDP gather: over the NCCL group, which fails
        for host shards)."""

        def check() -> None:
            if self.where["params"] != "cuda" and self.sharded:
                raise RuntimeError(NCCL_CPU_ERROR)  # the sync's all-gather runs over the NCCL group

        self._timed("sync", check)
        names = WEIGHT_NAMES if self.sends == "full" else LORA_NAMES
        return {n: torch.ones(4, 4) for n in names}

    def stage_checkpoint(self, run_dir, step) -> None:
        def go() -> None:
            if self.sharded and "cpu" in self.where.values():
                raise RuntimeError(NCCL_CPU_ERROR)  # full_tensor() of host shards over an NCCL group
            self.saved_from.append(dict(self.where))

        self._timed("save", go)

    def publish_checkpoint(self, run_dir, step, tokenizer, state, keep_last) -> None:
        self._timed("publish", lambda: self.published.append(step))

    def reset_optimizer(self, total_steps: int) -> None: ...

    def snapshot_reference(self) -> None:
        """A copy of the parameters where they are: one on the host is a reference the update's
        (device) inputs cannot meet."""
        self._timed("snapshot_reference", lambda: self.reference_from.append(self.where["params"]))

    def restore(self, saved: dict) -> None: ...


LORA_NAMES = ["layer.q_proj.weight"]  # what a LoRA sync of WEIGHT_NAMES carries: the adapted layer only
WEIGHT_NAMES = ["embed.weight", "layer.q_proj.weight", "norm.weight", "lm_head.weight"]


def engine_weights() -> dict[str, torch.Tensor]:
    return {n: torch.zeros(4, 4) for n in WEIGHT_NAMES}
