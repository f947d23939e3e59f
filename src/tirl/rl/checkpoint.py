"""Checkpoints: sharded training state, an HF model export beside it, and the trainer state, atomically.

Layout: <run_dir>/checkpoints/step_000050/{shards/, model/, trainer_state.pt}. shards/ is a
torch.distributed.checkpoint directory (fp32 weights and AdamW moments, each rank writing and reading
only its own shards: nothing is gathered and no rank reads another's optimizer state); model/ is a
Hugging Face model (safetensors, fp32) streamed tensor by tensor from the shards, for engines, eval and
the next stage; trainer_state.pt holds only counters, schedule, RNG and sampler positions, as tensors
and plain values: it loads with weights_only=True, shards/ through tirl.distributed.checkpoint_reader, so
resuming a checkpoint someone shared runs none of its code (older ones: tirl.rl.checkpoint_convert). A LoRA
run's checkpoint holds adapter/ (the peft adapter, naming its base model) instead of model/, and
shards/ only the adapter and its optimizer; its plain HF model is merged on first use
(checkpoint_model_dir, tirl.rl.lora). A checkpoint is built in a hidden temp directory and renamed
into place, so a kill mid-save leaves the previous one intact. model/ also holds `tirl_agent.yaml`, the agent settings the run used (prompt, tool schema, template,
budgets): `tirl eval` and `tirl chat` default to them, since a model only works with the protocol it
was trained on.
"""

from __future__ import annotations

import os
import pickle
import random
import re
import shutil
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml
from pydantic import BaseModel

from tirl.agent.config import AgentConfig
from tirl.agent.tools import BUILTIN_TOOLS
from tirl.config import ConfigError, dump_config, ensure_writable_dir, read_yaml, validate
from tirl.distributed.checkpoint_reader import CheckpointRefused, load_safely, unsafe_reason
from tirl.rl.model_files import outside_link_message, outside_links

STEP_DIR = re.compile(r"^step_(\d+)$")
AGENT_FILE = "tirl_agent.yaml"
RUN_FILES = ("config.yaml", "metrics.jsonl", "tensorboard")  # what a run writes before its first checkpoint


