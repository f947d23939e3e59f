"""Guards of the colocated GPU step that CPU runs never walk (offload returns early without CUDA):
the trainer and the engines take turns on one device's memory (tests/runtime/lending.py accounts for
it as a GPU does and fails as it fails), and

1. a checkpoint after a colocated step saves the FSDP2 state from the device it was sharded on (an
   all-gather of host shards over the NCCL group fails: "No backend type associated with device type cpu");
2. a LoRA sync, which carries only the adapted layers, never lands in engines that threw their other
   weights away (vLLM sleep level 2): the real LoRA learner against an engine whose discarded memory
   comes back as NaN;
3. under torchrun, engine i wakes only after trainer rank i let go of its memory, and rank i takes the
   memory back only after engine i slept (two gloo processes, rank 1 slow to move its memory).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tests.runtime.lending import Device, Events, RecordingEngine, RecordingLearner, engine_weights
from tests.terminal import run_torchrun

from tirl.engines.base import SingleEnginePool
from tirl.rl.sampler import EpochSampler
from tirl.rl.trainer import Run, TrainerState, checkpoint, rl_step
from tirl.runtime.base import Runtime
from tirl.runtime.config import ClusterConfig

WORKER = Path(__file__).with_name("lending_worker.py")
UPDATE_HALF = SimpleNamespace(is_main=False, enabled=False, rank=0, world_size=1)  # no rollouts here


def colocated_run(learner, engines: list, run_dir: Path, info=UPDATE_HALF, alg=None) -> Run:
    """A colocated Run of `learner` and `engines` (none: a rank without the runtime)."""
    cfg = SimpleNamespace(
        algorithm=alg or SimpleNamespace(async_=False),
        cluster=ClusterConfig(),
        run_dir=run_dir,
        checkpoint=SimpleNamespace(keep_last=1),
    )
    runtime = None
    if engines:
        runtime = Runtime(engines, SingleEnginePool(engines[0]), executor=None, scorer=None, tokenizer=None)
    return Run(cfg, info, learner, runtime, TrainerState(), logger=None, alerts=None)


async def test_a_checkpoint_after_a_colocated_step_saves_the_state_from_the_device(tmp_path):
    """Issue 68, fix 5: the checkpoint is written inside the step, right after the update, where the
    trainer's state is on the device and the engines are asleep for the update anyway: no sleep of its
    own (a level-1 sleep per checkpoint copied every engine's weights into pinned host memory that
    torch's host cache then kept: ~330 GiB per 8-GPU node at 14B), no extra onload or offload."""
    events, gpu = Events(), Device("cuda:0", 100)
    engine = RecordingEngine("engine0", gpu, engine_weights(), events)
    learner = RecordingLearner("rank0", gpu, events)  # offloaded at start
    run = colocated_run(learner, [engine], tmp_path)
    for step in range(2):
        await rl_step(run, None, save=True)
        run.state.step = step + 1
        checkpoint(run, EpochSampler(4, 0), None)
    assert learner.saved_from == [{"params": "cuda", "optimizer": "cuda"}] * 2
    assert learner.published == [1, 2]
    assert learner.where == {"params": "cpu", "optimizer": "cpu"}  # the device is the engines' again
    assert engine.asleep == set() and engine.uninitialised() == []
    sleeps = [what for who, what, *_ in events.rows if who == "engine0" and what.startswith("sleep")]
    assert sleeps == ["sleep_discard", "sleep_discard"]  # one per step: the update's
    moves = [what for who, what, *_ in events.rows if who == "rank0" and "load" in what]
    assert moves == ["onload", "offload_optimizer", "offload_params"] * 2


def _lora_learner(model_dir: Path, lora: bool):
    """The real learner (tirl.rl.local_learner) on the tiny model, updating on a fixed batch."""
    from tirl.distributed.groups import DistInfo
    from tirl.rl.config import LoraConfig, OptimConfig
    from tirl.rl.local_learner import LocalLearner
    from tirl.rl.policy import Policy, TrainSample

    adapters = LoraConfig(enabled=lora, rank=4, alpha=8, target_modules=["q_proj", "v_proj"])
    optim = OptimConfig(lr=1e-2, warmup_steps=0, micro_batch_tokens=256, device="cpu", lora=adapters)
    policy = Policy(str(model_dir), optim, DistInfo(0, 1, torch.device("cpu")), total_steps=2)
    batch = [
        TrainSample([5, 6, 7, 8, 9, 10], [0, 0, 1, 1, 1], 1.0),
        TrainSample([5, 6, 9, 8], [0, 1, 1], -1.0),
    ]

    class FixedBatch(LocalLearner):
        def update(self, samples, alg):
            return super().update([TrainSample(s.input_ids, s.loss_mask, s.advantage) for s in batch], alg)

    return FixedBatch(policy)


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
async def test_a_colocated_sync_leaves_no_engine_weight_uninitialised(tmp_path, tiny_model_dir, lora):
    from transformers import AutoModelForCausalLM

    from tirl.rl.config import AlgorithmConfig

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    names = dict(base.named_parameters())  # what a vLLM engine of it holds (a tied head once)
    events = Events()
    engine = RecordingEngine("engine0", Device("cuda:0", 10**6), names, events)
    run = colocated_run(_lora_learner(tiny_model_dir, lora), [engine], tmp_path, alg=AlgorithmConfig())
    for _ in range(2):
        await rl_step(run, None)
        assert engine.uninitialised() == []
    synced = {n for n, _ in engine.received}
    if lora:  # only the adapted layers (and their fused partners) travel; the rest kept their weights
        assert synced and synced < set(names)
        assert all(torch.equal(engine.weights[n], names[n].detach()) for n in set(names) - synced)
    else:  # a full sync rewrites every weight: the engines may throw theirs away (level 2)
        assert synced == set(names)
        assert "sleep_discard" in [what for _, what, *_ in events.rows]


def test_under_torchrun_engine_i_wakes_after_rank_i_let_go(tmp_path):
    out = tmp_path / "events.json"
    proc = run_torchrun(WORKER, str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [tuple(r) for rank in range(2) for r in json.loads(Path(f"{out}.{rank}").read_text())]

    def span(who: str, what: str) -> tuple[float, float]:
        [found] = [(s, e) for w, k, s, e in rows if w == who and k == what]
        return found

    for i in range(2):
        engine, rank = f"engine{i}", f"rank{i}"
        assert span(engine, "sleep_discard")[1] <= span(rank, "onload")[0], (
            f"{rank} onloads into a busy device"
        )
        assert span(rank, "offload_optimizer")[1] <= span(engine, "wake_weights")[0], f"{engine} wakes early"
        assert span(rank, "offload_params")[1] <= span(engine, "wake_up")[0], f"{engine} KV wakes early"
