"""Run directories and checkpoints: restart of a run stopped before its first checkpoint, the agent
settings saved next to every checkpoint's model, and model paths that say what is wrong; then the
checkpoint functions in milliseconds with a stand-in model (see docs/mutation.md)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from tirl.agent.config import AgentConfig
from tirl.config import ConfigError
from tirl.distributed.checkpoint_reader import CheckpointRefused
from tirl.rl.checkpoint import (
    AGENT_FILE,
    PROMPT_FIELDS,
    RUN_FILES,
    LocalModel,
    agent_settings_warning,
    checkpoint_model_dir,
    export_model,
    latest_checkpoint,
    latest_model_dir,
    list_checkpoints,
    load_trainer_state,
    locate_model,
    prepare_run_dir,
    read_saved_training_state,
    refuse_outside_links,
    resolve_model_path,
    rng_states,
    save_checkpoint,
    saved_agent_settings,
    set_rng_states,
)
from tirl.rl.config import TrainConfig

AGENT = AgentConfig(max_turns=4, max_response_tokens=384, system_prompt="Use the python tool.")


def _cfg(tmp_path) -> TrainConfig:
    stages = [{"steps": 2, "data": "x"}]
    return TrainConfig(model="m", output_dir=str(tmp_path), run_name="r", stages=stages, agent=AGENT)


@pytest.mark.parametrize("resume", [False, True])
def test_a_run_stopped_before_its_first_checkpoint_starts_over(tmp_path, resume):
    cfg, said = _cfg(tmp_path), []
    assert prepare_run_dir(cfg.run_dir, cfg, resume=False, is_main=True, say=said.append) is None
    (cfg.run_dir / "metrics.jsonl").write_text('{"step": 1}\n')  # killed during step 2, no checkpoint yet
    assert prepare_run_dir(cfg.run_dir, cfg, resume=resume, is_main=True, say=said.append) is None
    assert said == [f"{cfg.run_dir} was stopped before its first checkpoint: starting it over from step 0"]
    assert not (cfg.run_dir / "metrics.jsonl").exists() and (cfg.run_dir / "config.yaml").is_file()


def test_resume_needs_a_run_and_says_which_step(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg, said = _cfg(tmp_path), []
    with pytest.raises(ConfigError, match="no checkpoint and no run"):
        prepare_run_dir(cfg.run_dir, cfg, resume=True, is_main=True)
    prepare_run_dir(cfg.run_dir, cfg, resume=False, is_main=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ckpt = save_checkpoint(cfg.run_dir, 7, model, model.state_dict(), tokenizer, {"step": 7}, keep_last=2)
    assert prepare_run_dir(cfg.run_dir, cfg, resume=True, is_main=True, say=said.append) == ckpt
    assert said == [f"resuming {cfg.run_dir} from step_000007 (step 7)"]
    with pytest.raises(ConfigError, match="already holds a run: pass --resume"):
        prepare_run_dir(cfg.run_dir, cfg, resume=False, is_main=True)

    # The agent settings travel with the model: a run dir, a checkpoint and its model/ all find them.
    assert resolve_model_path(str(cfg.run_dir)) == str(ckpt / "model")
    assert resolve_model_path(str(ckpt)) == str(ckpt / "model")
    agent, path = saved_agent_settings(ckpt / "model")
    assert agent == AGENT and path == ckpt / "model" / AGENT_FILE
    assert saved_agent_settings(tiny_model_dir) is None  # a model tirl did not train


def test_model_paths_that_do_not_exist_fail_at_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    for missing in (
        "runs/demo",
        "runs/demo/rl/checkpoints/step_000030/model",
        "./model",
        str(tmp_path / "m"),
    ):
        with pytest.raises(FileNotFoundError, match="no such directory"):
            resolve_model_path(missing)
    with pytest.raises(FileNotFoundError, match="not a model directory"):
        resolve_model_path("runs")
    assert resolve_model_path("Qwen/Qwen3-14B") == "Qwen/Qwen3-14B"  # a hub id is left to the hub


def test_an_unwritable_run_directory_is_one_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    cfg = _cfg(blocker)
    with pytest.raises(ConfigError, match=r"run directory \(output_dir/run_name\) .*cannot write there"):
        prepare_run_dir(cfg.run_dir, cfg, resume=False, is_main=True)


# ---- in milliseconds, with a stand-in model: what a save writes (model, tokenizer, trainer state with
# every RNG, the agent settings), atomic replacement of a re-saved step, pruning to exactly keep_last,
# the agent-settings warning, model-path resolution, and what prepare_run_dir removes, says and
# refuses ----


class Saver:
    """save_pretrained as transformers calls it: what it was given is written to the directory."""

    def __init__(self, kind: str):
        self.kind = kind
        self.calls: list[dict] = []

    def save_pretrained(self, path, **kw):
        self.calls.append({"path": path, **kw})
        path.mkdir(parents=True, exist_ok=True)
        (path / f"{self.kind}.txt").write_text(repr(sorted(kw.get("state_dict", {}))))


def save(run_dir, step, keep_last=3, tokenizer=True, state=None):
    model = Saver("model")
    tok = Saver("tokenizer") if tokenizer else None
    path = save_checkpoint(run_dir, step, model, {"w": 1}, tok, state or {"step": step}, keep_last)
    return path, model, tok


def test_a_save_writes_model_tokenizer_and_trainer_state_with_the_rngs(tmp_path):
    random.seed(4)
    expected = rng_states()
    path, model, tok = save(tmp_path, 7, state={"step": 7, "x": "y"})
    assert path == tmp_path / "checkpoints" / "step_000007" and path.is_dir()
    [call] = model.calls
    assert call["state_dict"] == {"w": 1} and call["safe_serialization"] is True
    assert call["path"].name == "model"
    assert (path / "model" / "model.txt").is_file() and (path / "model" / "tokenizer.txt").is_file()
    [tcall] = tok.calls
    assert tcall["path"] == call["path"]
    state = load_trainer_state(path)
    assert state["step"] == 7 and state["x"] == "y"
    assert state["rng"]["python"] == expected["python"]
    assert torch.equal(state["rng"]["torch"], expected["torch"])
    assert np.array_equal(state["rng"]["numpy"][1], expected["numpy"][1])
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_000007"]  # no temp left
    assert not (path / "model" / AGENT_FILE).exists()  # the run has no config.yaml


def test_without_a_tokenizer_only_the_model_is_saved(tmp_path):
    path, _, _ = save(tmp_path, 1, tokenizer=False)
    assert [p.name for p in (path / "model").iterdir()] == ["model.txt"]


def test_a_leftover_temp_directory_of_this_process_is_replaced(tmp_path):
    import os

    stale = tmp_path / "checkpoints" / f".tmp_step_000003_{os.getpid()}"
    (stale / "model").mkdir(parents=True)
    (stale / "model" / "junk").write_text("x")
    path, _, _ = save(tmp_path, 3)
    assert not (path / "model" / "junk").exists() and not stale.exists()


def test_resaving_a_step_replaces_it_whole(tmp_path):
    path, _, _ = save(tmp_path, 5, state={"step": 5, "v": 1})
    (path / "extra").write_text("from the first save")
    again, _, _ = save(tmp_path, 5, state={"step": 5, "v": 2})
    assert again == path and not (path / "extra").exists()
    assert load_trainer_state(path)["v"] == 2


def test_a_resave_that_also_prunes_leaves_only_the_kept_checkpoints_on_disk(tmp_path):
    """What a reader listing checkpoints/ sees after the save: the replaced copy of the step and the
    pruned step are both gone, not left under their hidden names."""
    save(tmp_path, 1, keep_last=2)
    save(tmp_path, 2, keep_last=2)
    save(tmp_path, 2, keep_last=1, state={"step": 2, "v": "again"})  # replaces step 2, prunes step 1
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000002"]
    assert load_trainer_state(tmp_path / "checkpoints" / "step_000002")["v"] == "again"


def test_a_prune_this_process_left_half_done_is_finished_by_the_next_save(tmp_path):
    """A kill between moving an old checkpoint aside and deleting it leaves it under this process's
    hidden name (a recycled pid meets it again): the next prune replaces it and nothing hidden stays."""
    import os

    save(tmp_path, 1, keep_last=1)
    left = tmp_path / "checkpoints" / f".tmp_step_000001_old-{os.getpid()}"
    (left / "model").mkdir(parents=True)
    (left / "model" / "half-deleted").write_text("x")
    save(tmp_path, 2, keep_last=1)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000002"]


@pytest.mark.parametrize("keep_last", [1, 2, 3])
def test_pruning_keeps_exactly_the_newest_keep_last(tmp_path, keep_last):
    for step in (9, 10, 100, 1000):
        save(tmp_path, step, keep_last=keep_last)
    kept = [s for s, _ in list_checkpoints(tmp_path)]
    assert kept == [9, 10, 100, 1000][-keep_last:]
    assert latest_checkpoint(tmp_path).name == "step_001000"


def test_agent_settings_are_saved_with_the_model_and_read_back(tmp_path):
    agent = AgentConfig(max_turns=3, system_prompt="S", prefill="<p>")
    dumped = agent.model_dump(mode="json")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"agent": dumped}, sort_keys=False))
    path, _, _ = save(tmp_path, 2)
    text = (path / "model" / AGENT_FILE).read_text()
    assert text.startswith(
        "# The agent settings this model was trained with (tirl eval/chat use them by default).\n"
    )
    assert list(yaml.safe_load(text)) == list(dumped)  # the config's key order, not sorted
    assert list(dumped) != sorted(dumped)
    got, file = saved_agent_settings(path / "model")
    assert got == agent and file == path / "model" / AGENT_FILE
    assert saved_agent_settings(tmp_path) is None
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"model": "m"}))  # no agent section
    path, _, _ = save(tmp_path, 3)
    assert not (path / "model" / AGENT_FILE).exists()


def test_bad_saved_agent_settings_name_their_file(tmp_path):
    (tmp_path / AGENT_FILE).write_text("max_turns: -5\n")
    with pytest.raises(ConfigError) as err:
        saved_agent_settings(tmp_path)
    assert f" in {tmp_path / AGENT_FILE}" in str(err.value)


def test_the_agent_settings_warning_names_each_prompt_field_that_changed(tmp_path):
    trained = AgentConfig(system_prompt="S", max_turns=3)
    (tmp_path / AGENT_FILE).write_text(yaml.safe_dump(trained.model_dump(mode="json")))
    assert agent_settings_warning(tmp_path, trained) is None
    assert agent_settings_warning(tmp_path, trained.model_copy(update={"max_turns": 9})) is None  # a budget
    assert agent_settings_warning(tmp_path / "nothing", AgentConfig()) is None
    changed = trained.model_copy(update={"system_prompt": "T", "prefill": "x" * 100})
    msg = agent_settings_warning(tmp_path, changed)
    short = repr("x" * 100)[:57] + "..."
    assert msg == (
        f"warning: these agent settings differ from the ones the model was trained with "
        f"({tmp_path / AGENT_FILE}): system_prompt: 'S' -> 'T', prefill: '<reason>' -> {short}; "
        "the model's prompt changes and it may follow it badly (see docs/commands.md, agent settings)"
    )
    exact = trained.model_copy(update={"prefill": "y" * 58})  # repr is 60 characters: shown whole
    assert f"-> {'y' * 58!r};" in agent_settings_warning(tmp_path, exact)
    assert len(PROMPT_FIELDS) == 10 and "tool_schema" in PROMPT_FIELDS and "max_turns" not in PROMPT_FIELDS
    for field in PROMPT_FIELDS:
        assert hasattr(trained, field)


def test_load_trainer_state_and_latest_model_dir_say_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        load_trainer_state(tmp_path)
    assert str(err.value) == f"{tmp_path} is not a tirl checkpoint (no trainer_state.pt)"
    with pytest.raises(FileNotFoundError) as err:
        latest_model_dir(tmp_path)
    assert str(err.value) == f"no checkpoint under {tmp_path}/checkpoints"
    save(tmp_path, 4)
    save(tmp_path, 12)
    assert latest_model_dir(tmp_path) == tmp_path / "checkpoints" / "step_000012" / "model"


def test_resolve_model_path_for_each_kind_of_directory(tmp_path, monkeypatch):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert resolve_model_path(str(model)) == str(model)
    ckpt = tmp_path / "ck"
    (ckpt / "model").mkdir(parents=True)
    (ckpt / "model" / "config.json").write_text("{}")
    assert resolve_model_path(str(ckpt)) == str(ckpt / "model")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError) as err:
        resolve_model_path(str(empty))
    assert str(err.value) == f"model {empty}: not a model directory (no config.json), run or checkpoint"
    with pytest.raises(FileNotFoundError) as err:
        resolve_model_path("~/surely/not/here")
    assert str(err.value) == (
        "model ~/surely/not/here: no such directory; give a model directory (`tirl model init --out DIR` "
        "makes a tiny one), a tirl run or checkpoint directory, or a Hugging Face id (org/name)"
    )
    monkeypatch.chdir(tmp_path)
    for missing in ("a/b/c", ".hidden", "m/x"):
        with pytest.raises(FileNotFoundError):
            resolve_model_path(missing)
    assert resolve_model_path("org/name") == "org/name" and resolve_model_path("gpt2") == "gpt2"


def _bare_cfg(tmp_path) -> TrainConfig:
    """A run config with the default agent settings."""
    return TrainConfig(model="m", output_dir=str(tmp_path), run_name="r", stages=[{"steps": 2, "data": "x"}])


def test_prepare_run_dir_clears_every_partial_run_file_on_the_main_rank_only(tmp_path):
    cfg = _bare_cfg(tmp_path)
    run = cfg.run_dir
    assert RUN_FILES == ("config.yaml", "metrics.jsonl", "tensorboard")
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    (run / "tensorboard").mkdir()
    (run / "tensorboard" / "events").write_text("x")
    (run / "keep.txt").write_text("not a run file")
    said = []
    assert prepare_run_dir(run, cfg, resume=False, is_main=False, say=said.append) is None
    assert (run / "metrics.jsonl").exists() and (run / "tensorboard").exists()  # another rank: untouched
    assert said == [f"{run} was stopped before its first checkpoint: starting it over from step 0"]
    assert prepare_run_dir(run, cfg, resume=False, is_main=True, say=said.append) is None
    assert not (run / "metrics.jsonl").exists() and not (run / "tensorboard").exists()
    assert (run / "keep.txt").exists()
    assert yaml.safe_load((run / "config.yaml").read_text())["run_name"] == "r"


def test_prepare_run_dir_on_a_fresh_directory_says_nothing(tmp_path):
    cfg = _bare_cfg(tmp_path)
    said = []
    assert prepare_run_dir(cfg.run_dir, cfg, resume=False, is_main=True, say=said.append) is None
    assert said == [] and (cfg.run_dir / "config.yaml").is_file()
    assert cfg.run_dir.stat().st_mode & 0o777 == 0o700, "a run directory is its owner's only"
    fresh = _bare_cfg(tmp_path / "other")
    assert prepare_run_dir(fresh.run_dir, fresh, resume=False, is_main=False, say=said.append) is None
    assert not fresh.run_dir.exists()


def test_prepare_run_dir_refusals_in_full(tmp_path):
    cfg = _bare_cfg(tmp_path)
    with pytest.raises(ConfigError) as err:
        prepare_run_dir(cfg.run_dir, cfg, resume=True, is_main=True)
    assert str(err.value) == f"--resume: no checkpoint and no run in {cfg.run_dir}; start without --resume"
    save(cfg.run_dir, 40)
    with pytest.raises(ConfigError) as err:
        prepare_run_dir(cfg.run_dir, cfg, resume=False, is_main=True)
    assert str(err.value) == (
        f"{cfg.run_dir} already holds a run: pass --resume to continue it, or choose another run_name/output_dir"
    )
    said = []
    ckpt = prepare_run_dir(cfg.run_dir, cfg, resume=True, is_main=False, say=said.append)
    assert ckpt == cfg.run_dir / "checkpoints" / "step_000040"
    assert said == [f"resuming {cfg.run_dir} from step_000040 (step 40)"]


def test_set_rng_states_ignores_a_cuda_state_without_cuda():
    state = rng_states()
    assert ("cuda" in state) == torch.cuda.is_available()
    want = random.random()
    set_rng_states({**state, "cuda": ["not a state"]} if not torch.cuda.is_available() else state)
    assert random.random() == want


def test_a_trainer_state_written_on_a_gpu_loads_on_the_cpu_and_names_its_checkpoint(tmp_path, monkeypatch):
    path, _, _ = save(tmp_path, 6, state={"step": 6, "lr": torch.tensor([0.5, 0.25])})
    state = torch.load(path / "trainer_state.pt", weights_only=False)
    with monkeypatch.context() as m:  # as a CUDA run writes it: every storage tagged cuda:0
        m.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        torch.save(state, path / "trainer_state.pt")
    for ckpt in (path, str(path)):
        got = load_trainer_state(ckpt)
        assert got["lr"].device.type == "cpu" and got["lr"].tolist() == [0.5, 0.25]
        assert got["step"] == 6 and got["checkpoint"] == str(path)
        assert set(got) == {"step", "lr", "rng", "checkpoint"}


def test_a_run_directory_resolves_to_its_newest_checkpoints_model(tmp_path, monkeypatch):
    run = tmp_path / "run"
    for step in (20, 100, 3):
        model = run / "checkpoints" / f"step_{step:06d}" / "model"
        model.mkdir(parents=True)
        (model / "config.json").write_text("{}")
    want = str(run / "checkpoints" / "step_000100" / "model")
    assert resolve_model_path(str(run)) == want
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_model_path("~/run") == want  # ~ is the user's home
    with pytest.raises(FileNotFoundError) as err:
        resolve_model_path(str(tmp_path / "checkpoints-none"))
    assert "no such directory" in str(err.value)
    (run / "checkpoints" / "step_000100" / "model" / "config.json").unlink()
    (run / "checkpoints" / "step_000100" / "model").rmdir()
    (run / "checkpoints" / "step_000100").rmdir()
    assert resolve_model_path(str(run)) == str(run / "checkpoints" / "step_000020" / "model")


def test_a_missing_home_or_absolute_path_is_not_taken_for_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    for missing in ("~/model", "~", "/model", "/srv/model"):
        with pytest.raises(FileNotFoundError) as err:
            resolve_model_path(missing)
        assert str(err.value).startswith(f"model {missing}: no such directory;")
    (tmp_path / "home").mkdir()
    with pytest.raises(FileNotFoundError) as err:  # the home directory is no model
        resolve_model_path("~")
    assert str(err.value) == "model ~: not a model directory (no config.json), run or checkpoint"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_read_saved_training_state_gathers_the_shards_on_the_cpu(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {
        "model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([1.5])},
        "optim": {
            "state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.ones(2, 3)}},
            "param_groups": [],
        },
    }
    dcp.save(state, checkpoint_id=tmp_path / "ck" / "shards")
    for ckpt in (tmp_path / "ck", str(tmp_path / "ck")):
        got = read_saved_training_state(ckpt)
        assert set(got) == {"model", "optim"}
        assert torch.equal(got["model"]["w"], state["model"]["w"]) and got["model"]["w"].device.type == "cpu"
        assert torch.equal(got["model"]["b"], state["model"]["b"])
        assert torch.equal(got["optim"]["state"]["w"]["exp_avg"], torch.ones(2, 3))
        assert float(got["optim"]["state"]["w"]["step"]) == 3.0


def test_the_cuda_generators_are_saved_and_restored_when_cuda_is_there(monkeypatch):
    """A stand-in CUDA (this machine has none): its generators' states go into the saved RNG state and
    come back on restore; a state saved without CUDA restores on a CUDA machine without touching it."""
    restored = []
    gpu_states = [torch.tensor([1], dtype=torch.uint8), torch.tensor([2], dtype=torch.uint8)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: gpu_states)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.append)
    state = rng_states()
    assert state["cuda"] is gpu_states and set(state) == {"python", "numpy", "torch", "cuda"}
    set_rng_states(state)
    assert restored == [gpu_states]
    set_rng_states({k: v for k, v in state.items() if k != "cuda"})
    assert restored == [gpu_states]


def test_lora_checkpoints_and_adapters_resolve_to_their_merged_model(tmp_path, monkeypatch):
    """A LoRA checkpoint (adapter/, no model/) means its merged/ model, merged on first use; a bare peft
    adapter directory is merged beside itself; a full model/ wins over an adapter (stand-in merge)."""
    import tirl.rl.lora as lora

    merges = []

    def merge(adapter, out):
        merges.append((Path(adapter), Path(out)))
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "config.json").write_text("{}")
        return Path(out)

    monkeypatch.setattr(lora, "merge_adapter", merge)
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step_000004"
    (ckpt / "adapter").mkdir(parents=True)
    (ckpt / "adapter" / "adapter_config.json").write_text("{}")
    assert checkpoint_model_dir(ckpt) == ckpt / "merged" and merges == [(ckpt / "adapter", ckpt / "merged")]
    assert checkpoint_model_dir(str(ckpt)) == ckpt / "merged" and len(merges) == 1  # merged once
    assert latest_model_dir(run) == ckpt / "merged"
    assert resolve_model_path(str(run)) == resolve_model_path(str(ckpt)) == str(ckpt / "merged")
    assert len(merges) == 1
    (ckpt / "model").mkdir()
    (ckpt / "model" / "config.json").write_text("{}")
    assert checkpoint_model_dir(ckpt) == ckpt / "model" and resolve_model_path(str(ckpt)) == str(
        ckpt / "model"
    )
    assert locate_model(ckpt) == LocalModel(model=ckpt / "model")  # model/ wins over adapter/
    (ckpt / "model" / "config.json").unlink()
    assert locate_model(run) == locate_model(ckpt) == LocalModel(adapter=ckpt / "adapter", checkpoint=ckpt)
    plain = tmp_path / "ck"  # no adapter: its model/
    assert checkpoint_model_dir(plain) == plain / "model"
    adapter = tmp_path / "my-adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    assert resolve_model_path(str(adapter)) == str(tmp_path / "my-adapter-merged")
    assert merges[-1] == (adapter, tmp_path / "my-adapter-merged")
    (adapter / "config.json").write_text("{}")  # a full model that also holds an adapter config: itself
    assert resolve_model_path(str(adapter)) == str(adapter) and len(merges) == 2


def test_an_old_checkpoint_that_cannot_be_pruned_does_not_fail_the_save(tmp_path, monkeypatch):
    """Pruning is best effort: an old checkpoint another process is deleting (or that cannot be
    removed) is left behind, and the new checkpoint is saved all the same."""
    import os

    save(tmp_path, 1, keep_last=1)
    real = os.rmdir

    def rmdir(path, *args, **kwargs):
        if "step_000001" in str(path):
            raise PermissionError(f"cannot remove {path}")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "rmdir", rmdir)
    path, _, _ = save(tmp_path, 2, keep_last=1)
    assert load_trainer_state(path)["step"] == 2 and latest_checkpoint(tmp_path) == path


# ---- `tirl export` from each kind of directory, and its refusals (a LoRA merge: test_lora.py) ----


def _model_dir(path: Path, marker: str) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_text(marker)
    return path


def test_export_copies_a_model_directory_and_says_when_it_replaced_one(tmp_path):
    src, out = _model_dir(tmp_path / "m", "weights-1"), tmp_path / "out"
    assert export_model(src, out) == f"wrote {out}: a copy of {src}"
    assert (out / "model.safetensors").read_text() == "weights-1"
    (src / "model.safetensors").write_text("weights-2")
    assert (
        export_model(str(src), str(out))
        == f"wrote {out} (replacing the model that was there): a copy of {src}"
    )
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert (out / "model.safetensors").read_text() == "weights-2"


def test_export_of_a_run_copies_its_newest_checkpoints_model(tmp_path):
    run = tmp_path / "run"
    _model_dir(run / "checkpoints" / "step_000001" / "model", "old")
    newest = _model_dir(run / "checkpoints" / "step_000002" / "model", "new")
    out = tmp_path / "out"
    assert export_model(run, out) == f"wrote {out}: a copy of {newest}"
    assert (out / "model.safetensors").read_text() == "new"


def test_export_of_an_adapter_merges_it_into_the_out_directory(tmp_path, monkeypatch):
    import tirl.rl.lora as lora

    ckpt = tmp_path / "run" / "checkpoints" / "step_000003"
    (ckpt / "adapter").mkdir(parents=True)
    (ckpt / "adapter" / "adapter_config.json").write_text('{"base_model_name_or_path": "org/base"}')
    merges = []
    monkeypatch.setattr(
        lora, "merge_adapter", lambda adapter, out, replace: merges.append((adapter, out, replace))
    )
    out = tmp_path / "out"
    said = export_model(tmp_path / "run", out)
    assert merges == [(ckpt / "adapter", out, True)]
    assert said == f"wrote {out}: the adapter {ckpt / 'adapter'} merged into its base org/base"


def test_export_refusals_are_one_line_and_write_nothing(tmp_path):
    src = _model_dir(tmp_path / "m", "w")
    (tmp_path / "empty").mkdir()
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    cases = [
        (tmp_path / "none", tmp_path / "o1", FileNotFoundError,
         f"model {tmp_path / 'none'}: no such directory; give a tirl run, checkpoint, peft adapter or model directory"),
        (tmp_path / "empty", tmp_path / "o2", FileNotFoundError,
         f"model {tmp_path / 'empty'}: not a tirl run, checkpoint, peft adapter or model directory "
         "(no model/, adapter/, config.json or adapter_config.json)"),
        (tmp_path / "run", tmp_path / "o3", FileNotFoundError,
         f"model {tmp_path / 'run'}: no checkpoint under {tmp_path / 'run'}/checkpoints"),
        (src, src, FileExistsError, f"--out {src}: it holds the model being exported; choose another directory"),
        (src, tmp_path, FileExistsError, f"--out {tmp_path}: it holds the model being exported; choose another directory"),
    ]  # fmt: skip
    for source, out, kind, message in cases:
        with pytest.raises(kind) as err:
            export_model(source, out)
        assert str(err.value) == message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "m", "run"]
    assert sorted(p.name for p in src.iterdir()) == ["config.json", "model.safetensors"]


# ---- what a checkpoint may make this process do: nothing but load tensors and plain values ----


class _Payload:
    """Pickles as a call that writes a marker file: a trainer_state.pt built to run code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


