"""Load problems from JSONL / Parquet files, Hugging Face datasets, or registry names (aime24, ...)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tirl.data.problem import Problem
from tirl.data.registry import BENCHMARKS, Benchmark, local_file
from tirl.data.registry import data_dir as registry_data_dir

PROBLEM_FIELDS = ("problem", "question", "prompt")
ANSWER_FIELDS = ("answer", "ground_truth", "reward_model.ground_truth")
ID_FIELDS = ("id", "unique_id", "problem_idx", "idx")
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
HF_ID = re.compile(r"[\w.-]+/[\w.-]+")


class DataError(ValueError):
    """Data that cannot be loaded; the message names the file, line or field and what to do."""


def load_problems(
    name_or_path: str | Path,
    limit: int | None = None,
    split: str | None = None,
    data_dir: str | Path | None = None,
) -> list[Problem]:
    """Problems from a file (.jsonl/.json/.parquet), a registry name, or a Hugging Face dataset id.

    A registry name (see tirl.data.registry.BENCHMARKS) is read from `data_dir` / $TIRL_DATA_DIR when
    its file is there, else downloaded from the Hub (needs the optional `datasets` package).
    """
    text = str(name_or_path)
    path = Path(text).expanduser()
    if path.is_file():
        problems = read_file(path)
    elif text in BENCHMARKS:
        problems = _load_benchmark(BENCHMARKS[text], split, data_dir)
    elif path.exists() or path.suffix in FILE_SUFFIXES:
        raise DataError(f"{text}: no such file (expected a {'/'.join(FILE_SUFFIXES)} file)")
    elif HF_ID.fullmatch(text):
        problems = load_hf(text, split=split)
    else:
        raise DataError(
            f"{text!r} is not a file, a known benchmark ({', '.join(BENCHMARKS)}) or a Hugging Face dataset id"
        )
    return problems[:limit] if limit is not None else problems


def read_file(path: str | Path, fields: dict[str, str] | None = None) -> list[Problem]:
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:
            raise DataError(f"{path}: cannot read as Parquet: {e}") from e
        return to_problems(rows, origin=str(path), source=path.stem, fields=fields)
    rows = _read_json_array(path) if path.suffix == ".json" else read_jsonl(path)
    return to_problems(rows, origin=str(path), source=path.stem, fields=fields)


def _read_json_array(path: Path) -> list[dict]:
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from e
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise DataError(
            f"{path}: a .json file must hold a list of objects (use .jsonl for one object per line)"
        )
    return rows


def read_jsonl(path: Path) -> list[dict]:
    """The objects of a JSONL file (blank lines skipped); a bad line is reported with its number."""
    rows = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{number}: not valid JSON ({e.msg}); fix or remove that line") from e
            if not isinstance(row, dict):
                raise DataError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


def load_hf(dataset_id: str, split: str | None = None, benchmark: Benchmark | None = None) -> list[Problem]:
    try:
        import datasets
    except ImportError as e:
        raise DataError(
            f"loading {dataset_id!r} from the Hugging Face Hub needs the `datasets` package: "
            "pip install 'tirl[hf]' (or pass a local .jsonl/.parquet file, or set TIRL_DATA_DIR)"
        ) from e
    config = benchmark.hf_config if benchmark else None
    try:
        loaded = datasets.load_dataset(dataset_id, config)
    except Exception as e:
        raise DataError(
            f"{dataset_id!r} is not a local file and cannot be loaded from the Hugging Face Hub "
            f"({type(e).__name__}: {e}); if you are offline, pass a local file or set TIRL_DATA_DIR"
        ) from e
    split = (
        split
        or (benchmark.split if benchmark else None)
        or ("test" if "test" in loaded else next(iter(loaded)))
    )
    if split not in loaded:
        raise DataError(f"{dataset_id!r} has no split {split!r}; it has: {', '.join(loaded)}")
    fields = benchmark.fields if benchmark else None
    problems = to_problems(loaded[split], origin=f"{dataset_id}[{split}]", source=dataset_id, fields=fields)
    return (
        _answers_after(problems, benchmark.answer_after) if benchmark and benchmark.answer_after else problems
    )


def _load_benchmark(benchmark: Benchmark, split: str | None, data_dir: str | Path | None) -> list[Problem]:
    path = local_file(benchmark, data_dir)
    if path is not None:
        return read_file(path)
    root = registry_data_dir(data_dir)
    where = (
        f"{root / benchmark.filename} does not exist"
        if root
        else "neither --data-dir nor $TIRL_DATA_DIR is set"
    )
    try:
        return load_hf(benchmark.hf_id, split=split, benchmark=benchmark)
    except DataError as e:
        raise DataError(f"{benchmark.name}: no local copy ({where}); and {e}") from e


def _answers_after(problems: list[Problem], marker: str) -> list[Problem]:
    out = []
    for p in problems:
        answer = p.answer.rsplit(marker, 1)[-1].strip().replace(",", "")
        out.append(Problem(p.id, p.problem, answer, p.source, {**p.meta, "solution": p.answer}))
    return out


def to_problems(
    rows: Iterable[dict[str, Any]], origin: str, source: str = "", fields: dict[str, str] | None = None
) -> list[Problem]:
    """Map records to Problems: problem/question/prompt, answer/ground_truth/reward_model.ground_truth, id."""
    fields = fields or {}
    problems = []
    for index, row in enumerate(rows):
        where = f"{origin}: record {index + 1}"
        text = _first(row, [fields["problem"]] if "problem" in fields else PROBLEM_FIELDS)
        answer = _first(row, [fields["answer"]] if "answer" in fields else ANSWER_FIELDS)
        if text is None:
            raise DataError(
                f"{where}: no problem text (looked for {', '.join(PROBLEM_FIELDS)}); has {sorted(row)}"
            )
        if answer is None:
            raise DataError(f"{where}: no answer (looked for {', '.join(ANSWER_FIELDS)}); has {sorted(row)}")
        pid = _first(row, [fields["id"]] if "id" in fields else ID_FIELDS)
        used = {"problem", "answer", "id", "source", *PROBLEM_FIELDS, *ANSWER_FIELDS, *fields.values()}
        meta = {k: v for k, v in row.items() if k not in used}
        problems.append(
            Problem(
                id=str(pid) if pid is not None else f"{source}-{index}",
                problem=_problem_text(text, where),
                answer=str(answer).strip(),
                source=str(row.get("source") or row.get("data_source") or source),
                meta=meta,
            )
        )
    return problems


def _first(row: dict[str, Any], keys: Iterable[str]) -> Any:
    for key in keys:
        value: Any = row
        for part in key.split("."):  # "reward_model.ground_truth" reaches into a nested record
            value = value.get(part) if isinstance(value, dict) else None
        if value is not None and value != "":
            return value
    return None


def _problem_text(value: Any, where: str) -> str:
    if isinstance(value, list):  # chat-format prompts (verl): the last user message is the problem
        users = [m.get("content", "") for m in value if isinstance(m, dict) and m.get("role") == "user"]
        if users:
            return str(users[-1])
        raise DataError(f"{where}: prompt is a list without a user message")
    return str(value)


def write_problems(path: str | Path, problems: Iterable[Problem]) -> int:
    """Write problems as JSONL (id, problem, answer, source, then meta fields); returns the count."""
    path = Path(path)
    if path.suffix != ".jsonl":
        raise DataError(f"{path}: problems are written as JSONL; name the output file *.jsonl")
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with path.open("w", encoding="utf-8") as f:
        for p in problems:
            record = {"id": p.id, "problem": p.problem, "answer": p.answer, "source": p.source, **p.meta}
            f.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
            count += 1
    return count
