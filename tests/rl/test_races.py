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
from tests.forking import one_thread_after_fork

from tirl.rl.checkpoint import export_model, list_checkpoints, load_trainer_state, save_checkpoint


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def _export_meeting_the_other(src: Path, out: Path, barrier, results) -> None:
    """One `tirl export` process: it meets the other one at the moment both move the old export aside."""
    one_thread_after_fork()
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
    when each deletion has removed its first file and again when it has finished (rmtree takes seconds
    on a real model): it sees step 2 (the new one) and every checkpoint it lists whole; after the race
    only the newest two are left, no hidden directory."""
    run = tmp_path / "run"

    def save(step: int, marker: str) -> Path:
        state = tiny_model.state_dict()
        return save_checkpoint(
            run, step, tiny_model, state, None, {"step": step, "marker": marker}, keep_last=2
        )

    save(1, "one")
    save(2, "two, first try")
    seen: list[tuple[int, dict[int, str] | str]] = []
    saving = {"step": 0, "deleting": False}
    real_rmtree, real_unlink = shutil.rmtree, os.unlink

    def read() -> None:
        try:
            seen.append((saving["step"], _reader_view(run)))
        except OSError as e:  # rmtree(ignore_errors=True) would swallow it
            seen.append((saving["step"], f"{type(e).__name__}: {e}"))

    def unlink_then_read(*args, **kwargs):
        real_unlink(*args, **kwargs)
        if saving["deleting"]:
            saving["deleting"] = False  # once per deletion: after its first file
            read()

    def rmtree_then_read(path, *args, **kwargs):
        existed = Path(path).exists()  # not a fresh staging path being cleared first
        saving["deleting"] = existed and Path(path).parent == run / "checkpoints"
        real_rmtree(path, *args, **kwargs)
        if existed and Path(path).parent == run / "checkpoints":
            read()

    monkeypatch.setattr(shutil, "rmtree", rmtree_then_read)
    monkeypatch.setattr(os, "unlink", unlink_then_read)
    saving["step"] = 2
    save(2, "two")  # replaces step 2 whole
    saving["step"] = 3
    save(3, "three")  # prunes step 1
    monkeypatch.undo()
    assert len(seen) == 4, seen  # mid-way and after, for each of the two deletions
    for step, view in seen:
        assert isinstance(view, dict) and step in view and view[step] != "two, first try", seen
    assert _reader_view(run) == {2: "two", 3: "three"}
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
    assert not list(run.rglob(".*"))  # nothing half removed or staged left inside the kept ones either


def _lora_checkpoint(run: Path, step: int, base: Path, keep_last: int) -> Path:
    """A LoRA run's checkpoint as the trainer saves it (adapter/ naming its base, trainer state), with
    an adapter that moves the model (B nonzero)."""
    from transformers import AutoModelForCausalLM

    from tirl.rl.checkpoint import finish_checkpoint, staging_dir
    from tirl.rl.config import LoraConfig
    from tirl.rl.lora import apply_lora, save_adapter

    model = apply_lora(AutoModelForCausalLM.from_pretrained(base), LoraConfig(enabled=True, rank=2))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.fill_(0.01 * step)
    tmp = staging_dir(run, step, "test")
    save_adapter(model, tmp / "adapter", str(base), is_main=True)
    return finish_checkpoint(run, step, tmp, None, {"step": step, "marker": str(step)}, keep_last, "adapter")


def _merge_paused_before_saving(ckpt: Path, merging, pruned, results) -> None:
    """`tirl eval` on a LoRA checkpoint (merged on first use), paused after it read the adapter and
    before it writes the merged model, while the trainer prunes that checkpoint."""
    one_thread_after_fork()
    from transformers import PreTrainedModel

    from tirl.rl.checkpoint import checkpoint_model_dir

    real = PreTrainedModel.save_pretrained

    def save_after_the_prune(self, *args, **kwargs):
        merging.set()
        pruned.wait(timeout=120)
        return real(self, *args, **kwargs)

    PreTrainedModel.save_pretrained = save_after_the_prune  # this forked process's own class
    try:
        results.put(("ok", str(checkpoint_model_dir(ckpt))))
    except Exception as e:  # the parent asserts on it
        results.put(("error", f"{type(e).__name__}: {e}"))


def test_a_merge_of_a_checkpoint_pruned_under_it_leaves_no_step_directory(tiny_model_dir, tmp_path):
    """A reader merging a LoRA run's older checkpoint while the trainer saves the next and prunes that
    one: the reader gets one clear error, the run lists only the newest checkpoint (no step directory
    made again by the merge, holding only merged/ or nothing), and the newest merges into a model that
    transformers loads with the adapter's weights."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tirl.rl.checkpoint import checkpoint_model_dir

    run = tmp_path / "run"
    first = _lora_checkpoint(run, 1, tiny_model_dir, keep_last=1)
    ctx = multiprocessing.get_context("fork")
    merging, pruned, results = ctx.Event(), ctx.Event(), ctx.Queue()
    reader = ctx.Process(target=_merge_paused_before_saving, args=(first, merging, pruned, results))
    reader.start()
    try:
        assert merging.wait(timeout=120), "the reader never reached its merge"
        _lora_checkpoint(run, 2, tiny_model_dir, keep_last=1)  # prunes step 1 under the reader
    finally:
        pruned.set()
    kind, said = results.get(timeout=120)
    reader.join(timeout=60)
    assert [step for step, _ in list_checkpoints(run)] == [2]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002"]
    assert kind == "error" and "was removed while merged was built in it" in said and "\n" not in said, said
    newest = run / "checkpoints" / "step_000002"
    model_dir = checkpoint_model_dir(newest)
    assert model_dir == newest / "merged"  # what readers find inside: one model, no temp dir anywhere
    assert not [p for p in newest.rglob(".*")], list(newest.rglob(".*"))
    assert (model_dir / "model.safetensors").is_file() and not (model_dir / "merged").exists()
    merged = AutoModelForCausalLM.from_pretrained(model_dir)
    adapted = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(newest / "adapter")
    )
    prompt = torch.tensor([[5, 17, 33, 2, 99]])
    with torch.no_grad():
        assert torch.allclose(merged(prompt).logits, adapted.eval()(prompt).logits, atol=1e-5)


