"""`tirl model from-gguf` on SmolLM2-135M-Instruct: an ordinary model directory a pretrained model's
users would recognise, and the errors a wrong source gets."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import torch

from tirl.model_import import MARKER, GGUFError, find_gguf, from_gguf


def test_the_directory_is_plain_float_safetensors_with_the_chat_end_of_turn(smollm2_dir: Path):
    names = {p.name for p in smollm2_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= names
    assert not [n for n in names if n.endswith((".gguf", ".bin", ".pt"))]  # nothing pickled, no GGUF
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 30
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert json.loads((smollm2_dir / "generation_config.json").read_text())["eos_token_id"] == end
    assert tok.eos_token == "<|im_end|>"  # a turn ends where the template ends it: engines stop there


def test_the_real_model_answers_in_its_own_template(smollm2_dir: Path):
    """The weights survived the dequantization: greedy decoding answers a question it knows."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    ids = torch.tensor([ids["input_ids"] if hasattr(ids, "keys") else ids])
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1] :])


def test_a_second_import_of_the_same_source_does_nothing(smollm2_dir: Path):
    before = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    record = json.loads((smollm2_dir / MARKER).read_text())
    wheel = Path(__file__).resolve().parents[2] / ".cache" / "wheels" / record["source"]
    assert from_gguf(wheel, smollm2_dir) == smollm2_dir
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == before


def test_wrong_sources_get_one_clear_error(tmp_path: Path):
    text = tmp_path / "notes.txt"
    text.write_text("not a model")
    empty = tmp_path / "empty.whl"
    with zipfile.ZipFile(empty, "w") as z:
        z.writestr("pkg/__init__.py", "")
    for source, words in ((tmp_path / "missing.gguf", "no such file"), (text, "neither"), (empty, "0 .gguf")):
        with pytest.raises(GGUFError, match=words):
            find_gguf(source, tmp_path)


def test_a_directory_it_did_not_write_is_never_replaced(tmp_path: Path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "weights.safetensors").write_text("a user's own")
    source = tmp_path / "m.gguf"
    source.write_bytes(b"GGUF")
    with pytest.raises(GGUFError, match="not written by"):
        from_gguf(source, out)
    assert (out / "weights.safetensors").read_text() == "a user's own"


def test_the_command_line_names_the_bad_source(tmp_path: Path):
    from typer.testing import CliRunner

    from tirl.cli import app

    result = CliRunner().invoke(
        app, ["model", "from-gguf", str(tmp_path / "x.whl"), "--out", str(tmp_path / "o")]
    )
    words = " ".join(result.output.replace("│", " ").split())  # rich wraps the message in a box
    assert result.exit_code != 0 and "no such file" in words
    assert not (tmp_path / "o").exists()


def test_demo_real_refuses_what_is_not_a_model_directory_and_drills_on_a_pretrained_model(
    tmp_path: Path, smollm2_dir: Path
):
    from tirl.config import ConfigError
    from tirl.demo import real_overrides
    from tirl.demo.pipeline import load_settings

    with pytest.raises(ConfigError, match="not a model directory"):
        real_overrides(tmp_path)
    settings = load_settings(overrides=real_overrides(smollm2_dir))
    assert settings.demo.model == str(smollm2_dir.resolve()) and settings.demo.drill_steps == 0
    with pytest.raises(ConfigError, match="copies already"):
        load_settings(overrides=[*real_overrides(smollm2_dir), "demo.drill_steps=10"])


def test_gsm8k_intervals_are_wilson_intervals():
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "real_model_gsm8k.py"
    spec = importlib.util.spec_from_file_location("real_model_gsm8k", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    low, high = bench.wilson(0, 200)
    assert low == 0.0 and 0.018 < high < 0.019  # 0 of 200 still allows ~1.9%
    low, high = bench.wilson(100, 200)
    assert abs(low - 0.4314) < 1e-3 and abs(high - 0.5686) < 1e-3
