"""The stage-3 hard-problem filter (docs/method.md §4): keep the problems the policy does not solve k/k."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from pathlib import Path

from tirl.rl.checkpoint import resolve_model_path
from tirl.rl.config import TrainConfig
from tirl.runtime import generate_scored, open_runtime


@dataclass
class HardFilterResult:
    total: int
    kept: int
    solve_counts: dict[int, int]  # number of problems solved c times out of k, by c
    out: Path
    engine_rollouts: dict[str, int]  # trajectories each engine ran (the scheduler's leases; {} for one)

    def summary(self) -> str:
        hist = ", ".join(f"{c}/{max(self.solve_counts)}: {n}" for c, n in sorted(self.solve_counts.items()))
        line = f"kept {self.kept} of {self.total} problems (not solved every time); solved counts: {hist}"
        if self.engine_rollouts:
            line += "; rollouts per engine: " + ", ".join(f"{e} {n}" for e, n in self.engine_rollouts.items())
        return line


def filter_hard(
    cfg: TrainConfig, checkpoint: str | Path, data: str, k: int, out: str | Path, batch_size: int = 64
) -> HardFilterResult:
    """Run k rollouts per problem of `data` with the checkpoint's policy (cfg's cluster, engine, agent,
    sandbox and reward sections) and write the problems solved fewer than k times to `out` (JSONL)."""
    from tirl.data import load_problems, write_problems

    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    problems = load_problems(data)
    path = resolve_model_path(str(checkpoint))
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"{checkpoint}: not a tirl run/checkpoint nor an HF model directory")

    leases: dict[str, int] = {}

    async def solve_counts() -> list[int]:
        counts: list[int] = []
        engine_cfg = cfg.engine.model_copy(update={"model": path})
        async with open_runtime(cfg.cluster, engine_cfg, cfg.sandbox, cfg.reward) as rt:
            for start in range(0, len(problems), batch_size):
                batch = problems[start : start + batch_size]
                groups = await generate_scored(
                    rt, batch, k, cfg.agent, cfg.seed + start, cfg.rollout_concurrency
                )
                counts += [sum(t.reward > 0.5 for t in g) for g in groups]
            prefix = "rollout/leases/"
            leases.update(
                {k[len(prefix) :]: v for k, v in rt.engine_metrics().items() if k.startswith(prefix)}
            )
        return counts

    counts = asyncio.run(solve_counts())
    hard = select_hard(problems, counts, k)
    write_problems(out, hard)
    histogram = {c: counts.count(c) for c in range(k + 1)}
    return HardFilterResult(len(problems), len(hard), histogram, Path(out), leases)


def select_hard(problems: list, counts: list[int], k: int) -> list:
    """The problems solved fewer than k of k times, annotated with their solve count."""
    return [
        replace(p, meta={**p.meta, "solved": f"{c}/{k}"})
        for p, c in zip(problems, counts, strict=True)
        if c < k
    ]
