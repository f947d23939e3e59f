"""JSON Lines files as the tests write and read them: one JSON object a line."""

from __future__ import annotations

import json
from pathlib import Path


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]
