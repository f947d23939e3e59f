"""With kl_coef > 0 and colocated engines, a stage's KL reference is copied from the policy on its
device: between steps the trainer's state is on the host (the engines hold the GPU), and a copy made
there would leave the reference on the host while the update's inputs are on the GPU (issue 40)."""

from __future__ import annotations

from tests.runtime.lending import Device, Events, RecordingEngine, RecordingLearner, engine_weights
from tests.runtime.test_lending import colocated_run

from tirl.rl.trainer import rl_step, snapshot_reference


async def test_a_stage_reference_is_snapshot_with_the_policy_on_its_device(tmp_path):
    events, gpu = Events(), Device("cuda:0", 100)
    engine = RecordingEngine("engine0", gpu, engine_weights(), events)
    learner = RecordingLearner("rank0", gpu, events)
    run = colocated_run(learner, [engine], tmp_path)
    await rl_step(run, None)  # a stage's steps end with the trainer's state on the host
    assert learner.where["params"] == "cpu"
    snapshot_reference(run)  # the next stage starts
    assert learner.reference_from == ["cuda"]
    assert learner.where == {"params": "cpu", "optimizer": "cpu"} and engine.asleep == set()
    assert engine.uninitialised() == []  # the engines kept their weights (no sync follows)