def rng_states() -> dict:
    """Every generator's state as tensors and plain values (numpy's key array as a list), so the
    trainer state loads with torch.load(weights_only=True)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy = (kind, keys.tolist(), pos, has_gauss, gauss)
    state = {"python": random.getstate(), "numpy": numpy, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_states(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def save_checkpoint(
    run_dir: Path, step: int, model, model_state: dict, tokenizer, trainer_state: dict, keep_last: int
) -> Path:
    """Write step_<step> atomically (rank 0 only) and prune all but the newest keep_last."""
    tmp = staging_dir(run_dir, step, f"{os.getpid()}")
    model.save_pretrained(tmp / "model", state_dict=model_state, safe_serialization=True)
    return finish_checkpoint(run_dir, step, tmp, tokenizer, trainer_state, keep_last)


def staging_dir(run_dir: Path, step: int, tag: str) -> Path:
    """A fresh hidden directory a checkpoint is built in (rank 0 makes it; under FSDP every rank then
    writes its shards there, so `tag` must be the same on all ranks)."""
    tmp = staging_path(run_dir, step, tag)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def staging_path(run_dir: Path, step: int, tag: str) -> Path:
    return Path(run_dir) / "checkpoints" / f".tmp_step_{step:06d}_{tag}"


def finish_checkpoint(
    run_dir: Path,
    step: int,
    tmp: Path,
    tokenizer,
    trainer_state: dict,
    keep_last: int,
    model_dir: str = "model",
) -> Path:
    """Add the tokenizer, trainer state (with the RNGs) and agent settings to a staged checkpoint whose
    model/ (a LoRA run's: adapter/) is written, move it into place atomically and prune all but the
    newest keep_last (rank 0)."""
    final = Path(run_dir) / "checkpoints" / f"step_{step:06d}"
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp / model_dir)
    torch.save({**trainer_state, "rng": rng_states()}, tmp / "trainer_state.pt")
    _copy_agent_settings(Path(run_dir) / "config.yaml", tmp / model_dir / AGENT_FILE)
    stale = [final] if final.exists() else []  # re-saving a step (e.g. a resumed run): replaced whole
    aside = [_move_aside(run_dir, step, p) for p in stale]
    os.replace(tmp, final)
    aside += [_move_aside(run_dir, n, old) for n, old in list_checkpoints(run_dir)[:-keep_last]]
    for path in aside:
        shutil.rmtree(path, ignore_errors=True)
    return final


def _move_aside(run_dir: Path, step: int, ckpt: Path) -> Path:
    """A checkpoint renamed to a hidden name before it is deleted: a reader listing the run (eval or
    chat on it while it trains) sees it whole or not at all, never half removed (rmtree takes seconds)."""
    hidden = staging_path(run_dir, step, f"old-{os.getpid()}")
    shutil.rmtree(hidden, ignore_errors=True)
    os.replace(ckpt, hidden)
    return hidden


def _copy_agent_settings(run_config: Path, dest: Path) -> None:
    """The run's `agent` section (if its config has one) next to the saved model."""
    if not run_config.is_file():
        return
    agent = yaml.safe_load(run_config.read_text()).get("agent")
    if agent is not None:
        dest.write_text(
            "# The agent settings this model was trained with (tirl eval/chat use them by default).\n"
            + yaml.safe_dump(agent, sort_keys=False)
        )


class ForeignToolsError(ConfigError):
    """A model's agent file names tools that are not built in (and the user's settings do not)."""


def saved_agent_settings(
    model_path: str | Path, trusted_tools: Collection[str] = ()
) -> tuple[AgentConfig, Path] | None:
    """The agent settings saved with a model (and their file), or None for a model tirl did not train.

    A model directory may come from a stranger, so its agent file may name built-in tools only: a
    `module:attr` tool would be imported, running that module's import-time code. One the user's own
    config names too (`trusted_tools`) is theirs to trust; any other is refused before anything loads."""
    path = Path(model_path) / AGENT_FILE
    if not path.is_file():
        return None
    data = read_yaml(path)
    tools = data.get("tools")
    if isinstance(tools, list):
        foreign = [
            t for t in tools if not (isinstance(t, str) and t in BUILTIN_TOOLS) and t not in trusted_tools
        ]
        if foreign:
            raise ForeignToolsError(
                f"{path} names tools that are not built in: {', '.join(map(repr, foreign))}. An agent file "
                "saved with a model may name built-in tools only (loading one would import its module); if "
                "you trust it, name the tools in your own agent settings (--agent FILE or agent.tools)"
            )
    return validate(AgentConfig, data, f" in {path}"), path


# What the model sees of the agent settings: its prompt (system and user text, tools and their schemas,
# template, prefills) and the shape of tool responses. Budgets and sampling may differ without harm.
PROMPT_FIELDS = (
    "system_prompt", "user_prompt", "tools", "tool_schema", "prefill", "continue_prefill",
    "use_chat_template", "show_exec_time", "tool_output_max_chars", "stop_at_tool_call",
)  # fmt: skip


def agent_settings_warning(model_path: str | Path, agent: AgentConfig) -> str | None:
    """A warning when `agent` changes what a tirl-trained model saw in training (its prompt, its tools):
    a model follows the protocol it learned, so e.g. a tool it never saw raises its tool-error rate."""
    try:
        saved = saved_agent_settings(model_path, trusted_tools=agent.tools)
    except ForeignToolsError as e:  # the model was trained with tools these settings do not give it
        return f"warning: the agent file saved with the model was not loaded: {e}"
    if saved is None:
        return None
    trained, path = saved
    changed = [k for k in PROMPT_FIELDS if getattr(trained, k) != getattr(agent, k)]
    if not changed:
        return None
    shown = ", ".join(f"{k}: {_short(getattr(trained, k))} -> {_short(getattr(agent, k))}" for k in changed)
    return (
        f"warning: these agent settings differ from the ones the model was trained with ({path}): {shown}; "
        "the model's prompt changes and it may follow it badly (see docs/commands.md, agent settings)"
    )


def _short(value: object, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def load_trainer_state(ckpt: Path) -> dict:
    """The small trainer state (counters, schedule, RNG, sampler), plus `checkpoint`: the directory, whose
    shards/ each rank reads its own part of the weights and optimizer from (tirl.rl.policy).

    Loaded with weights_only=True: tensors and plain values, never code. A file that needs more (any
    checkpoint tirl wrote before this rule, or one made to run code) is refused with the one command
    that converts a trusted one."""
    path = Path(ckpt) / "trainer_state.pt"
    if not path.is_file():
        raise FileNotFoundError(f"{ckpt} is not a tirl checkpoint (no trainer_state.pt)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointRefused(_refusal(ckpt, unsafe_reason(e))) from None
    if not isinstance(state, dict) or "optimizer" in state:  # the full optimizer state: no shards/
        raise CheckpointRefused(_refusal(ckpt, "it is in the format from before sharded checkpoints"))
    return state | {"checkpoint": str(ckpt)}


def _refusal(ckpt: Path, why: str) -> str:
    return (
        f"checkpoint {ckpt}: refused: {why}. A checkpoint written by an older tirl looks like this: if "
        f"you trust it (you or tirl wrote it), convert it once with `tirl convert-checkpoint {ckpt}`"
    )


def latest_model_dir(run_dir: Path) -> Path:
    """The HF model directory of a run's newest checkpoint (what `tirl train model=...` takes)."""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise FileNotFoundError(f"no checkpoint under {run_dir}/checkpoints")
    return checkpoint_model_dir(ckpt)


def checkpoint_model_dir(ckpt: Path) -> Path:
    """A checkpoint's plain HF model: its model/, or for a LoRA checkpoint (adapter/ + the base it
    names) the adapter merged into its base, written once to merged/ beside it (tirl.rl.lora)."""
    from tirl.rl.lora import ADAPTER_DIR, is_adapter_dir, merged_model_dir

    ckpt = Path(ckpt)
    if not (ckpt / "model").is_dir() and is_adapter_dir(ckpt / ADAPTER_DIR):
        return merged_model_dir(ckpt)
    return ckpt / "model"


@dataclass(frozen=True)
class LocalModel:
    """What a local directory holds: a plain HF model, or a peft adapter (bare, or in a LoRA checkpoint,
    whose merge goes to <checkpoint>/merged)."""

    model: Path | None = None
    adapter: Path | None = None
    checkpoint: Path | None = None


def locate_model(path: Path) -> LocalModel | None:
    """The one reading of a local model path: a run means its newest checkpoint; a checkpoint its model/
    (which wins) or adapter/; a peft adapter directory (adapter_config.json, no config.json) itself; a
    model directory itself. None when it is none of them."""
    from tirl.rl.lora import ADAPTER_DIR, is_adapter_dir, is_model_dir

    if (path / "checkpoints").is_dir():
        ckpt = latest_checkpoint(path)
        if ckpt is None:
            raise FileNotFoundError(f"no checkpoint under {path}/checkpoints")
        path = ckpt
    if is_model_dir(path / "model"):
        return LocalModel(model=path / "model")
    if is_adapter_dir(path / ADAPTER_DIR):
        return LocalModel(adapter=path / ADAPTER_DIR, checkpoint=path)
    if is_adapter_dir(path) and not is_model_dir(path):
        return LocalModel(adapter=path)
    return LocalModel(model=path) if is_model_dir(path) else None


def resolve_model_path(path: str) -> str:
    """A local path (see `locate_model`) as a plain HF model directory, merging a LoRA adapter on first
    use; a Hugging Face id (org/name) is returned as given. A local path that does not exist is a
    FileNotFoundError here, not a hub lookup that fails (offline) after retries."""
    from tirl.rl.lora import merged_adapter_dir, merged_model_dir

    p = Path(path).expanduser()
    if p.is_dir():
        found = locate_model(p)
        if found is None:
            raise FileNotFoundError(
                f"model {path}: not a model directory (no config.json), run or checkpoint"
            )
        if found.model is not None:
            return str(found.model)
        return str(
            merged_model_dir(found.checkpoint) if found.checkpoint else merged_adapter_dir(found.adapter)
        )
    if p.is_file():  # not a hub id either: transformers would read it as a config.json
        raise FileNotFoundError(
            f"model {path}: a file, not a directory; give a model directory (`tirl model init --out DIR` "
            "makes a tiny one), a tirl run or checkpoint directory, or a Hugging Face id (org/name)"
        )
    parts = Path(path).parts
    if path.startswith((".", "/", "~")) or len(parts) > 2 or (len(parts) == 2 and Path(parts[0]).is_dir()):
        raise FileNotFoundError(
            f"model {path}: no such directory; give a model directory (`tirl model init --out DIR` makes a "
            "tiny one), a tirl run or checkpoint directory, or a Hugging Face id (org/name)"
        )
    return path


def export_model(source: str | Path, out: str | Path) -> str:
    """`tirl export`: a plain Hugging Face model directory at `out` (with its tokenizer and agent
    settings) from a run (its newest checkpoint), a checkpoint, a peft adapter directory (merged into
    the base it names) or a model directory (copied). An existing model directory at `out` is replaced;
    any other non-empty one is refused. Returns what was done, in one line."""
    from tirl.rl.lora import adapter_base, build_dir, is_model_dir, merge_adapter
    from tirl.rl.model_files import check_links, copy_model_dir

    src, out = Path(source).expanduser(), Path(out).expanduser()
    if not src.is_dir():
        raise FileNotFoundError(
            f"model {source}: no such directory; give a tirl run, checkpoint, peft adapter or model directory"
        )
    try:
        found = locate_model(src)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"model {source}: {e}") from None
    if found is None:
        raise FileNotFoundError(
            f"model {source}: not a tirl run, checkpoint, peft adapter or model directory "
            "(no model/, adapter/, config.json or adapter_config.json)"
        )
    if src.resolve() == out.resolve() or out.resolve() in src.resolve().parents:
        raise FileExistsError(f"--out {out}: it holds the model being exported; choose another directory")
    replaced = " (replacing the model that was there)" if is_model_dir(out) else ""
    if found.adapter is not None:
        merge_adapter(found.adapter, out, replace=True)
        return f"wrote {out}{replaced}: the adapter {found.adapter} merged into its base {adapter_base(found.adapter)}"
    model = found.model
    check_links(model, "model")  # refused before --out is touched
    build_dir(out, lambda tmp: copy_model_dir(model, tmp), replace=True)
    return f"wrote {out}{replaced}: a copy of {model}"


def prepare_run_dir(
    run_dir: Path, cfg: BaseModel, resume: bool, is_main: bool, say: Callable[[str], object] = print
) -> Path | None:
    """The checkpoint to resume from (or None); refuses to silently overwrite a previous run.

    A run stopped before its first checkpoint has nothing to resume: with or without --resume it starts
    over in the same directory (its partial metrics are dropped)."""
    run_dir = Path(run_dir)
    refuse_outside_links(run_dir)
    ckpt = latest_checkpoint(run_dir)
    if resume and ckpt is not None:
        say(f"resuming {run_dir} from {ckpt.name} (step {int(STEP_DIR.match(ckpt.name).group(1))})")
        return ckpt
    if ckpt is not None:
        raise ConfigError(
            f"{run_dir} already holds a run: pass --resume to continue it, or choose another run_name/output_dir"
        )
    started = [name for name in RUN_FILES if (run_dir / name).exists()]
    if resume and not started:
        raise ConfigError(f"--resume: no checkpoint and no run in {run_dir}; start without --resume")
    if started:
        say(f"{run_dir} was stopped before its first checkpoint: starting it over from step 0")
    if is_main:
        for name in started:
            path = run_dir / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        ensure_writable_dir(run_dir, "run directory (output_dir/run_name)", private=True)
        dump_config(cfg, run_dir / "config.yaml")
    return None


def refuse_outside_links(run_dir: Path) -> None:
    """A run directory someone shared may hold `metrics.jsonl -> ~/.bashrc`: training appends to,
    truncates and replaces its files, so a link leading outside the run is refused before any write."""
    if not run_dir.is_dir():
        return
    found = outside_links(run_dir)
    if found:
        raise ConfigError(
            f"run directory {run_dir}: {outside_link_message(run_dir, found, 'the run')}; training writes "
            "the run's files in place and would write there: remove the link (to keep a run on another "
            "disk, set output_dir there or link the run directory itself)"
        )


def read_saved_training_state(ckpt: Path) -> dict:
    """A checkpoint's sharded weights and optimizer state gathered into one dict, {"model": ...,
    "optim": {"state": {name: {...}}, "param_groups": [...]}}, in this process (for inspection and
    tests; training itself reads only its own shards)."""
    state: dict = {}
    load_safely(state, Path(ckpt) / "shards", no_dist=True)
    return state
