"""The bodies of `tirl eval` and `tirl chat` (cli.py only parses arguments)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console

from tirl.agent.protocol import check_context, longest_prompt
from tirl.data import load_problems
from tirl.data.problem import Problem
from tirl.engines.config import EngineConfig
from tirl.eval.config import EvalConfig
from tirl.eval.report import EvalReport
from tirl.reward import RewardConfig
from tirl.runtime import ClusterConfig, open_runtime

CONTEXT_SLACK = 16  # a few tokens past the budget (the turn's closing tokens)


def benchmark_name(source: str) -> str:
    """`aime24` stays `aime24`; a file is named by its stem."""
    return Path(source).stem if Path(source).suffix else source


def load_benchmarks(sources: list[str], limit: int | None, data_dir: str | None) -> dict[str, list[Problem]]:
    benchmarks: dict[str, list[Problem]] = {}
    for source in sources:
        name = benchmark_name(source)
        if name in benchmarks:
            raise ValueError(f"--data {source!r} given twice (benchmark {name!r})")
        benchmarks[name] = load_problems(source, limit=limit, data_dir=data_dir)
        if not benchmarks[name]:
            raise ValueError(f"--data {source!r} holds no problems")
    return benchmarks


def eval_cluster(backend: str, address: str | None, gpus_per_engine: float) -> ClusterConfig:
    """`--cluster local|ray` (+ `--ray-address`, `--gpus-per-engine`) as a validated cluster section."""
    from pydantic import ValidationError

    from tirl.config import ConfigError

    if backend not in ("local", "ray"):
        raise ConfigError(f"--cluster {backend!r}: use local or ray")
    if backend == "local":
        return ClusterConfig()
    address = address or os.environ.get("RAY_ADDRESS")
    try:
        return ClusterConfig(backend="ray", address=address, engines={"num_gpus": gpus_per_engine})
    except ValidationError as e:
        raise ConfigError("; ".join(err["msg"].removeprefix("Value error, ") for err in e.errors())) from None


def sandbox_config(endpoints: list[str]):
    """Remote when endpoints are given (bearer token from $TIRL_SANDBOX_TOKEN, as sandbox.token left
    null is everywhere), else a local service started for this run."""
    from tirl.sandbox import SandboxConfig

    if not endpoints:
        return SandboxConfig(mode="local")
    return SandboxConfig(mode="remote", endpoints=list(endpoints))


@contextmanager
def kept_if_written(out: str | Path) -> Iterator[None]:
    """The output directory (and the parents it needed) stays only if something was written in it: an
    evaluation that fails leaves no empty `runs/eval/` behind."""
    out = Path(out).absolute()
    created = [d for d in (out, *out.parents) if not d.exists()]  # deepest first
    try:
        yield
    finally:
        for d in created:
            if not d.is_dir() or any(d.iterdir()):
                break
            d.rmdir()


def write_partial(out: str | Path, trajectories: list) -> Path:
    """The trajectories an interrupted evaluation finished, one JSON line each."""
    import json

    path = Path(out) / "trajectories.partial.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for traj in trajectories:
            f.write(json.dumps(traj.to_dict(), ensure_ascii=False) + "\n")
    return path


def run_eval(
    engine_cfg: EngineConfig,
    benchmarks: dict[str, list[Problem]],
    cfg: EvalConfig,
    out: str | Path,
    sandbox_endpoints: list[str] = (),
    reward_cfg: RewardConfig | None = None,
    max_model_len: int | None = None,
    console: Console | None = None,
    cluster: ClusterConfig | None = None,
    tokenizer=None,
) -> EvalReport:
    """Evaluate, write out/report.md, out/metrics.json, out/trajectories.jsonl; return the report."""
    from tirl.engines.tokenizer import load_tokenizer

    started = time.perf_counter()
    console = console or Console()
    tokenizer = tokenizer or load_tokenizer(engine_cfg.model)
    agent = cfg.agent_config()
    problems = [p for ps in benchmarks.values() for p in ps]
    if max_model_len is None:  # the context must hold the longest prompt and the whole response budget
        max_model_len = longest_prompt(tokenizer, problems, agent) + agent.max_response_tokens + CONTEXT_SLACK
    else:
        check_context(tokenizer, problems, agent, max_model_len, "--max-model-len")
    engine_cfg = engine_cfg.model_copy(update={"max_model_len": max_model_len})

    finished: list = []

    async def main() -> EvalReport:
        from tirl.eval.evaluate import evaluate

        sandbox = sandbox_config(list(sandbox_endpoints))
        async with open_runtime(
            cluster or ClusterConfig(), engine_cfg, sandbox, reward_cfg or RewardConfig(), tokenizer
        ) as rt:
            report = await evaluate(rt, benchmarks, cfg, finished=finished)
            report.config["runtime"] = {
                "backend": rt.backend,
                **rt.engine_metrics(),
            }  # trajectories per engine
            return report

    try:
        report = asyncio.run(main())
    except KeyboardInterrupt:
        total = sum(len(ps) for ps in benchmarks.values()) * cfg.samples
        path = write_partial(out, finished)
        console.print(
            f"interrupted: {len(finished)} of {total} trajectories had finished; they are in {path} "
            "(unscored). Run the same command again for the full evaluation."
        )
        raise
    report.config = {"model": engine_cfg.model, "engine": engine_cfg.backend, **report.config}
    report.config |= {"max_turns": agent.max_turns, "max_tokens": agent.max_response_tokens}  # in effect
    report.total_seconds = time.perf_counter() - started
    report.write(out)
    console.print(report.to_markdown(), markup=False, highlight=False, soft_wrap=True)
    console.print(f"wrote {Path(out) / 'report.md'}, metrics.json, trajectories.jsonl")
    return report
