"""The tiny `tirl train` run the command-line tests start: four "What is i + 1?" problems, one process,
the hf engine on CPU, one turn of 8 tokens, 2 rollouts a step, a checkpoint every step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml


def write_train_config(tmp_path: Path, model_dir: Path, steps: int = 1, **entries: Any) -> Path:
    """tmp_path/train.yaml (its problems in tmp_path/problems.jsonl, its run in tmp_path/runs/r); each
    keyword replaces that top-level entry of the config whole (engine={...}, seed=3, ...)."""
    data = tmp_path / "problems.jsonl"
    data.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "problem": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
            for i in range(4)
        )
    )
    config = {
        "model": str(model_dir),
        "output_dir": str(tmp_path / "runs"),
        "run_name": "r",
        "engine": {"backend": "hf", "device": "cpu", "max_model_len": 1024},
        "agent": {"max_turns": 1, "max_response_tokens": 8},
        "sandbox": {"mode": "inprocess", "slots": 1},
        "reward": {"workers": 1},
        "algorithm": {"prompts_per_step": 1, "group_size": 2},
        "optim": {"device": "cpu"},
        "stages": [{"steps": steps, "data": str(data)}],
        "checkpoint": {"every": 1},
        "logging": {"tensorboard": False},
    }
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config | entries))
    return path
