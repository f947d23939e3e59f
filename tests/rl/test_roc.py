"""RoC pinned to docs/method.md §3: class split, 1/p_total sampling without replacement, edge cases."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import pytest
from scipy.stats import chisquare

from tirl.agent.trajectory import ToolCallRecord, Trajectory
from tirl.rl.roc import (
    _sample_without_replacement,
    is_positive,
    penalties,
    resample_on_correct,
    split_slots,
)


@dataclass
class M:
    reward: float
    num_tool_calls: int = 1
    num_tool_errors: int = 0
    answer_blocks: int = 1
    turns: int = 2


def test_penalties_match_the_paper():
    assert penalties(M(1, 4, 1, 1, 3)).p_err == 0.25
    assert penalties(M(1, 0, 0, 1, 1)).p_err == 0.5  # no tool call: encourages tool use
    assert penalties(M(1, 0, 0, 1, 1), no_tool_p_err=0.3).p_err == 0.3
    assert penalties(M(1, 2, 0, 0, 2)).p_format == 1.0  # no answer block
    assert penalties(M(1, 2, 0, 1, 2)).p_format == 0.0  # exactly one answer
    assert penalties(M(1, 2, 0, 3, 4)).p_format == 0.5  # (3 - 1) / 4
    assert penalties(M(1, 2, 0, 9, 4)).p_format == 1.0  # capped at 1
    p = penalties(M(1, 4, 2, 2, 4))
    assert p.p_total == pytest.approx(0.5 + 0.25)


def test_penalties_read_a_real_trajectory():
    t = Trajectory("p", [1, 2], turns=3, answer_blocks=2, reward=1.0)
    t.tool_calls = [ToolCallRecord(0, "ok"), ToolCallRecord(1, "timeout"), ToolCallRecord(2, "malformed")]
    p = penalties(t)
    assert p.p_err == pytest.approx(2 / 3) and p.p_format == pytest.approx(1 / 3)


@pytest.mark.parametrize(
    ("n_pos", "n_neg", "keep", "expected"),
    [
        (16, 16, 16, (8, 8)),
        (6, 26, 16, (3, 13)),
        (7, 25, 16, (4, 12)),  # odd halves: floor(25/2) negatives, the extra slot to the positives
        (32, 0, 16, (16, 0)),
        (0, 32, 16, (0, 16)),
        (1, 31, 16, (1, 15)),
        (3, 1, 2, (2, 0)),
        (2, 1, 4, (2, 1)),  # fewer members than slots: keep everything
    ],
)
def test_split_slots(n_pos, n_neg, keep, expected):
    assert split_slots(n_pos, n_neg, keep) == expected
    assert sum(split_slots(n_pos, n_neg, keep)) == min(keep, n_pos + n_neg)


def test_split_slots_minimum_per_class():
    assert split_slots(1, 31, 16, min_per_class=2) == (1, 15)  # only one positive exists
    assert split_slots(3, 29, 16, min_per_class=2) == (2, 14)
    assert split_slots(30, 2, 16, min_per_class=2) == (14, 2)
    assert split_slots(31, 1, 16, min_per_class=2) == (15, 1)


def _group(rng, n=32, p_pos=0.4):
    return [
        M(
            float(rng.random() < p_pos),
            int(rng.integers(0, 5)),
            0,
            int(rng.integers(0, 3)),
            int(rng.integers(1, 5)),
        )
        for _ in range(n)
    ]


@pytest.mark.parametrize("mode", ["sample", "topk"])
def test_kept_counts_total_g(mode):
    rng = np.random.default_rng(0)
    for _ in range(200):
        g = _group(rng)
        for m in g:
            m.num_tool_errors = int(rng.integers(0, m.num_tool_calls + 1))
        kept = resample_on_correct(g, 16, rng, mode=mode)
        n_pos = sum(m.reward > 0.5 for m in g)
        assert len(kept) == 16 and len(set(kept)) == 16 and kept == sorted(kept)
        assert sum(g[i].reward > 0.5 for i in kept) == split_slots(n_pos, 32 - n_pos, 16)[0]


def test_without_a_perfect_positive_first_pick_frequencies_follow_inverse_p_total():
    """sample, one positive slot and no perfect positive: P(pick i) = (1/p_i) / sum_j 1/p_j;
    chi-square over many draws."""
    pos = [M(1, 4, 1, 1, 2), M(1, 4, 2, 1, 2), M(1, 0, 0, 1, 2), M(1, 2, 0, 0, 2)]
    # p_total:      0.25           0.5            0.5 (no tools)  1.0 (no answer)
    group = [*pos, *[M(0) for _ in range(4)]]  # 4 + 4 members, keep 2: one slot per class
    rng = np.random.default_rng(1)
    draws = 10000
    counts = np.zeros(len(pos))
    for _ in range(draws):
        kept = resample_on_correct(group, 2, rng, mode="sample")
        (p,) = [i for i in kept if i < len(pos)]
        counts[p] += 1
    w = 1 / np.array([penalties(m).p_total for m in pos])
    expected = w / w.sum() * draws
    assert chisquare(counts, expected).pvalue > 1e-3


def test_perfect_positives_fill_the_slots_first_uniformly():
    """sample (the limit of 1/p_total): with at least k perfect positives, only perfect ones are kept,
    each k-subset of them equally likely."""
    perfect = [M(1, 2, 0, 1, 2) for _ in range(4)]  # p_total 0
    imperfect = [M(1, 4, 1, 1, 2) for _ in range(4)]  # p_total 0.25
    group = [*perfect, *imperfect, *[M(0) for _ in range(8)]]  # keep 4: 2 positive slots
    rng = np.random.default_rng(5)
    subsets: dict[tuple, int] = {}
    for _ in range(6000):
        kept = tuple(i for i in resample_on_correct(group, 4, rng) if i < 8)
        assert len(kept) == 2 and all(i < 4 for i in kept)  # never an imperfect one
        subsets[kept] = subsets.get(kept, 0) + 1
    assert sorted(subsets) == list(itertools.combinations(range(4), 2))
    assert chisquare(list(subsets.values()), np.full(6, 1000)).pvalue > 1e-3  # uniform: 1/6 each


def test_slots_left_by_perfect_positives_follow_inverse_p_total():
    """One perfect positive and three imperfect (p_total 0.25, 0.5, 1.0), two positive slots: the perfect
    one is always kept, the other slot goes to i with probability (1/p_i) / sum_j (1/p_j) = 4/7, 2/7, 1/7."""
    pos = [M(1, 2, 0, 1, 2), M(1, 4, 1, 1, 2), M(1, 4, 2, 1, 2), M(1, 2, 0, 0, 2)]
    assert [penalties(m).p_total for m in pos] == [0.0, 0.25, 0.5, 1.0]
    group = [*pos, *[M(0) for _ in range(4)]]  # keep 4: 2 positive slots
    rng = np.random.default_rng(6)
    counts = np.zeros(4)
    for _ in range(7000):
        kept = [i for i in resample_on_correct(group, 4, rng) if i < 4]
        assert kept[0] == 0 and len(kept) == 2
        counts[kept[1]] += 1
    assert counts[0] == 0
    assert chisquare(counts[1:], np.array([4, 2, 1]) * 1000).pvalue > 1e-3


def test_two_positive_slots_match_sequential_sampling_without_replacement():
    """Inclusion probabilities for k=2 against exact enumeration of ordered draws."""
    pos = [M(1, 4, 1, 1, 2), M(1, 4, 2, 1, 2), M(1, 2, 0, 0, 2), M(1, 4, 3, 2, 2)]
    w = 1 / np.array([penalties(m).p_total for m in pos])
    exact = np.zeros(len(pos))
    for a, b in itertools.permutations(range(len(pos)), 2):
        exact[a] += w[a] / w.sum() * w[b] / (w.sum() - w[a])
        exact[b] += w[a] / w.sum() * w[b] / (w.sum() - w[a])
    group = [*pos, *[M(0) for _ in range(4)]]  # keep 4: 2 negatives, 2 positives
    rng = np.random.default_rng(2)
    draws = 8000
    counts = np.zeros(len(pos))
    for _ in range(draws):
        for i in resample_on_correct(group, 4, rng):
            if i < len(pos):
                counts[i] += 1
    assert np.allclose(counts / draws, exact, atol=0.02)  # ~4 standard errors
    assert counts.sum() == 2 * draws  # without replacement: always 2 distinct positives


def test_negatives_are_uniform():
    group = [M(1), M(1), *[M(0, 3, 3, 0, 1) for _ in range(6)]]  # keep 4: 3 of 6 negatives, 1 positive
    rng = np.random.default_rng(3)
    counts = np.zeros(8)
    for _ in range(6000):
        counts[resample_on_correct(group, 4, rng)] += 1
    assert counts[0] + counts[1] == 6000
    assert chisquare(counts[2:], np.full(6, 3000)).pvalue > 1e-3


def test_topk_is_deterministic_lowest_p_total():
    group = [M(1, 4, 2, 1, 2), M(1, 4, 0, 1, 2), M(1, 4, 1, 1, 2), M(1, 4, 3, 1, 2), M(0), M(0), M(0), M(0)]
    a = resample_on_correct(group, 4, np.random.default_rng(0), mode="topk")
    b = resample_on_correct(group, 4, np.random.default_rng(99), mode="topk")
    assert [i for i in a if i < 4] == [i for i in b if i < 4] == [1, 2]


def test_edge_cases():
    rng = np.random.default_rng(4)
    all_correct = [M(1, 2, i % 3 == 0, 1, 2) for i in range(8)]
    assert len(resample_on_correct(all_correct, 4, rng)) == 4
    all_wrong = [M(0) for _ in range(8)]
    assert len(resample_on_correct(all_wrong, 4, rng)) == 4
    assert resample_on_correct(all_wrong, 4, rng, drop_uniform=True) == []
    assert resample_on_correct(all_correct, 4, rng, drop_uniform=True) == []
    assert resample_on_correct([M(1)], 4, rng) == [0]
    assert resample_on_correct([], 4, rng) == []
    no_tools = [M(1, 0, 0, 1, 1) for _ in range(4)]  # equal p_total 0.5: uniform, still finite
    assert len(resample_on_correct(no_tools, 2, rng)) == 2
    perfect = [M(1, 1, 0, 1, 1) for _ in range(4)]  # p_total = 0 for all
    assert len(resample_on_correct(perfect, 2, rng)) == 2
    empty = [M(0, 0, 0, 0, 0) for _ in range(4)]  # empty responses: no turns, no answer
    assert len(resample_on_correct(empty, 2, rng)) == 2
    assert resample_on_correct([M(1), M(0), M(1)], 2, rng, mode="off") == [0, 1]
    with pytest.raises(ValueError, match="keep"):
        resample_on_correct(all_wrong, 0, rng)


@pytest.mark.parametrize("bad", [-1.0, 0.0, math.inf, math.nan])
def test_weights_that_are_not_finite_and_positive_are_refused(bad):
    with pytest.raises(ValueError, match="RoC weights must be finite and positive"):
        _sample_without_replacement([0, 1, 2], np.array([1.0, bad, 2.0]), 1, np.random.default_rng(0))


def test_class_minimum_and_smallest_keep_reach_the_split():
    rng = np.random.default_rng(0)
    group = [M(1)] * 7 + [M(0)]  # 7 positives, 1 negative, keep 4: (4, 0) by default, (3, 1) with a minimum
    assert 7 not in resample_on_correct(group, 4, rng)
    assert 7 in resample_on_correct(group, 4, rng, min_per_class=1)
    assert len(resample_on_correct(group, 1, rng)) == 1  # keep = 1 is a valid group size
    assert [is_positive(M(r)) for r in (0.0, 0.5, 1.0)] == [False, False, True]  # positive: reward > 0.5


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((0, 0, 4), (0, 0)),  # an empty group
        ((5, 1, 4, 2), (3, 1)),  # a class minimum is capped by the class's size ...
        ((1, 5, 2, 3), (0, 2)),  # ... and by keep: the negatives get theirs first
        ((3, 3, 2, 2), (0, 2)),  # the positives get what keep leaves after the negatives' minimum
    ],
)
def test_split_slots_corners(args, expected):
    assert split_slots(*args) == expected


def test_options_reach_the_penalties_and_an_unknown_mode_is_refused():
    rng = np.random.default_rng(0)
    assert penalties(M(1, 1, 0, 2, 1)).p_format == 1.0  # 2 answer blocks in 1 turn: (2 - 1) / 1
    no_tool, erring = M(1, 0, 0, 1, 2), M(1, 4, 1, 1, 2)  # p_total: no_tool_p_err vs 0.25
    assert resample_on_correct([no_tool, erring, M(0)], 1, rng, mode="topk") == [1]
    assert resample_on_correct([no_tool, erring, M(0)], 1, rng, mode="topk", no_tool_p_err=0.1) == [0]
    group = [M(1, 1, 0, 1, 2), M(1, 2, 1, 1, 2)]  # p_total 0 and 0.5
    with pytest.raises(ValueError, match="unknown RoC mode 'best': use sample, topk or off"):
        resample_on_correct(group, 1, rng, mode="best")
