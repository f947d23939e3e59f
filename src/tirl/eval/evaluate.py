"""Run the agent k times on every problem, score each trajectory as it finishes, aggregate per benchmark."""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from tirl.agent.trajectory import Trajectory
from tirl.config import redacted_dump
from tirl.data.problem import Problem
from tirl.eval.config import EvalConfig
from tirl.eval.metrics import ProblemResult, benchmark_metrics, cluster_answers, majority_vote
from tirl.eval.report import BenchmarkResult, EvalReport
from tirl.reward import extract_answer
from tirl.runtime.base import Runtime, Scorer, generate_scored


async def evaluate(
    rt: Runtime,
    problems: list[Problem] | dict[str, list[Problem]],
    cfg: EvalConfig,
    *,
    progress: bool = True,
    finished: list[Trajectory] | None = None,
) -> EvalReport:
    """Evaluate on one problem list or several named benchmarks (all rolled out together) with the
    runtime's engines, sandbox and scorer. `finished` (if given) receives each trajectory as soon as it
    is scored, so an interrupted run keeps them."""
    benchmarks = problems if isinstance(problems, dict) else {"eval": list(problems)}
    flat = _with_unique_ids(benchmarks)
    started = time.perf_counter()

    with _RunningAccuracy(len(flat) * cfg.samples, enabled=progress) as bar:

        def on_scored(traj: Trajectory) -> None:
            if finished is not None:
                finished.append(traj)
            bar.scored(traj.reward)

        groups = await generate_scored(
            rt, flat, cfg.samples, cfg.agent_config(), cfg.seed, cfg.concurrency, on_scored=on_scored
        )

    reward_pool = rt.scorer
    results = await asyncio.gather(
        *(_problem_result(p, g, reward_pool) for p, g in zip(flat, groups, strict=True))
    )
    report = EvalReport(benchmarks={}, config=redacted_dump(cfg))
    start = 0
    for name, ps in benchmarks.items():
        stop = start + len(ps)
        report.benchmarks[name] = BenchmarkResult(
            metrics=benchmark_metrics(name, results[start:stop], groups[start:stop]),
            problems=list(results[start:stop]),
            trajectories=groups[start:stop],
        )
        start = stop
    report.reward_stats = reward_pool.stats.as_dict()
    report.seconds = time.perf_counter() - started
    return report


async def _problem_result(problem: Problem, group: list[Trajectory], reward_pool: Scorer) -> ProblemResult:
    answers = [extract_answer(t.model_turns) if t.scored else None for t in group]
    labels = await cluster_answers(answers, reward_pool.equivalent)
    return ProblemResult(
        problem_id=problem.id,
        reference=problem.answer,
        rewards=[t.reward for t in group],
        answers=answers,
        majority=majority_vote(labels),
        problem=problem.problem,
    )


def _with_unique_ids(benchmarks: dict[str, list[Problem]]) -> list[Problem]:
    """All problems in order; ids are made unique (`bench/id`, then `#n`) because trajectories key on them."""
    flat = [(name, p) for name, ps in benchmarks.items() for p in ps]
    if len({p.id for _, p in flat}) == len(flat):
        return [p for _, p in flat]
    seen: Counter[str] = Counter()
    unique = []
    for name, p in flat:
        pid = f"{name}/{p.id}"
        seen[pid] += 1
        if seen[pid] > 1:
            pid = f"{pid}#{seen[pid] - 1}"
        unique.append(Problem(pid, p.problem, p.answer, p.source, p.meta))
    return unique


class _RunningAccuracy:
    """A rich progress bar over trajectories that shows the accuracy of those scored so far; when
    stderr is not a terminal (a log file, CI), a plain line at every tenth of the work instead."""

    def __init__(self, total: int, enabled: bool):
        self.correct = self.done = 0
        self.total, self.lines = total, enabled and not Console(stderr=True).is_terminal
        self.started = time.perf_counter()
        self.progress = Progress(
            TextColumn("[bold]eval"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("pass@1 {task.fields[accuracy]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            disable=not enabled or self.lines,
            console=Console(stderr=True),
        )
        self.task = self.progress.add_task("eval", total=total, accuracy="-")

    def __enter__(self) -> _RunningAccuracy:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def scored(self, reward: float) -> None:
        self.done += 1
        self.correct += reward > 0
        if self.lines and (self.done * 10 // self.total > (self.done - 1) * 10 // self.total):
            print(
                f"eval: {self.done}/{self.total} trajectories, pass@1 so far {100 * self.correct / self.done:.1f}%, "
                f"{time.perf_counter() - self.started:.0f} s",
                file=sys.stderr,
                flush=True,
            )
        self.progress.update(self.task, advance=1, accuracy=f"{100 * self.correct / self.done:.1f}%")
