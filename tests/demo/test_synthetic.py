"""Synthetic tasks: deterministic, disjoint splits, and every family's code prints its answer."""

from __future__ import annotations

import json

import pytest

from tirl.demo.synthetic import FAMILIES, generate, is_heldout, write_jsonl


def test_generation_is_deterministic_distinct_and_round_robin():
    a, b = generate(30, "train", seed=3), generate(30, "train", seed=3)
    assert [p.problem for p in a] == [p.problem for p in b]
    assert len({p.problem for p in a}) == 30
    assert [p.meta["family"] for p in a[: len(FAMILIES)]] == [f.name for f in FAMILIES]
    assert all(p.answer.lstrip("-").isdigit() for p in a)


def test_splits_are_disjoint_by_construction():
    train = generate(400, "train", seed=0)
    heldout = generate(60, "heldout", seed=0)
    assert not {p.problem for p in train} & {p.problem for p in heldout}
    assert all(is_heldout(p.problem) for p in heldout)
    assert not any(is_heldout(p.problem) for p in train)
    # another seed draws other problems, still on the right side of the split
    assert not any(is_heldout(p.problem) for p in generate(100, "train", seed=1))


@pytest.mark.asyncio(loop_scope="package")
async def test_reference_code_prints_the_answer_in_the_real_sandbox(sandbox):
    problems = generate(3 * len(FAMILIES), "heldout", seed=7)
    for p in problems:
        result = await sandbox.run(p.meta["code"])
        assert result.status == "ok", (p.meta["code"], result.render())
        assert result.stdout.strip() == p.answer, p


def test_bad_arguments_say_what_to_do():
    with pytest.raises(ValueError, match="unknown split"):
        generate(3, "test")
    with pytest.raises(ValueError, match="unknown task family 'algebra'"):
        generate(3, families=["algebra"])
    with pytest.raises(ValueError, match="n must be >= 0"):
        generate(-1)


def test_write_jsonl_is_the_loader_schema(tmp_path):
    path = write_jsonl(generate(4, "train", families=["product_mod"]), tmp_path / "p.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [set(r) >= {"id", "problem", "answer", "source", "family", "code"} for r in rows] == [True] * 4
    assert {r["family"] for r in rows} == {"product_mod"}
