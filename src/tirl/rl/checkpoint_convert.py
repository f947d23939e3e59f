"""`tirl convert-checkpoint`: a checkpoint an older tirl wrote, rewritten so that it loads safely.

Checkpoints load without unpickling arbitrary objects (tirl.rl.checkpoint.load_trainer_state,
tirl.distributed.checkpoint_reader). Older ones do not pass: their trainer_state.pt holds numpy's RNG
key as an ndarray (a pickled numpy object), and those from before sharded checkpoints hold the whole
optimizer state in it. This module is the one place tirl unpickles a checkpoint file with any object
allowed, so it says first that it trusts the file: unpickling runs whatever the file names.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from tirl.rl.checkpoint import list_checkpoints, load_trainer_state

TRUST = (
    "warning: converting {path} trusts it: unpickling it runs any code it names. Convert only "
    "checkpoints you or tirl wrote."
)


def convert_checkpoints(path: str | Path, say: Callable[[str], object] = print) -> list[Path]:
    """Convert a run's every checkpoint, or one checkpoint directory; returns the ones rewritten (a
    checkpoint that already loads safely is left as it is)."""
    path = Path(path).expanduser()
    if (path / "checkpoints").is_dir():
        found = [ckpt for _, ckpt in list_checkpoints(path)]
        if not found:
            raise FileNotFoundError(f"no checkpoint under {path}/checkpoints")
    elif (path / "trainer_state.pt").is_file():
        found = [path]
    else:
        raise FileNotFoundError(f"{path}: not a tirl run or checkpoint directory (no trainer_state.pt)")
    return [ckpt for ckpt in found if _convert(ckpt, say)]


def _loads_safely(ckpt: Path) -> bool:
    try:
        load_trainer_state(ckpt)
    except ValueError:  # CheckpointRefused
        return False
    return True


def _convert(ckpt: Path, say: Callable[[str], object]) -> bool:
    if _loads_safely(ckpt):
        return False
    state_file = ckpt / "trainer_state.pt"
    say(TRUST.format(path=state_file))
    state = torch.load(state_file, map_location="cpu", weights_only=False)  # trusted: see TRUST
    if "optimizer" in state:  # from before sharded checkpoints
        _write_shards(ckpt, state.pop("optimizer"))
    state["rng"] = plain_rng(state["rng"])
    tmp = state_file.with_name(f".{state_file.name}.{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, state_file)
    load_trainer_state(ckpt)  # the converted file passes the safe load
    say(f"converted {ckpt}")
    return True


def plain_rng(rng: dict) -> dict:
    """An RNG state of tirl.rl.checkpoint.rng_states with numpy's key array as a list."""
    numpy = rng.get("numpy")
    if numpy is not None and isinstance(numpy[1], np.ndarray):
        rng = {**rng, "numpy": (numpy[0], numpy[1].tolist(), *numpy[2:])}
    return rng


def _write_shards(ckpt: Path, optimizer_state: dict) -> None:
    """shards/ of a checkpoint from before sharded checkpoints: its model/ weights and the full AdamW
    state it pickled, written as a sharded checkpoint of one process (any world size reads it)."""
    from transformers import AutoModelForCausalLM

    from tirl.distributed.groups import save_sharded

    model = AutoModelForCausalLM.from_pretrained(ckpt / "model", dtype=torch.float32)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    optimizer.load_state_dict(optimizer_state)
    save_sharded(ckpt / "shards", model, optimizer)
