"""Integer-answer filter, dedup with conflict reports, 8-gram decontamination, and `tirl data prepare`."""

import json

import pytest
from typer.testing import CliRunner

from tirl.cli import app
from tirl.data import Problem, decontaminate, deduplicate, filter_integer_answers, integer_answer, ngrams

AIME_STYLE = "Let $S$ be the set of lattice points inside the circle of radius seven centered at the origin"


@pytest.mark.parametrize(
    ("answer", "value"),
    [
        ("025", 25),
        ("-3", -3),
        ("1,000", 1000),
        ("$12$", 12),
        ("\\boxed{7}", 7),
        (" 42 ", 42),
        ("\\frac{1}{2}", None),
        ("3.5", None),
        ("12.0", None),
        ("1,2", None),
        ("x", None),
        ("", None),
    ],
)
def test_integer_answer(answer, value):
    assert integer_answer(answer) == value


def test_filter_integer_answers_and_digits():
    problems = [
        Problem(str(i), f"p{i}", a) for i, a in enumerate(["025", "\\sqrt{2}", "1" * 13, "1" * 12, "7"])
    ]
    kept, dropped = filter_integer_answers(problems, max_digits=12)
    assert [(p.id, p.answer) for p in kept] == [("0", "25"), ("3", "1" * 12), ("4", "7")]
    assert kept[0].meta == {"raw_answer": "025"}
    assert dropped == {"non_integer_answer": 1, "answer_over_12_digits": 1}


def test_dedup_keeps_first_and_reports_conflicts():
    problems = [
        Problem("a", "Find  X.", "3"),
        Problem("b", "find x.", "03"),  # same text (normalized), same answer
        Problem("c", "Find Y.", "1"),
        Problem("d", "find y.", "2"),  # same text, different answer: both dropped
        Problem("e", "Find Z.", "5"),
    ]
    kept, dropped, conflicts = deduplicate(problems)
    assert [p.id for p in kept] == ["a", "e"]
    assert dropped == {"duplicate": 1, "conflicting_answers": 2}
    assert [[p.id for p in c] for c in conflicts] == [["c", "d"]]


def test_ngrams_normalize():
    assert ngrams("A, b; C", n=2) == {("a", "b"), ("b", "c")}
    assert ngrams("two words", n=8) == {("two", "words")}  # shorter than n: the whole text


def test_decontaminate_8gram():
    bench = [Problem("b", AIME_STYLE + ". How many points are there?", "149")]
    train = [
        Problem("copy", "Rephrased: " + AIME_STYLE.upper() + "!! Count them.", "149"),  # shares 8-grams
        Problem("seven", "Let S be the set of integer points in a square of side 9.", "81"),  # 6 words shared
        Problem("other", "Compute the sum of the divisors of 100.", "217"),
    ]
    kept, dropped = decontaminate(train, bench)
    assert [p.id for p in dropped] == ["copy"]
    assert [p.id for p in kept] == ["seven", "other"]


def test_decontaminate_ignore_common_boilerplate():
    boiler = "where m and n are relatively prime positive integers find m+n"
    bench = [Problem("b", f"The probability is m/n {boiler}.", "7")]
    train = [Problem(str(i), f"Roll {i} dice; the chance is m/n {boiler}.", "1") for i in range(4)]
    assert len(decontaminate(train, bench)[1]) == 4  # the paper's literal rule
    assert decontaminate(train, bench, ignore_common=3)[1] == []  # boilerplate shared by 4 > 3 problems


def test_prepare_cli(tmp_path):
    rows = [
        {"id": "t1", "problem": "Compute 2+3.", "answer": "5"},
        {"id": "t2", "problem": "compute 2+3.", "answer": "5"},
        {"id": "t3", "problem": "Simplify sqrt 8.", "answer": "2\\sqrt{2}"},
        {"id": "t4", "problem": AIME_STYLE + ". Count.", "answer": "149"},
        {"id": "t5", "problem": "Big.", "answer": "12345678901234"},
    ]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"problem": AIME_STYLE + "?", "answer": "149"}) + "\n")
    out = tmp_path / "clean.jsonl"
    result = CliRunner().invoke(
        app,
        [
            "data",
            "prepare",
            "--input",
            str(train),
            "--decontaminate-against",
            str(bench),
            "--out",
            str(out),
            "--max-digits",
            "10",
        ],
    )
    assert result.exit_code == 0, result.output
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["t1"]
    for reason in ["duplicate", "non_integer_answer", "answer_over_10_digits", "8-gram overlap"]:
        assert reason in result.output
    assert "read 5 problems, kept 1" in result.output


def test_prepare_cli_bad_input(tmp_path):
    result = CliRunner().invoke(
        app, ["data", "prepare", "--input", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o.jsonl")]
    )
    assert result.exit_code != 0
    assert "no such file" in result.output
    assert not (tmp_path / "o.jsonl").exists()


def test_prepare_cli_output_must_be_jsonl(tmp_path):
    train = tmp_path / "t.jsonl"
    train.write_text(json.dumps({"problem": "p", "answer": "1"}) + "\n")
    result = CliRunner().invoke(
        app, ["data", "prepare", "--input", str(train), "--out", str(tmp_path / "o.parquet")]
    )
    assert result.exit_code == 2 and "name it *.jsonl" in result.output


def test_prepare_cli_prints_what_matched_and_ignores_stock_phrasing_by_default(tmp_path):
    boiler = "where m and n are relatively prime positive integers find m+n"
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"problem": f"The probability is m/n {boiler}.", "answer": "7"}) + "\n")
    rows = [
        {"id": str(i), "problem": f"Roll {i} dice; the chance is m/n {boiler}.", "answer": "1"}
        for i in range(7)
    ]
    rows.append({"id": "leak", "problem": AIME_STYLE + ". Count.", "answer": "149"})
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "leaked.jsonl").write_text(json.dumps({"problem": AIME_STYLE + "?", "answer": "149"}) + "\n")
    args = ["data", "prepare", "--input", str(train), "--out", str(tmp_path / "o.jsonl")]
    args += ["--decontaminate-against", str(bench), "--decontaminate-against", str(tmp_path / "leaked.jsonl")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "kept 7" in result.output  # the boilerplate (in 7 > 5 problems) is ignored, the leak is not
    assert "ignored 8 common n-grams (in > 5 training problems" in result.output
    assert "     7  and n are relatively prime positive integers find" in result.output
    assert (
        "n-grams that dropped training problems" in result.output and "1  let s be the set" in result.output
    )
    literal = CliRunner().invoke(app, [*args, "--ignore-common", "0"])
    assert literal.exit_code == 0 and "kept 0" in literal.output  # the paper's rule drops them all


def test_prepare_cli_rejects_empty_files_and_bad_numbers(tmp_path):
    train = tmp_path / "t.jsonl"
    train.write_text(json.dumps({"problem": "p", "answer": "1"}) + "\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    base = ["data", "prepare", "--out", str(tmp_path / "o.jsonl")]
    cases = [
        (["--input", str(empty)], "empty.jsonl: holds no problems"),
        (["--input", str(train), "--decontaminate-against", str(empty)], "empty.jsonl: holds no problems"),
        (["--input", str(train), "--ngram", "0"], "--ngram"),
        (
            ["--input", str(train), "--decontaminate-against", "aime24", "--data-dir", str(tmp_path)],
            f"aime24: no local copy ({tmp_path / 'aime2024.jsonl'} does not exist)",
        ),
    ]
    for args, message in cases:
        result = CliRunner().invoke(app, [*base, *args])
        assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "o.jsonl").exists()
