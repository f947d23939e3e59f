"""Training samples from trajectories: token alignment of ids, loss mask, engine log-probs and
advantages (build_samples), and the trainer's per-token log-probs (Policy.forward) against a direct
forward pass. Per-token arrays have len(ids) - 1 entries: entry k is about token k + 1."""

from __future__ import annotations

import pytest
import torch

from tirl.agent.trajectory import Trajectory
from tirl.distributed.groups import DistInfo
from tirl.rl.config import OptimConfig
from tirl.rl.policy import Policy, TrainSample
from tirl.rl.trainer import build_samples
from tirl.rl.update import engine_gap

PROMPT = [10, 11, 12]
TURN_1, TOOL, TURN_2 = [20, 21, 22], [30, 31], [40, 41]  # a generated turn, a tool response, the final turn


def _traj(reward: float, generated: bool = True) -> Trajectory:
    """prompt | turn 1 (trained) | tool response (not trained) | final turn (trained). The engine
    log-prob of generated token t is -t / 100, so a value names its token."""
    t = Trajectory(problem_id="p", prompt_ids=list(PROMPT), reward=reward)
    for ids, trained in ((TURN_1, True), (TOOL, False), (TURN_2, True)) if generated else ((TOOL, False),):
        t.response_ids += ids
        t.loss_mask += [int(trained)] * len(ids)
        t.logprobs += [-i / 100 if trained else 0.0 for i in ids]
    return t


def test_hand_built_multi_turn_trajectory_is_aligned():
    right, wrong, empty = _traj(1.0), _traj(0.0), _traj(0.0, generated=False)
    [a, b] = build_samples([[right, wrong, empty]], [[0, 1, 2]], advantage="dr_grpo")
    assert a.input_ids == PROMPT + TURN_1 + TOOL + TURN_2
    #            predicts: 11 12 20 21 22 30 31 40 41
    assert a.loss_mask == [0, 0, 1, 1, 1, 0, 0, 1, 1]
    assert a.engine_logprobs == [0, 0, -0.20, -0.21, -0.22, 0, 0, -0.40, -0.41]
    for k, m in enumerate(a.loss_mask):  # every trained entry is a generated token's own log-prob
        assert m == (a.input_ids[k + 1] in TURN_1 + TURN_2)
        assert a.engine_logprobs[k] == (-a.input_ids[k + 1] / 100 if m else 0.0)
    # advantages are group-relative over all three kept members, even the one with nothing to train
    # (it is left out of the samples): mean reward 1/3
    assert (a.advantage, b.advantage) == pytest.approx((2 / 3, -1 / 3))
    assert b.loss_mask == a.loss_mask and a.num_trained == 5
    [c, d] = build_samples([[right, wrong]], [[1, 0]], advantage="grpo")  # kept order is sample order
    assert (c.advantage, d.advantage) == pytest.approx((-(2**-0.5), 2**-0.5), abs=1e-5)
    [e, f] = build_samples([[right, wrong]], [[1, 0]])  # the default is the paper's "grpo"
    assert (e.advantage, f.advantage) == (c.advantage, d.advantage)


def test_only_kept_members_become_samples():
    group = [_traj(1.0), _traj(0.0), _traj(1.0), _traj(0.0)]
    samples = build_samples([group, [_traj(0.0), _traj(0.0)]], [[2, 1], []], advantage="dr_grpo")
    assert [s.advantage for s in samples] == pytest.approx([0.5, -0.5])
    # a member with nothing to train is skipped, the members after it are not
    samples = build_samples([[_traj(0.0, generated=False), _traj(1.0)]], [[0, 1]], advantage="dr_grpo")
    assert [s.advantage for s in samples] == pytest.approx([0.5])
    with pytest.raises(ValueError):  # one kept-index list per group, no silent truncation
        build_samples([group, group], [[0, 1]], advantage="dr_grpo")


def test_engine_gap_sums_the_trained_tokens_differences_and_is_zero_when_a_side_is_missing():
    """|old - engine| summed over trained tokens only; a sample without engine log-probs (an engine
    that returns none) or before its old log-probs are computed has no gap to add (0, not an error)."""
    s = TrainSample([1, 2, 3, 4], [1, 1, 0], engine_logprobs=[-0.5, -1.0, -9.0])
    s.old_logprobs = torch.tensor([-0.25, -2.0, 0.0])
    assert engine_gap(s) == pytest.approx(0.25 + 1.0)  # the untrained third token's 9.0 is not counted
    assert engine_gap(TrainSample([1, 2], [1], engine_logprobs=[-0.5])) == 0.0  # no old log-probs yet
    s.engine_logprobs = None
    assert engine_gap(s) == 0.0


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return Policy(str(tiny_model_dir), OptimConfig(device="cpu"), DistInfo(0, 1, torch.device("cpu")), 1)


def test_policy_logprobs_are_each_next_tokens_own(policy):
    """Policy.forward pads a batch; entry k of a sample is log p(ids[k + 1] | ids[: k + 1]), whatever the
    batch's padding, and engine_gap compares exactly those entries on trained tokens."""
    samples = [
        TrainSample([5, 9, 17, 4, 33, 8], [0, 1, 1, 0, 1]),
        TrainSample([7, 3, 21], [1, 1]),
    ]
    policy.compute_logprobs(samples, "old_logprobs")
    for s in samples:
        with torch.no_grad():
            logits = policy.model(torch.tensor([s.input_ids])).logits[0].float()
        direct = torch.log_softmax(logits, -1)[
            torch.arange(len(s.input_ids) - 1), torch.tensor(s.input_ids[1:])
        ]
        torch.testing.assert_close(s.old_logprobs, direct, atol=1e-5, rtol=0)
        s.engine_logprobs = direct.tolist()
        assert engine_gap(s) == pytest.approx(0.0, abs=1e-4)
        s.engine_logprobs = [0.0, *direct.tolist()[:-1]]  # shifted by one token
        assert engine_gap(s) > 0.5
    mb = policy.forward(samples)
    assert mb.mask.tolist() == [[0, 1, 1, 0, 1], [1, 1, 0, 0, 0]]  # the padding is never trained