def test_a_checkpoint_saved_again_during_a_build_is_kept_whole_and_the_error_names_the_cause(tmp_path):
    """While a merge builds <step>/merged, the trainer prunes that step and saves it again (a resumed
    run): the new step directory, with its files, is left as the trainer wrote it, and the builder gets
    the one clear error (removing the directory it did not make fails and must not replace that error)."""
    from tirl.rl.lora import build_dir

    step = tmp_path / "checkpoints" / "step_000002"
    step.mkdir(parents=True)

    def saved_again_meanwhile(out: Path) -> None:
        (out / "config.json").write_text("{}")
        shutil.rmtree(step)
        step.mkdir()
        (step / "trainer_state.pt").write_text("the new save")

    with pytest.raises(FileNotFoundError, match="was removed while merged was built in it"):
        build_dir(step / "merged", saved_again_meanwhile)
    assert [p.name for p in step.iterdir()] == ["trainer_state.pt"]
    assert (step / "trainer_state.pt").read_text() == "the new save"

    def pruned_under_the_write(out: Path) -> None:  # the build's own write fails: it is the cause
        shutil.rmtree(step)
        (out / "config.json").write_text("{}")

    with pytest.raises(FileNotFoundError, match="was removed while merged was built in it") as raised:
        build_dir(step / "merged", pruned_under_the_write)
    cause = raised.value.__cause__
    assert isinstance(cause, FileNotFoundError) and "config.json" in str(cause)
    assert not step.exists()


def test_replacing_a_model_whose_old_copy_cannot_be_deleted_still_installs_the_new_one(tmp_path):
    """`replace` moves the old model aside, then deletes it; a file that cannot be deleted (marked
    immutable here; on NFS, a file a reader still holds open) leaves that hidden copy behind, and the new
    model is in place all the same."""
    import subprocess

    from tirl.rl.lora import build_dir

    out = tmp_path / "model"
    build_dir(out, lambda d: (d / "config.json").write_text('{"v": 1}'))
    stuck = out / "weights.bin"
    stuck.write_text("held")
    if (
        shutil.which("chattr") is None
        or subprocess.run(["chattr", "+i", str(stuck)], capture_output=True).returncode
    ):
        pytest.skip("chattr +i needs root on a filesystem with inode flags (ext4, xfs)")
    try:
        build_dir(out, lambda d: (d / "config.json").write_text('{"v": 2}'), replace=True)
        assert json.loads((out / "config.json").read_text()) == {"v": 2}
        assert not (out / "weights.bin").exists()
        (left,) = [p for p in tmp_path.iterdir() if p.name.startswith(".model.")]
        assert [p.name for p in (left / "model").iterdir()] == ["weights.bin"]
    finally:
        for p in tmp_path.rglob("weights.bin"):
            subprocess.run(["chattr", "-i", str(p)], check=True)
