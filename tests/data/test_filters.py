"""Integer-answer filter, dedup with conflict reports, 8-gram decontamination, and `tirl data prepare`;
then their boundaries (see docs/mutation.md)."""

import json
from collections import Counter

import pytest
from typer.testing import CliRunner

from tirl.cli import app
from tirl.data import Problem, decontaminate, deduplicate, filter_integer_answers, integer_answer, ngrams
from tirl.data.decontaminate import (
    IGNORE_COMMON,
    NGRAM,
    Contamination,
    benchmark_ngrams,
    find_contamination,
    words,
)
from tirl.data.filters import normalize_text

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


# ---- boundaries: signed and wrapped integers, the digit limit, metadata kept, dedup's answer keys,
# the n-gram window, and the common-n-gram threshold at exactly K ----


@pytest.mark.parametrize(
    ("answer", "value"),
    [
        ("+5", 5),
        ("-0", 0),
        ("-12", -12),
        ("-1,234", -1234),
        ("$$12$$", 12),
        ("\\boxed{-4}", -4),
        ("$\\boxed{7}$", 7),
        ("\\boxed{$8$}", 8),
        ("\\boxed{}", None),
        ("$$", None),
        ("--3", None),
        ("1,0000", None),
        ("12,345,678", 12345678),
        ("7x", None),
        ("x7", None),
        ("1 000", None),
    ],
)
def test_integer_answer_edges(answer, value):
    assert integer_answer(answer) == value


def test_the_digit_limit_counts_digits_not_the_sign():
    problems = [Problem("neg12", "p", "-" + "9" * 12), Problem("neg13", "q", "-" + "9" * 13)]
    kept, dropped = filter_integer_answers(problems)  # the default limit: 12 digits
    assert [p.id for p in kept] == ["neg12"] and kept[0].answer == "-" + "9" * 12
    assert dict(dropped) == {"answer_over_12_digits": 1}
    kept, dropped = filter_integer_answers(problems, max_digits=13)
    assert [p.id for p in kept] == ["neg12", "neg13"] and dict(dropped) == {}


def test_a_kept_problem_keeps_its_fields_and_metadata():
    problems = [
        Problem("a", "text a", "-3", "src", {"level": 5}),
        Problem("b", "text b", "$-03$", "src2", {"level": 1}),
        Problem("c", "text c", "x", "src3"),
    ]
    kept, dropped = filter_integer_answers(problems, max_digits=3)
    assert kept[0] == Problem("a", "text a", "-3", "src")
    assert kept[0].meta == {"level": 5}  # canonical already: no raw_answer (meta is not compared by ==)
    assert kept[1] == Problem("b", "text b", "-3", "src2")
    assert kept[1].meta == {"level": 1, "raw_answer": "$-03$"}
    assert problems[1].meta == {"level": 1}  # the input is not modified
    assert dict(dropped) == {"non_integer_answer": 1}


def test_normalize_text_lowercases_and_collapses_whitespace():
    assert normalize_text("  Find\tX\n  NOW ") == "find x now"


def test_dedup_without_duplicates_reports_nothing():
    problems = [Problem("a", "one", "1"), Problem("b", "two", "2")]
    kept, dropped, conflicts = deduplicate(problems)
    assert kept == problems and dict(dropped) == {} and conflicts == []


def test_dedup_compares_answers_as_integers_or_normalized_text():
    problems = [
        Problem("a", "Q1", "$-3$"),
        Problem("b", "q1", "-03"),  # the same integer
        Problem("c", "Q2", "\\frac{1}{2}"),
        Problem("d", " q2 ", "\\FRAC{1}{2} "),  # the same text up to case and spaces
        Problem("e", "Q3", "1/2"),
        Problem("f", "q3", "1 / 2"),  # different text: a conflict
        Problem("g", "Q1", "-3"),
    ]
    kept, dropped, conflicts = deduplicate(problems)
    assert [p.id for p in kept] == ["a", "c"]
    assert dict(dropped) == {"duplicate": 3, "conflicting_answers": 2}
    assert [[p.id for p in c] for c in conflicts] == [["e", "f"]]


