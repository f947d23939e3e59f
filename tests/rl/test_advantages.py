"""The advantage estimators (tirl.rl.advantages) by hand: GRPO and Dr.GRPO on small groups, the eps,
double precision, and the registry's names, plugin paths and errors."""

from __future__ import annotations

import math
import sys
import types

import pytest

from tirl.plugins import PluginError
from tirl.rl.advantages import ADVANTAGES, dr_grpo, grpo, resolve_advantage


def test_advantage_registry_by_hand():
    # rewards 1,0,0,0: mean 0.25, unbiased std 0.5
    assert ADVANTAGES["grpo"]([1, 0, 0, 0]) == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-5)
    assert ADVANTAGES["dr_grpo"]([1, 0, 0, 0]) == pytest.approx([0.75, -0.25, -0.25, -0.25])
    assert ADVANTAGES["dr_grpo"]([1.0]) == [0.0] and ADVANTAGES["dr_grpo"]([1, 1]) == [0.0, 0.0]


def test_a_group_of_two_already_has_a_relative_signal():
    # mean 0.5, unbiased std sqrt(0.5): +-0.5 / 0.7071 = +-0.7071
    assert grpo([1.0, 0.0]) == pytest.approx([math.sqrt(0.5), -math.sqrt(0.5)], abs=1e-5)
    assert dr_grpo([1.0, 0.0]) == [0.5, -0.5]
    assert grpo([3.0]) == [0.0] and dr_grpo([3.0]) == [0.0]
    assert grpo([]) == [] and dr_grpo([]) == []


def test_grpo_divides_by_the_sample_std_plus_a_tiny_eps():
    # rewards 2, 0: std sqrt(2); the eps (1e-6) is negligible but present
    assert grpo([2.0, 0.0])[0] == pytest.approx(1 / (math.sqrt(2) + 1e-6), rel=1e-12)
    assert grpo([2.0, 0.0], eps=1.0)[0] == pytest.approx(1 / (math.sqrt(2) + 1.0), rel=1e-12)


def test_advantages_are_computed_in_double_precision():
    # 1e9 + 1 is not a float32: a single-precision centring would lose the difference
    assert dr_grpo([1e9 + 1, 1e9]) == [0.5, -0.5]
    assert grpo([1e9 + 1, 1e9]) == pytest.approx([math.sqrt(0.5), -math.sqrt(0.5)], abs=1e-5)


def test_resolve_advantage_by_name_by_path_and_rejects_non_functions(monkeypatch):
    assert resolve_advantage("grpo") is grpo and resolve_advantage("dr_grpo") is dr_grpo
    assert {"grpo": grpo, "dr_grpo": dr_grpo} == ADVANTAGES
    mod = types.ModuleType("tirl_mutants_adv")
    mod.fn = lambda rewards: [1.0] * len(rewards)
    mod.value = 3
    monkeypatch.setitem(sys.modules, "tirl_mutants_adv", mod)
    assert resolve_advantage("tirl_mutants_adv:fn") is mod.fn
    with pytest.raises(ValueError) as err:
        resolve_advantage("tirl_mutants_adv:value")
    assert str(err.value) == (
        "advantage estimator 'tirl_mutants_adv:value' is not a function (rewards) -> advantages"
    )
    with pytest.raises(PluginError, match="unknown advantage estimator 'x'"):
        resolve_advantage("x")