def _refusal(ckpt: Path, why: str) -> str:
    return (
        f"checkpoint {ckpt}: refused: {why}. A checkpoint written by an older tirl looks like this: if you "
        f"trust it (you or tirl wrote it), convert it once with `tirl convert-checkpoint {ckpt}`"
    )


def test_a_trainer_state_that_runs_code_is_refused_even_where_torch_is_told_to_allow_it(
    tmp_path, monkeypatch
):
    """TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 (set for some other tool) makes torch.load without an explicit
    weights_only unpickle anything: the checkpoint's load must still refuse to run code."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    marker = tmp_path / "ran"
    ckpt = tmp_path / "step_000001"
    ckpt.mkdir()
    torch.save({"step": 1, "payload": _Payload(marker)}, ckpt / "trainer_state.pt")
    with pytest.raises(CheckpointRefused) as err:
        load_trainer_state(ckpt)
    why = "it names exec, which loading would have to run"
    assert str(err.value) == _refusal(ckpt, why) and not marker.exists()


@pytest.mark.parametrize(
    "state", [{"step": 3, "optimizer": {}}, [1, 2]], ids=["full-optimizer", "not-a-dict"]
)
def test_a_trainer_state_from_before_sharded_checkpoints_is_refused_in_full(tmp_path, state):
    ckpt = tmp_path / "step_000003"
    ckpt.mkdir()
    torch.save(state, ckpt / "trainer_state.pt")
    with pytest.raises(CheckpointRefused) as err:
        load_trainer_state(ckpt)
    assert str(err.value) == _refusal(ckpt, "it is in the format from before sharded checkpoints")


def test_links_leading_outside_a_run_or_a_model_are_refused_in_full(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to(tmp_path / "elsewhere")
    (run / "trajectories.jsonl").symlink_to(tmp_path / "notes")
    with pytest.raises(ConfigError) as err:
        refuse_outside_links(run)
    first = sorted(["metrics.jsonl", "trajectories.jsonl"], key=lambda n: str(run / n))[0]
    target = {"metrics.jsonl": "elsewhere", "trajectories.jsonl": "notes"}[first]
    assert str(err.value) == (
        f"run directory {run}: {first} is a symbolic link to {(tmp_path / target).resolve()}, outside the run (and 1 more); "
        "training writes the run's files in place and would write there: remove the link (to keep a run "
        "on another disk, set output_dir there or link the run directory itself)"
    )
    refuse_outside_links(tmp_path / "not-yet")  # a run that does not exist yet holds no link
    model = _model_dir(tmp_path / "m", "w")
    (model / "tokenizer.json").symlink_to(tmp_path / "secret")
    with pytest.raises(ValueError) as err:
        export_model(model, tmp_path / "out")
    assert str(err.value) == (
        f"model {model}: tokenizer.json is a symbolic link to {(tmp_path / 'secret').resolve()}, outside the directory: "
        "only what the directory holds is copied; replace the link by the file it should be, or remove it"
    )
    assert not (tmp_path / "out").exists()


def test_a_file_given_as_the_model_is_one_line(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_text("w")
    with pytest.raises(FileNotFoundError) as err:
        resolve_model_path(str(weights))
    assert str(err.value) == (
        f"model {weights}: a file, not a directory; give a model directory (`tirl model init --out DIR` "
        "makes a tiny one), a tirl run or checkpoint directory, or a Hugging Face id (org/name)"
    )
