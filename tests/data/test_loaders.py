"""Loading problems from files and the benchmark registry, with clear errors."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tests.jsonl import write_jsonl

from tirl.data import BENCHMARKS, DataError, load_problems, write_problems


def test_jsonl_field_mapping(tmp_path):
    path = write_jsonl(
        tmp_path / "mixed.jsonl",
        [
            {"id": "a", "problem": "What is 1+1?", "answer": "2", "level": 1},
            {"question": "What is 2+2?", "ground_truth": 4},
            {
                "prompt": [{"role": "system", "content": "x"}, {"role": "user", "content": "3+3?"}],
                "reward_model": {"ground_truth": "6"},
                "data_source": "verl",
            },
        ],
    )
    a, b, c = load_problems(path)
    assert (a.id, a.problem, a.answer, a.source, a.meta) == ("a", "What is 1+1?", "2", "mixed", {"level": 1})
    assert (b.id, b.problem, b.answer) == ("mixed-1", "What is 2+2?", "4")
    assert (c.problem, c.answer, c.source) == ("3+3?", "6", "verl")


def test_parquet_and_limit(tmp_path):
    table = pa.table({"problem": ["p1", "p2", "p3"], "answer": [1, 2, 3], "unique_id": ["u1", "u2", "u3"]})
    pq.write_table(table, tmp_path / "set.parquet")
    problems = load_problems(tmp_path / "set.parquet", limit=2)
    assert [(p.id, p.answer) for p in problems] == [("u1", "1"), ("u2", "2")]


def test_registry_name_resolves_to_local_file(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "aime2024.jsonl", [{"id": "aime2024-I-1", "problem": "p", "answer": "204"}])
    monkeypatch.setenv("TIRL_DATA_DIR", str(tmp_path))
    assert load_problems("aime24")[0].answer == "204"
    assert set(BENCHMARKS) == {"aime24", "aime25", "math500", "hmmt25", "gsm8k"}
    # An explicit data_dir wins over the environment.
    (tmp_path / "d").mkdir()
    write_jsonl(tmp_path / "d" / "math500.jsonl", [{"problem": "p", "answer": "\\frac{1}{2}"}])
    assert load_problems("math500", data_dir=tmp_path / "d")[0].answer == "\\frac{1}{2}"


def test_registry_without_local_file_needs_datasets(tmp_path, monkeypatch):
    monkeypatch.setenv("TIRL_DATA_DIR", str(tmp_path))  # empty: falls through to the Hub
    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(DataError, match="needs the `datasets` package"):
            load_problems("gsm8k")
    else:
        pytest.skip("datasets is installed; the Hub path needs network")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"problem": "p", "answer": "1"}\n{"problem": "q", "answer": \n', r"bad\.jsonl:2: not valid JSON"),
        ('{"problem": "p", "answer": "1"}\n[1, 2]\n', r"bad\.jsonl:2: expected a JSON object"),
        ('{"problem": "p"}\n', r"record 1: no answer \(looked for answer, ground_truth"),
        ('{"answer": "3", "text": "x"}\n', r"record 1: no problem text .* has \['answer', 'text'\]"),
    ],
)
def test_malformed_files_say_where(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match=message):
        load_problems(path)


def test_unknown_names(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_problems(tmp_path / "missing.jsonl")
    with pytest.raises(DataError, match="not a file, a known benchmark"):
        load_problems("aime2099")


def test_write_roundtrip(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [{"id": "x", "problem": "p", "answer": "7", "level": 3}])
    problems = load_problems(path)
    assert write_problems(tmp_path / "out" / "o.jsonl", problems) == 1
    assert load_problems(tmp_path / "out" / "o.jsonl") == problems
    assert load_problems(tmp_path / "out" / "o.jsonl")[0].meta == {"level": 3}
