"""The planner: a config's plan, measured and advised. make_plan measures training
(tirl.rl.memory_probe), builds the plan around the measurement (tirl.rl.plan.plan_from) and, when it
does not fit, searches for the config overrides that make it fit; `largest` searches for the largest
micro-batch, context or model that fits. Both plan their candidates again, each measured, which is why
they sit above the plan and the probe rather than in them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import replace
from typing import Any

from tirl.rl.memory_probe import measured
from tirl.rl.plan import (
    QWEN3,
    ClusterShape,
    GiB,
    Plan,
    TrainingMemory,
    Workload,
    architecture_config,
    length_key,
    max_model_len_fix,
    micro_batch_shape,
    parameter_count,
    plan_from,
    raised_utilization,
    tensor_parallel_fix,
    training_fits,
    utilization_range,
    workload_of,
)

# ---- progress: a measurement takes seconds (a tiny model) to minutes (14B on a small machine) ----

_REPORT: ContextVar[Callable[[str], None] | None] = ContextVar("tirl_plan_report", default=None)
HEARTBEAT_S = 30.0  # how often a running measurement says it is still running


@contextmanager
def reporting(report: Callable[[str], None]) -> Iterator[None]:
    """Inside, each measurement the planner makes says what it measures while it runs and what it
    found when done (`tirl plan` prints these to stderr); a repeated one (cached) says nothing."""
    token = _REPORT.set(report)
    try:
        yield
    finally:
        _REPORT.reset(token)


def describe(workload: Workload, gpus: int) -> str:
    """One measurement in words: 'a training step of 2 x 16384 tokens per micro-batch on rank 0 of 8'."""
    sequences, tokens = workload.micro_batch
    options = [
        name
        for name, on in (("gradient checkpointing", workload.gradient_checkpointing), ("LoRA", workload.lora))
        if on
    ]
    where = "one GPU" if gpus == 1 else f"rank 0 of {gpus}"
    extra = f", {' + '.join(options)}" if options else ""
    return f"a training step of {sequences} x {tokens} tokens per micro-batch on {where}{extra}"


def _measured(config, gpus: int, workload: Workload) -> TrainingMemory:
    """memory_probe.measured, reported while it runs (see `reporting`)."""
    report = _REPORT.get()
    if report is None:
        return measured(config, gpus, workload)
    what, started, done = describe(workload, gpus), time.monotonic(), threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(report, what, started, done), daemon=True)
    beat.start()
    try:
        training = measured(config, gpus, workload)
    finally:
        done.set()
        beat.join()
    elapsed = time.monotonic() - started
    if elapsed >= 0.05:  # a repeated (cached) measurement returns in microseconds: nothing was measured
        report(f"  measured {what}: peak {training.peak / GiB:.1f} GiB ({elapsed:.0f} s)")
    return training


def _heartbeat(report: Callable[[str], None], what: str, started: float, done: threading.Event) -> None:
    """'measuring ...' after a second, then every HEARTBEAT_S, until `done`."""
    wait = 1.0
    while not done.wait(wait):
        report(f"  measuring {what} ... {time.monotonic() - started:.0f} s")
        wait = HEARTBEAT_S


# One measurement's CPU time, from `tirl plan` runs on the project's 2-core machine (docs/memory-plan.md):
# it grows with the layers (fake tensors: the work is per operation, not per byte).
SECONDS_PER_LAYER, SECONDS_BASE = 0.6, 2.0


def measurement_seconds(config) -> float:
    """About how long one measurement of `config` takes on an idle core."""
    return SECONDS_BASE + SECONDS_PER_LAYER * int(getattr(config, "num_hidden_layers", 1))


def announce(cfg, cluster: ClusterShape, arch: str | None, largest_what: str | None) -> str:
    """What `tirl plan` is about to measure and roughly how long it takes, printed before it starts."""
    spec = arch or cfg.model
    config = architecture_config(spec)
    each = measurement_seconds(config)
    if largest_what is None:
        count = "one measurement (and one per fix it tries when it does not fit)"
    else:
        count = f"one measurement per {largest_what} it tries (about {_CANDIDATES[largest_what]})"
    caveat = _slower(cluster, cfg)
    return (
        f"planning {spec} ({getattr(config, 'num_hidden_layers', '?')} layers) on {cluster.gpus} GPU(s) "
        f"x {cluster.gpu_memory / GiB:.1f} GiB: each measurement runs a training step on fake tensors (no "
        f"GPU, no weights), about {_duration(each)} on an idle core{caveat}; {count}"
    )


def _slower(cluster: ClusterShape, cfg) -> str:
    """What makes a measurement slower than its estimate (measured: docs/memory-plan.md)."""
    slower = [why for why, on in (("one GPU", cluster.gpus == 1), ("LoRA", cfg.optim.lora.enabled)) if on]
    if not slower:
        return ""
    verb = "makes" if len(slower) == 1 else "make"
    return f"; {' and '.join(slower)} {verb} it slower, by far for a large model (docs/memory-plan.md)"


_CANDIDATES = {"micro-batch": "4", "context": "6", "model": "up to 6, largest first"}


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} minutes"


def make_plan(config, cluster: ClusterShape, workload: Workload, name: str = "", advise: bool = True) -> Plan:
    """Measure training, size the engines, judge each phase against the GPU's memory, and (`advise`)
    find the config overrides that make a plan that does not fit fit (re-measured: they converge)."""
    plan = plan_from(config, cluster, workload, name, _measured(config, cluster.gpus, workload))
    if advise and not plan.fits:
        plan.fixes = fixes_for(config, plan)
    return plan


def plan_for_config(cfg, cluster: ClusterShape, arch: str | None = None) -> Plan:
    spec = arch or cfg.model
    return make_plan(architecture_config(spec), cluster, workload_of(cfg), spec)


# ---- fixes: overrides that make it fit, each checked by planning again ----


def fixes_for(config, plan: Plan) -> dict[str, str]:
    """Config overrides that make `plan` fit, checked by planning again with them (so applying them
    converges): the engine's from its arithmetic, then training's by measuring (fewer sequences per
    micro-batch; then, at one sequence, gradient checkpointing, then LoRA). Empty when none is found."""
    w = plan.workload
    engine_fix = _engine_fix(config, plan) if w.engine is not None else {}
    if engine_fix is None:
        return {}
    fixes = {f"engine.{k}": str(v) for k, v in engine_fix.items()}
    workload, training = w, plan.training
    if engine_fix:
        engine = w.engine | engine_fix
        length = int(engine["max_model_len"])
        workload = replace(w, engine=engine, micro_batch=micro_batch_shape(_tokens(w), length))
        if workload.micro_batch != w.micro_batch:
            training = _measured(config, plan.cluster.gpus, workload)
    final = plan_from(config, plan.cluster, workload, plan.architecture, training)
    if not training_fits(final):
        found = _training_fix(config, final)
        if found is None:
            return {}
        final, training_fixes = found
        fixes |= training_fixes
    return fixes if final.fits else {}


def _tokens(w: Workload) -> int:
    return w.micro_batch[0] * w.micro_batch[1]


def _engine_fix(config, plan: Plan) -> dict[str, Any] | None:
    """The engine settings that make its phases fit: one gpu_memory_utilization inside the range that
    works, else a tensor-parallel size or a shorter max_model_len with room (None: nothing works)."""
    engine = plan.workload.engine
    low, high = utilization_range(config, plan)
    u = float(engine["gpu_memory_utilization"])
    if low <= high:
        return (
            {}
            if low <= u <= high
            else {"gpu_memory_utilization": high if u > high else raised_utilization(low, high)}
        )
    for key, value in (
        ("tensor_parallel_size", tensor_parallel_fix(config, plan)),
        ("max_model_len", max_model_len_fix(config, plan)),
    ):
        if value is not None:
            low, high = utilization_range(config, plan, engine | {key: value})
            return {key: value} | (
                {} if low <= u <= high else {"gpu_memory_utilization": high if u > high else low}
            )
    return None


def _training_fix(config, plan: Plan) -> tuple[Plan, dict[str, str]] | None:
    """A training setting that fits, measured: the most sequences per micro-batch that fit; else
    gradient checkpointing and then LoRA (rank 16, all linear layers) on, at the configured micro-batch
    when it fits so, at one sequence otherwise."""
    w = plan.workload
    b, n = w.micro_batch
    one = plan if b == 1 else _plan_with(config, plan, replace(w, micro_batch=(1, n)))
    if training_fits(one):
        best = _most_sequences(config, plan, one)
        return best, {"optim.micro_batch_tokens": str(_tokens(best.workload))}
    changes: dict[str, Any] = {}
    fixes: dict[str, str] = {}
    for key, change in (
        ("optim.gradient_checkpointing", {"gradient_checkpointing": True}),
        ("optim.lora.enabled", {"lora": default_lora()}),
    ):
        if getattr(w, next(iter(change))):
            continue
        changes |= change
        fixes[key] = "true"
        one = _plan_with(config, one, replace(one.workload, **changes))
        if training_fits(one):
            full = _plan_with(config, plan, replace(w, **changes)) if b > 1 else one
            if training_fits(full):
                return full, fixes
            return one, fixes | {"optim.micro_batch_tokens": str(n)}
    return None


def default_lora() -> dict[str, Any]:
    """optim.lora as `optim.lora.enabled=true` alone sets it."""
    from tirl.rl.config import LoraConfig

    return LoraConfig(enabled=True).model_dump()


def _plan_with(config, plan: Plan, workload: Workload) -> Plan:
    return plan_from(
        config,
        plan.cluster,
        workload,
        plan.architecture,
        _measured(config, plan.cluster.gpus, workload),
    )


def _most_sequences(config, full: Plan, one: Plan) -> Plan:
    """The largest micro-batch below `full`'s that fits, given `one` (one sequence) fits: the peak grows
    about linearly with the sequences, so the measurements around the answer predict it; each guess is
    measured and narrows the bracket (fits at `best`, does not at `above`) until they are neighbours."""
    n = full.workload.micro_batch[1]
    fixed = one.training_total - one.training.peak * (1 + one.slack)
    limit = (full.cluster.gpu_memory - fixed) / (1 + one.slack)
    best, above = one, full
    while above.workload.micro_batch[0] - best.workload.micro_batch[0] > 1:
        low, high = best.workload.micro_batch[0], above.workload.micro_batch[0]
        slope = (above.training.peak - best.training.peak) / (high - low)
        guess = low + int((limit - best.training.peak) // max(1.0, slope))
        guess = min(high - 1, max(low + 1, guess))
        candidate = _plan_with(config, one, replace(one.workload, micro_batch=(guess, n)))
        if training_fits(candidate):
            best = candidate
        else:
            above = candidate
    return best


# ---- the largest setting that fits ----

LARGEST = ("micro-batch", "context", "model")


def largest(
    config, cluster: ClusterShape, workload: Workload, what: str, name: str = ""
) -> tuple[str, Any, Plan]:
    """The largest micro-batch (optim.micro_batch_tokens), context (engine.max_model_len, or max_length
    for SFT) or model (of the Qwen3 family) whose whole plan fits: (config key, value, its plan), or
    (key, None, the smallest candidate's plan) when none fits. Each candidate is measured: a few plans'
    time."""
    if what == "micro-batch":
        return _largest_micro_batch(config, cluster, workload, name)
    if what == "context":
        return _largest_context(config, cluster, workload, name)
    if what == "model":
        return _largest_model(cluster, workload)
    raise ValueError(f"--largest {what}: expected one of {', '.join(LARGEST)}")


def _largest_micro_batch(config, cluster, workload, name) -> tuple[str, Any, Plan]:
    n = workload.micro_batch[1]
    one = make_plan(config, cluster, replace(workload, micro_batch=(1, n)), name, advise=False)
    if not one.fits:
        return "optim.micro_batch_tokens", None, one
    two = make_plan(config, cluster, replace(workload, micro_batch=(2, n)), name, advise=False)
    if not two.fits:
        return "optim.micro_batch_tokens", n, one
    # between two sequences (fit) and 256 (taken not to: its peak extrapolated from one and two)
    far = replace(two, workload=replace(two.workload, micro_batch=(256, n)))
    far.training = replace(
        two.training, peak=two.training.peak + 254 * (two.training.peak - one.training.peak)
    )
    best = _most_sequences(config, far, two)
    return "optim.micro_batch_tokens", _tokens(best.workload), best


def _largest_context(config, cluster, workload, name) -> tuple[str, Any, Plan]:
    """Binary search over multiples of 1024 up to the model's max_position_embeddings; the micro-batch
    keeps its token budget (at least one sequence)."""
    budget = _tokens(workload)

    def plan_at(length: int) -> Plan:
        engine = workload.engine | {"max_model_len": length} if workload.engine else None
        shape = micro_batch_shape(budget, length)
        return make_plan(
            config, cluster, replace(workload, engine=engine, micro_batch=shape), name, advise=False
        )

    best = plan_at(1024)
    if not best.fits:
        return length_key(workload), None, best
    low, high = 1, getattr(config, "max_position_embeddings", 32768) // 1024
    while low < high:
        mid = (low + high + 1) // 2
        candidate = plan_at(mid * 1024)
        if candidate.fits:
            low, best = mid, candidate
        else:
            high = mid - 1
    return length_key(workload), low * 1024, best


def _largest_model(cluster, workload) -> tuple[str, Any, Plan]:
    """Down the Qwen3 family from the largest, the first whose plan fits."""
    for arch in sorted(QWEN3, key=lambda a: -parameter_count(architecture_config(a))):
        plan = make_plan(architecture_config(arch), cluster, workload, arch, advise=False)
        if plan.fits:
            return "model", arch, plan
    return "model", None, plan


def largest_for_config(cfg, cluster: ClusterShape, what: str, arch: str | None = None) -> tuple[str, Plan]:
    """`tirl plan --largest WHAT`: one line with the answer, and the plan of that setting (of the
    smallest candidate when nothing fits)."""
    spec = arch or cfg.model
    key, value, plan = largest(architecture_config(spec), cluster, workload_of(cfg), what, spec)
    if value is None:
        return f"nothing fits: not even the smallest {key} (its plan below)", plan
    return f"largest {key} that fits: {value}", plan
