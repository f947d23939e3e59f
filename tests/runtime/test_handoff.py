"""The in-process sync (torchrun, the `local` runtime) as the engines see it: the real learner packs the
model once, in the engines' dtype, into one buffer every engine opens (issue 41, item 4); a transfer
directory without room is the clear error before anything is mapped. The GPU half (the buffer in the
trainer's GPU memory, opened by CUDA IPC in an engine on that GPU) needs CUDA: docs/weight-sync.md."""

from __future__ import annotations

import errno
import os
import shutil

import pytest
import torch

from tirl.distributed.groups import DistInfo
from tirl.engines import handoff as handoff_module
from tirl.engines.base import FlatLoader, SingleEnginePool
from tirl.engines.handoff import FlatHandoff, unpack_flat
from tirl.rl.config import OptimConfig
from tirl.rl.local_learner import LocalLearner
from tirl.rl.policy import Policy
from tirl.runtime.base import Runtime
from tirl.runtime.handoff import InProcess


class PackedEngine:
    """An in-process vLLM engine as the handoff sees it: a dtype, its GPU, the buffers it was given
    (what its worker would open: a view into the buffer, never a copy) and any (name, tensor) loads."""

    def __init__(self, gpu: str, dtype: torch.dtype = torch.bfloat16) -> None:
        self.gpu, self.dtype = gpu, dtype
        self.handoffs: list[FlatHandoff] = []
        self.loaded: list[dict[str, torch.Tensor]] = []
        self.weights: dict[str, torch.Tensor] = {}

    def near(self, device: torch.device) -> bool:
        return str(device) == self.gpu

    def load_flat(self, handoff: FlatHandoff) -> None:
        self.handoffs.append(handoff)
        mapped = torch.from_file(handoff.path, shared=False, size=handoff.nbytes, dtype=torch.uint8)
        self.weights = {name: t.clone() for name, t in unpack_flat(mapped, handoff.plan)}

    def load_weights(self, weights) -> None:
        pairs = dict(weights)
        self.loaded.append(pairs)
        self.weights = {k: v.clone() for k, v in pairs.items()}


@pytest.fixture(scope="module")
def learner(tiny_model_dir) -> LocalLearner:
    info = DistInfo(0, 1, torch.device("cpu"))
    return LocalLearner(Policy(str(tiny_model_dir), OptimConfig(device="cpu"), info, total_steps=1))


def _runtime(engines: list) -> Runtime:
    return Runtime(engines, SingleEnginePool(engines[0]), executor=None, scorer=None, tokenizer=None)


def _sync(learner: LocalLearner, engines: list) -> dict[str, float]:
    """One sync as rank 0 of the local runtime runs it (tirl.runtime.handoff.InProcess)."""
    return InProcess(_runtime(engines), learner, learner.info).send()


def test_a_sync_is_packed_once_in_the_engines_dtype_for_every_engine(learner, tmp_path, monkeypatch):
    monkeypatch.setenv("TIRL_WEIGHTS_DIR", str(tmp_path))
    engines = [PackedEngine("cpu"), PackedEngine("cuda:1"), PackedEngine("cuda:2")]  # one beside the trainer
    assert all(isinstance(e, FlatLoader) for e in engines)
    stats = _sync(learner, engines)
    params = dict(learner.policy.model.named_parameters())
    bf16_bytes = sum(p.numel() * 2 for p in params.values())
    # one buffer, 2 bytes a parameter (no fp32 copy, no copy per engine), opened by every engine
    assert stats["sync/buffers"] == 1 and stats["sync/tensors"] == len(params)
    assert bf16_bytes <= stats["sync/bytes"] == stats["sync/host_bytes"] < bf16_bytes + 64 * len(params)
    [first] = engines[0].handoffs
    assert all(e.handoffs == [first] for e in engines) and not any(e.loaded for e in engines)
    for engine in engines:
        assert engine.weights.keys() == params.keys()
        for name, p in params.items():
            assert engine.weights[name].dtype == torch.bfloat16
            torch.testing.assert_close(engine.weights[name], p.detach().to(torch.bfloat16), rtol=0, atol=0)
    assert not os.listdir(tmp_path)  # the shared file is gone once every engine loaded it


def test_engines_of_different_dtypes_get_pairs(learner):
    engines = [PackedEngine("cpu"), PackedEngine("cuda:1", torch.float16)]
    stats = _sync(learner, engines)
    assert stats["sync/buffers"] == 0 and all(len(e.loaded) == 1 and not e.handoffs for e in engines)


def test_a_transfer_directory_without_room_is_the_clear_error_before_anything_is_mapped(
    learner, tmp_path, monkeypatch
):
    monkeypatch.setenv("TIRL_WEIGHTS_DIR", str(tmp_path))
    tiny = shutil.disk_usage(tmp_path)._replace(free=4096)  # a 4 KiB /dev/shm
    monkeypatch.setattr(handoff_module.shutil, "disk_usage", lambda _: tiny)
    engine = PackedEngine("cpu")
    with pytest.raises(
        OSError, match=r"needs 0\.00 GiB in .* only 0\.00 GiB are free.*--shm-size.*TIRL_WEIGHTS_DIR"
    ):
        _sync(learner, [engine])
    assert not engine.handoffs and not os.listdir(tmp_path)


def test_room_taken_after_the_check_is_the_same_error_not_a_sigbus(learner, tmp_path, monkeypatch):
    """Another writer filled the tmpfs between the check and the write: the reservation fails as the
    kernel says (ENOSPC), before anything is mapped and written."""
    monkeypatch.setenv("TIRL_WEIGHTS_DIR", str(tmp_path))

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(handoff_module.os, "posix_fallocate", full)
    engine = PackedEngine("cpu")
    with pytest.raises(OSError, match=r"weight sync needs .* GiB in .*TIRL_WEIGHTS_DIR"):
        _sync(learner, [engine])
    assert not engine.handoffs and not os.listdir(tmp_path)


def test_the_gpu_buffer_is_allocated_on_plain_segments_and_collected_after(monkeypatch):
    """Issue 68, fix 1: the trainer runs on expandable segments, whose CUDA IPC handle the engine's
    worker could only open with pidfd_getfd (refused by default container seccomp profiles). The buffer
    is allocated with them off, the setting restored at once, and ipc_collect runs once it is released.
    (CUDA recorded, not run: the allocator calls are what is tested.)"""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    events: list[str] = []
    real_empty = torch.empty

    def empty(*args, device=None, **kwargs):
        if device is not None and torch.device(device).type == "cuda":
            events.append("allocate")
            return real_empty(*args, **kwargs)
        return real_empty(*args, device=device, **kwargs)

    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", events.append)
    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: events.append("ipc_collect"))
    plan, nbytes = handoff_module.flat_layout([("w", (4,), torch.float32)], torch.bfloat16)
    with handoff_module.flat_handoff(plan, nbytes, torch.device("cuda", 0)) as handoff:
        events.append("load")
        assert handoff.path is None and handoff.nbytes == nbytes
    assert events == [
        "expandable_segments:False",
        "allocate",
        "expandable_segments:True",
        "load",
        "ipc_collect",
    ]
    assert handoff.buf.numel() == 0  # no reference left to the IPC-shared block


def test_without_expandable_segments_the_allocator_is_left_alone(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:128")
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", calls.append)
    with handoff_module.ipc_shareable():
        pass
    assert calls == []
