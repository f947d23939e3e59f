"""`tirl data prepare`: training files -> one clean JSONL (integer answers, deduplicated, decontaminated)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tirl.data.decontaminate import IGNORE_COMMON, NGRAM, find_contamination
from tirl.data.filters import deduplicate, filter_integer_answers
from tirl.data.loaders import DataError, load_problems
from tirl.data.problem import Problem


@dataclass
class PrepareResult:
    problems: list[Problem]
    read: int
    dropped: Counter = field(default_factory=Counter)  # reason -> count
    conflicts: list[list[Problem]] = field(default_factory=list)  # same text, different answers
    overlaps: list[str] = field(default_factory=list)  # per benchmark: the n-grams that matched, and ignored

    def summary(self) -> str:
        lines = [f"read {self.read} problems, kept {len(self.problems)}"]
        lines += [f"  dropped {count:6d}  {reason}" for reason, count in self.dropped.most_common()]
        for copies in self.conflicts[:10]:
            answers = ", ".join(f"{p.id}={p.answer!r}" for p in copies)
            lines.append(f"  conflicting answers: {answers}")
        if len(self.conflicts) > 10:
            lines.append(f"  ... and {len(self.conflicts) - 10} more texts with conflicting answers")
        return "\n".join(lines + self.overlaps)


def prepare(
    inputs: list[str | Path],
    against: list[str | Path] = (),
    max_digits: int = 12,
    n: int = NGRAM,
    data_dir: str | Path | None = None,
    ignore_common: int | None = IGNORE_COMMON,
) -> PrepareResult:
    """Load, keep integer answers of <= max_digits digits, deduplicate, drop benchmark n-gram overlaps.
    `ignore_common`: see tirl.data.decontaminate (None: the paper's literal rule)."""
    if n < 1:
        raise DataError(f"--ngram {n}: the n-gram length must be >= 1 (the paper: 8)")
    problems = [p for source in inputs for p in _nonempty(source, data_dir)]
    result = PrepareResult(problems=[], read=len(problems))
    problems, dropped = filter_integer_answers(problems, max_digits)
    result.dropped.update(dropped)
    problems, dropped, result.conflicts = deduplicate(problems)
    result.dropped.update(dropped)
    for name in against:
        found = find_contamination(problems, _nonempty(name, data_dir), n, ignore_common)
        problems = found.kept
        if found.dropped:
            result.dropped[f"{n}-gram overlap with {name}"] += len(found.dropped)
        result.overlaps += _overlap_lines(name, found, ignore_common)
    result.problems = problems
    return result


def _nonempty(source: str | Path, data_dir: str | Path | None) -> list[Problem]:
    problems = load_problems(source, data_dir=data_dir)
    if not problems:
        raise DataError(f"{source}: holds no problems")
    return problems


def _overlap_lines(name: str | Path, found, ignore_common: int | None, top: int = 5) -> list[str]:
    lines = []
    if found.matched:
        lines.append(f"{name}: n-grams that dropped training problems (most frequent first):")
        lines += _top(found.matched, top)
    if found.ignored:
        lines.append(
            f"{name}: ignored {len(found.ignored)} common n-grams (in > {ignore_common} training problems; "
            "--ignore-common 0 for the paper's literal rule), e.g.:"
        )
        lines += _top(found.ignored, top)
    return lines


def _top(counts, top: int) -> list[str]:
    """The most frequent n-grams, ties in alphabetical order (the same output on every run)."""
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:top]
    return [f"  {count:6d}  {' '.join(gram)}" for gram, count in ranked]
