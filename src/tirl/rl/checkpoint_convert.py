"""`tirl convert-checkpoint`: a checkpoint an older tirl wrote, rewritten so that it loads safely.

Checkpoints load without unpickling arbitrary objects (tirl.rl.checkpoint.load_trainer_state,
tirl.distributed.checkpoint_reader). Older ones do not pass: their trainer_state.pt holds numpy's RNG
key as an ndarray (a pickled numpy object), and those from before sharded checkpoints hold the whole
optimizer state in it. Both hold only tensors, plain values and numpy arrays, so the converter reads
them with torch's restricted unpickler (weights_only) allowing, beyond its own, only the few numpy
functions that rebuild an array, a dtype or a scalar from bytes: a file that names anything else
(`exec`, `os.system`, any class) is refused with one line naming it, and nothing of it runs. (Before,
the converter unpickled with any object allowed after one warning line.)
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from tirl.distributed.checkpoint_reader import CheckpointRefused, unsafe_reason
from tirl.rl.checkpoint import list_checkpoints, load_trainer_state

# What rebuilds a numpy array, dtype or scalar from its pickled bytes (nothing else runs), under the
# names numpy 1 (`numpy.core`) and numpy 2 (`numpy._core`) write. An object array's elements go through
# the same restricted unpickler.
_MULTIARRAY = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray
NUMPY_GLOBALS = [
    (_MULTIARRAY._reconstruct, "numpy.core.multiarray._reconstruct"),
    (_MULTIARRAY._reconstruct, "numpy._core.multiarray._reconstruct"),
    (_MULTIARRAY.scalar, "numpy.core.multiarray.scalar"),
    (_MULTIARRAY.scalar, "numpy._core.multiarray.scalar"),
    (np.ndarray, "numpy.ndarray"),
    (np.dtype, "numpy.dtype"),
    *((cls, f"numpy.dtypes.{cls.__name__}") for cls in vars(np.dtypes).values() if isinstance(cls, type)),
]


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
    state = load_old_state(state_file)
    if "optimizer" in state:  # from before sharded checkpoints
        _write_shards(ckpt, state.pop("optimizer"))
    state["rng"] = plain_rng(state["rng"])
    tmp = state_file.with_name(f".{state_file.name}.{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, state_file)
    load_trainer_state(ckpt)  # the converted file passes the safe load
    say(f"converted {ckpt}")
    return True


def load_old_state(state_file: Path) -> dict:
    """An old trainer state through the restricted unpickler: tensors, plain values, numpy arrays."""
    try:
        with torch.serialization.safe_globals(NUMPY_GLOBALS):
            state = torch.load(state_file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointRefused(
            f"{state_file}: not converted: {unsafe_reason(e)}. tirl never wrote that into a checkpoint "
            "(its old ones hold tensors, plain values and numpy arrays only): nothing of it was run"
        ) from None
    if not isinstance(state, dict) or "rng" not in state:
        raise CheckpointRefused(f"{state_file}: not converted: it is not a tirl trainer state")
    return state


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
