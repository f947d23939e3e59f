"""Races on the directories other processes read (checkpoints, exported models), checked by what a
reader finds INSIDE them after the race: complete files with the right contents, nothing half removed,
no temp directory left. Each race is made to happen by construction (a barrier both racers meet at, or
a reader that looks exactly while the writer is between two steps), never by sleeping."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tirl.rl.checkpoint import export_model, list_checkpoints, load_trainer_state, save_checkpoint


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def _export_meeting_the_other(src: Path, out: Path, barrier, results) -> None:
    """One `tirl export` process: it meets the other one at the moment both move the old export aside."""
    real = os.replace

    def replace(a, b, *args, **kwargs):
        if Path(a) == out:
            barrier.wait(timeout=120)
        return real(a, b, *args, **kwargs)

    os.replace = replace  # this forked process's own os module
    try:
        results.put(("ok", export_model(src, out)))
    except Exception as e:  # the parent asserts on it
        results.put(("error", f"{type(e).__name__}: {e}"))


def test_two_exports_replacing_one_model_at_once_leave_one_whole_model(tiny_model_dir, tmp_path):
    """Two `tirl export --out X` over an existing export, both moving X aside at the same moment: both
    succeed and X is one whole model that transformers loads, with the source's weights, no temp dir."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "export"
    export_model(tiny_model_dir, out)
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [
        ctx.Process(target=_export_meeting_the_other, args=(tiny_model_dir, out, barrier, results))
        for _ in "ab"
    ]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=180) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert [kind for kind, _ in outcomes] == ["ok", "ok"], outcomes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no hidden temp or moved-aside copy
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in Path(tiny_model_dir).iterdir())
    assert isinstance(json.loads((out / "config.json").read_text()), dict)
    source, exported = _weights(Path(tiny_model_dir)), _weights(out)
    assert source.keys() == exported.keys() and all(torch.equal(source[k], exported[k]) for k in source)
    AutoModelForCausalLM.from_pretrained(out)  # a reader loads it


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir)


def _reader_view(run_dir: Path) -> dict[int, str]:
    """What eval, chat or a resume on the run sees: each listed checkpoint opened whole (its trainer
    state, its model's config and weights), step -> the marker its saver wrote."""
    view = {}
    for step, ckpt in list_checkpoints(run_dir):
        json.loads((ckpt / "model" / "config.json").read_text())
        _weights(ckpt / "model")
        view[step] = load_trainer_state(ckpt)["marker"]
    return view


def test_a_reader_sees_every_checkpoint_whole_while_a_save_replaces_and_prunes(
    tiny_model, tmp_path, monkeypatch
):
    """A resumed run re-saving step 2 and pruning to the newest 2, with a reader opening the run exactly
    when each deletion has finished (the moment rmtree's seconds end): it sees step 2 (the new one) and
    every checkpoint it lists whole; after the race only the newest two are left, no hidden directory."""
    run = tmp_path / "run"

    def save(step: int, marker: str) -> Path:
        state = tiny_model.state_dict()
        return save_checkpoint(
            run, step, tiny_model, state, None, {"step": step, "marker": marker}, keep_last=2
        )

    save(1, "one")
    save(2, "two, first try")
    seen: list[tuple[int, dict[int, str]]] = []
    saving = {"step": 0}
    real_rmtree = shutil.rmtree

    def rmtree_then_read(path, *args, **kwargs):
        existed = Path(path).exists()  # not a fresh staging path being cleared first
        real_rmtree(path, *args, **kwargs)
        if existed and Path(path).parent == run / "checkpoints":
            seen.append((saving["step"], _reader_view(run)))

    monkeypatch.setattr(shutil, "rmtree", rmtree_then_read)
    saving["step"] = 2
    save(2, "two")  # replaces step 2 whole
    saving["step"] = 3
    save(3, "three")  # prunes step 1
    monkeypatch.undo()
    assert seen, "the saves deleted nothing: the race never happened"
    for step, view in seen:
        assert step in view and view[step] != "two, first try", seen
    assert _reader_view(run) == {2: "two", 3: "three"}
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