def test_words_and_ngram_windows():
    assert words("Let $x^2$ BE 3,5!") == ["let", "x", "2", "be", "3", "5"]
    assert NGRAM == 8 and IGNORE_COMMON == 5
    nine = " ".join(f"w{i}" for i in range(9))
    assert ngrams(nine) == {tuple(f"w{i}" for i in range(8)), tuple(f"w{i}" for i in range(1, 9))}
    eight = " ".join(f"w{i}" for i in range(8))
    assert ngrams(eight) == {tuple(f"w{i}" for i in range(8))}
    assert ngrams("a b c", n=1) == {("a",), ("b",), ("c",)}
    assert ngrams("a b c", n=3) == {("a", "b", "c")}
    assert ngrams("") == set() and ngrams("!!! ...") == set()


def test_benchmark_ngrams_unite_every_problem():
    bench = [Problem("1", "a b c", "1"), Problem("2", "c d", "2")]
    assert benchmark_ngrams(bench, n=2) == {("a", "b"), ("b", "c"), ("c", "d")}
    assert benchmark_ngrams([], n=2) == set()


def test_ngram_length_must_be_positive():
    with pytest.raises(ValueError) as err:
        find_contamination([], [], n=0)
    assert str(err.value) == "n-gram length must be >= 1, got 0"
    assert find_contamination([Problem("x", "a", "1")], [Problem("b", "a", "1")], n=1).dropped[0].id == "x"


def test_common_ngrams_are_ignored_only_above_k():
    bench = [Problem("b", "alpha beta gamma delta", "1")]
    train = [Problem(str(i), f"p{i} alpha beta gamma", "1") for i in range(3)]  # 3 share the 3-gram
    train.append(Problem("leak", "gamma delta", "1"))
    at_k = find_contamination(train, bench, n=3, ignore_common=3)  # shared by exactly K = 3: a leak
    assert [p.id for p in at_k.dropped] == ["0", "1", "2"] and [p.id for p in at_k.kept] == ["leak"]
    assert at_k.ignored == Counter()
    assert at_k.matched == Counter({("alpha", "beta", "gamma"): 3})
    above = find_contamination(train, bench, n=3, ignore_common=2)  # 3 > 2: stock phrasing
    assert above.dropped == [] and len(above.kept) == 4
    assert above.ignored == Counter({("alpha", "beta", "gamma"): 3}) and above.matched == Counter()
    # "gamma delta" is shorter than 3 words: one 2-gram, not one of the benchmark's 3-grams
    assert decontaminate(train, bench, n=3, ignore_common=2) == (above.kept, [])
    assert decontaminate(train, bench, n=2, ignore_common=None)[1] == train


def test_matched_counts_each_gram_once_per_dropped_problem():
    bench = [Problem("b", "x y z", "1")]
    train = [Problem("1", "x y z x y", "1"), Problem("2", "y z", "1"), Problem("3", "q r", "1")]
    found = find_contamination(train, bench, n=2)
    assert isinstance(found, Contamination)
    assert found.matched == Counter({("x", "y"): 1, ("y", "z"): 2})
    assert [p.id for p in found.kept] == ["3"] and found.ignored == Counter()


def test_conflicts_of_several_texts_are_all_counted():
    problems = [
        Problem("a", "Q1", "1"),
        Problem("b", "q1", "2"),
        Problem("c", "Q2", "3"),
        Problem("d", "q2", "4"),
        Problem("e", "Q2 ", "5"),
    ]
    kept, dropped, conflicts = deduplicate(problems)
    assert kept == [] and dict(dropped) == {"conflicting_answers": 5}
    assert [[p.id for p in c] for c in conflicts] == [["a", "b"], ["c", "d", "e"]]


def test_every_dropped_problem_is_counted():
    problems = [Problem(str(i), "p", a) for i, a in enumerate(["x", "y", "1" * 20, "1" * 20, "1" * 20, "3"])]
    kept, dropped = filter_integer_answers(problems)
    assert [p.id for p in kept] == ["5"]
    assert dict(dropped) == {"non_integer_answer": 2, "answer_over_12_digits": 3}
