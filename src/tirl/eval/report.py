"""Evaluation results: per-benchmark metrics, a markdown report, metrics.json and every trajectory as JSONL."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tirl.agent.trajectory import Trajectory
from tirl.eval.metrics import BenchmarkMetrics, ProblemResult


@dataclass
class BenchmarkResult:
    metrics: BenchmarkMetrics
    problems: list[ProblemResult]
    trajectories: list[list[Trajectory]]  # [problem][sample]


@dataclass
class EvalReport:
    benchmarks: dict[str, BenchmarkResult]
    config: dict = field(default_factory=dict)  # what produced it (model, sampling, agent settings)
    reward_stats: dict = field(default_factory=dict)
    seconds: float = 0.0  # generating and scoring the trajectories
    # From `tirl eval`'s run_eval start to the report, start-up included (the model's load, the engines,
    # the sandbox, the reward workers); 0 when not measured (the demo's evaluations share a runtime).
    total_seconds: float = 0.0

    @property
    def metrics(self) -> dict[str, BenchmarkMetrics]:
        return {name: b.metrics for name, b in self.benchmarks.items()}

    def to_dict(self) -> dict:
        return {
            "benchmarks": {name: m.to_dict() for name, m in self.metrics.items()},
            "config": self.config,
            "reward_stats": self.reward_stats,
            "seconds": round(self.seconds, 2),
            "total_seconds": round(self.total_seconds, 2),
        }

    def to_markdown(self) -> str:
        ms = list(self.metrics.values())
        k = max((m.samples for m in ms), default=0)
        ks = sorted({kk for m in ms for kk in m.pass_at if kk > 1})
        head = [
            "benchmark",
            "problems",
            f"avg@{k} pass@1",
            *(f"pass@{kk}" for kk in ks),
            f"maj@{k}",
            "response tokens",
            "generated tokens",
            "turns",
            "tool calls",
            "tool error rate",
            "no answer",
        ]
        rows = [
            [
                m.name,
                str(m.problems),
                _pct(m.pass1),
                *(_pct(m.pass_at[kk]) if kk in m.pass_at else "-" for kk in ks),
                _pct(m.maj),
                f"{m.mean_response_tokens:.0f}",
                f"{m.mean_generated_tokens:.0f}",
                f"{m.mean_turns:.2f}",
                f"{m.tool_calls_per_trajectory:.2f}",
                _pct(m.tool_error_rate),
                _pct(m.no_answer_rate),
            ]
            for m in ms
        ]
        lines = ["# Evaluation report", "", _table(head, rows), "", "## Finish reasons", ""]
        reasons = sorted({r for m in ms for r in m.finish_reasons})
        lines.append(
            _table(
                ["benchmark", *reasons],
                [[m.name, *(str(m.finish_reasons.get(r, 0)) for r in reasons)] for m in ms],
            )
        )
        if self.config:
            scalars = {key: value for key, value in self.config.items() if not isinstance(value, dict)}
            lines += ["", "## Setup", ""] + [f"- {key}: `{value}`" for key, value in scalars.items()]
        if self.reward_stats:
            lines += ["", answer_checks(self.reward_stats)]
        lines += ["", self._wall_time(), ""]
        return "\n".join(lines)

    def _wall_time(self) -> str:
        if not self.total_seconds:
            return f"Wall time: {self.seconds:.1f} s generating and scoring (start-up not counted)."
        return (
            f"Wall time: {self.total_seconds:.1f} s in all: {self.total_seconds - self.seconds:.1f} s "
            f"starting up (model, engines, sandbox, reward workers), {self.seconds:.1f} s generating and scoring."
        )

    def write(self, out_dir: str | Path) -> Path:
        """Write report.md, metrics.json and trajectories.jsonl (one line per trajectory) to out_dir."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.md").write_text(self.to_markdown())
        (out / "metrics.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        with (out / "trajectories.jsonl").open("w", encoding="utf-8") as f:
            for name, bench in self.benchmarks.items():
                for result, group in zip(bench.problems, bench.trajectories, strict=True):
                    for j, traj in enumerate(group):
                        record = {
                            "benchmark": name,
                            "problem": result.problem,
                            "reference": result.reference,
                            "answer": result.answers[j],
                            "majority": j == result.majority,
                            **traj.to_dict(),
                        }
                        f.write(json.dumps(record, ensure_ascii=False) + "\n")
        return out

    @classmethod
    def read(cls, out_dir: str | Path) -> EvalReport:
        """The report `write` left in out_dir: metrics, per-problem results and every trajectory (a demo
        resumed after its evaluation reports from these instead of evaluating again)."""
        out = Path(out_dir)
        saved = json.loads((out / "metrics.json").read_text())
        records = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines() if line]
        benchmarks = {}
        for name, raw in saved["benchmarks"].items():
            metrics = BenchmarkMetrics(**raw | {"pass_at": {int(k): v for k, v in raw["pass_at"].items()}})
            problems, groups = _problem_groups([r for r in records if r["benchmark"] == name])
            benchmarks[name] = BenchmarkResult(metrics, problems, groups)
        return cls(
            benchmarks,
            saved["config"],
            saved["reward_stats"],
            saved["seconds"],
            saved.get("total_seconds", 0.0),
        )


def answer_checks(stats: dict) -> str:
    """The reward pool's counters (tirl.reward.RewardStats) in words. Its `fast` and `verified` count
    answer comparisons, not responses: scoring compares each answer with the reference, and maj@k
    compares the answers of a problem with each other, so together they may exceed the responses."""
    fast, verified = stats.get("fast", 0), stats.get("verified", 0)
    failures = ", ".join(f"{stats.get(k, 0)} {k.replace('_', ' ')}" for k in ("timeouts", "killed", "errors"))
    return (
        f"Answer checks: {stats.get('responses', 0)} responses scored ({stats.get('no_answer', 0)} without a "
        f"boxed answer); {fast + verified} answer comparisons (scores and maj@k's grouping): {fast} decided as "
        f"plain integers, {verified} by math-verify in {_number(float(stats.get('verify_s', 0.0)))} s "
        f"({failures})."
    )


def _number(x: object) -> str:
    """A count as it is, a float (seconds) to 2 decimals: report.md is read by people (metrics.json
    keeps every digit)."""
    return f"{x:.2f}" if isinstance(x, float) else str(x)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}"


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def _problem_groups(records: list[dict]) -> tuple[list[ProblemResult], list[list[Trajectory]]]:
    """One benchmark's trajectory records, in the order `write` gave them, back into problems."""
    problems: list[ProblemResult] = []
    groups: list[list[Trajectory]] = []
    for record in records:
        traj = Trajectory.from_dict(record)
        if not problems or problems[-1].problem_id != traj.problem_id:
            problems.append(
                ProblemResult(traj.problem_id, record["reference"], [], [], problem=record["problem"])
            )
            groups.append([])
        result = problems[-1]
        if record["majority"]:
            result.majority = len(result.answers)
        result.rewards.append(traj.reward)
        result.answers.append(record["answer"])
        groups[-1].append(traj)
    return problems, groups
