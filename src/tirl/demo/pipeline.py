"""The tiny CPU experiment (`tirl demo`): SFT -> eval -> GRPO-RoC -> eval -> report, in minutes.

A randomly initialized tiny Qwen3 model first learns to copy numbers (copy drills: what pretraining
would give it), then the tool protocol from programmatic traces (tirl.demo.sft_traces),
is evaluated on held-out synthetic problems (tirl.demo.synthetic), trained with
GRPO-RoC against the real sandbox and reward, and evaluated again with the same settings. Everything
lands under one output directory: models, metrics JSONL, evaluation reports, PNG plots, report.md and
summary.json. `--compare grpo` also trains plain GRPO (RoC off) with the same budget, for the paper's
Figure 4 (tool-error ratio inside correct trajectories) at tiny scale; `--seeds N` repeats both RL
runs (not SFT) with N seeds and reports every curve with its 95% interval (tirl.demo.seed_stats).
The drills run until the model copies (tirl.demo.drills), and each phase checks its outcome
(tirl.demo.checks): a shortfall stops the demo in one line, or with demo.checks=warn heads the report.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import AbstractAsyncContextManager, AsyncExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tirl.agent.config import AgentConfig
from tirl.agent.trajectory import tool_error_ratio
from tirl.config import ConfigError, apply_overrides, read_yaml, validate
from tirl.demo.checks import Checks, DemoShortfall, drills_shortfall, rl_shortfall, sft_shortfall
from tirl.demo.drills import OUTCOME_FILE
from tirl.demo.sft_traces import TraceMix
from tirl.eval.config import EvalConfig
from tirl.rl.config import SFTConfig, TrainConfig

if TYPE_CHECKING:
    from tirl.runtime import Runtime

CONFIG_DIR = Path(__file__).parent.parent / "configs" / "demo"
MARKER = ".tirl-demo"  # marks a directory the demo may wipe on the next run
SECTIONS = ("demo", "agent", "drills", "sft", "train", "eval")
COMPARE = {"grpo": "off"}  # --compare NAME -> algorithm.roc of the baseline run (same steps, prompts, G)


class DemoError(RuntimeError):
    """A demo phase failed; the message names the phase and where the partial outputs are."""


class DemoConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # The descriptions are `tirl demo --help`'s list of knobs (knobs_help).
    preset: str = Field("demo", description="tiny model preset (tirl model init --preset)")
    model: str | None = Field(
        None,
        description="a pretrained model directory to start from instead of the tiny preset (tirl demo "
        "--real): evaluated as it is first; no drills",
    )
    seed: int = Field(0, description="seed of the data, the model and the first RL run")
    sft_problems: int = Field(2800, ge=1, description="synthetic problems turned into SFT traces")
    rl_problems: int = Field(2000, ge=1, description="other synthetic problems for RL")
    heldout_problems: int = Field(96, ge=1, description="held-out problems, evaluated before and after RL")
    rl_steps: int = Field(50, ge=1, description="GRPO-RoC steps")
    drill_steps: int = Field(
        300, ge=0, description="the cap of copy-drill steps before the traces (drills.yaml; 0: none)"
    )
    drill_check_every: int = Field(25, ge=1, description="drill steps between held-out copy checks")
    drill_target: float = Field(
        0.95, gt=0, le=1, description="held-out drills copied exactly that end the drills"
    )
    drill_heldout: int = Field(128, ge=1, description="held-out copy drills the check measures")
    shaped_drill_steps: int = Field(
        400, ge=0, description="the cap of drill steps in the traces' shapes after the copy drills (0: none)"
    )
    shaped_drill_target: float = Field(
        0.9, gt=0, le=1, description="held-out shaped drills done exactly that end them"
    )
    checks: Literal["stop", "warn"] = Field(
        "stop", description="a phase short of its check stops the demo, or warns in report.md"
    )
    min_sft_tool_use: float = Field(
        50.0, ge=0, le=100, description="% of held-out trajectories the SFT model must call the tool in"
    )
    min_sft_accuracy: float = Field(10.0, ge=0, le=100, description="% held-out the SFT model must solve")
    copy_drills: int = Field(0, ge=0, description="copy drills mixed into the trace SFT")
    trace_slots: int = Field(
        12, ge=1, description="sandbox slots making the traces (a brute force holds one until its timeout)"
    )
    traces: TraceMix = Field(TraceMix(), description="shares of the SFT trace kinds")

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, preset: str) -> str:
        from tirl.tiny_model import PRESETS

        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
        return preset

    @model_validator(mode="after")
    def _no_drills_for_a_pretrained_model(self) -> DemoConfig:
        if self.model is not None and (self.drill_steps or self.shaped_drill_steps):
            raise ValueError(
                "demo.model is a pretrained model, which copies already: set demo.drill_steps=0 and "
                "demo.shaped_drill_steps=0 (configs/demo/real.yaml does)"
            )
        return self


def knobs_help(config_dir: str | Path = CONFIG_DIR) -> str:
    """`tirl demo --help`'s list: every DemoConfig field as `demo.KEY=VALUE` with the value demo.yaml
    gives it (validated by DemoConfig, so the list cannot drift from the model) and its description."""
    demo = validate(DemoConfig, read_yaml(Path(config_dir) / "demo.yaml"), f" in {config_dir}")
    lines = ["Knobs (demo.KEY=VALUE; the defaults are src/tirl/configs/demo/demo.yaml's):"]
    for name, info in DemoConfig.model_fields.items():
        value = getattr(demo, name)
        if isinstance(value, BaseModel):  # a nested section: one knob per field
            for sub in type(value).model_fields:
                lines.append(f"demo.{name}.{sub}={getattr(value, sub)}: {info.description} ({sub})")
        else:
            lines.append(f"demo.{name}={value}: {info.description}")
    others = ", ".join(f"{s}.KEY=VALUE ({s}.yaml)" for s in SECTIONS if s != "demo")
    return "\n\n".join([*lines, f"The other sections: {others}."])


@dataclass
class DemoSettings:
    """The five config sections, validated; sft/train/eval are completed with paths by the demo."""

    demo: DemoConfig
    agent: AgentConfig
    drills: dict
    sft: dict
    train: dict
    eval: dict


def load_settings(config_dir: str | Path = CONFIG_DIR, overrides: list[str] | None = None) -> DemoSettings:
    """Read demo/agent/sft/train/eval YAML; `section.key=value` overrides (e.g. `demo.rl_steps=5`).
    Every section is validated here, before the first phase, so a typo fails at once."""
    raw = {name: read_yaml(Path(config_dir) / f"{name}.yaml") for name in SECTIONS}
    for item in overrides or []:
        section, dot, rest = item.partition(".")
        if section not in raw or not dot:
            raise ConfigError(
                f"override {item!r} must start with one of {', '.join(SECTIONS)} (e.g. demo.rl_steps=5)"
            )
        try:
            apply_overrides(raw[section], [rest])
        except ConfigError as e:
            raise ConfigError(str(e).replace(repr(rest), repr(item))) from None
    where = f" in {config_dir} (with the overrides)"
    demo = validate(DemoConfig, raw["demo"], where)
    agent = validate(AgentConfig, raw["agent"], where)
    settings = DemoSettings(demo, agent, raw["drills"], raw["sft"], raw["train"], raw["eval"])
    for name in ("drills", "sft"):
        fields = _sft_raw(settings, raw[name], Path("model"), Path("data"), Path("out"))
        validate(SFTConfig, fields, f"{where}: {name}")
    validate(TrainConfig, _train_raw(settings, Path("model"), "data", Path("out"), "rl"), f"{where}: train")
    validate(EvalConfig, _eval_raw(settings), f"{where}: eval")
    return settings


def quick_overrides(config_dir: str | Path = CONFIG_DIR) -> list[str]:
    """`tirl demo --quick`: quick.yaml's overrides (the command line's, given after them, win)."""
    return preset_overrides("quick", config_dir)


def real_overrides(model: str | Path, config_dir: str | Path = CONFIG_DIR) -> list[str]:
    """`tirl demo --real MODEL`: real.yaml's overrides for a pretrained model directory, then its path."""
    if not (Path(model) / "config.json").is_file():
        raise ConfigError(
            f"--real {model}: not a model directory (no config.json); `make smollm2` makes one "
            "(docs/real-model.md)"
        )
    return [*preset_overrides("real", config_dir), f"demo.model={Path(model).resolve()}"]


def preset_overrides(name: str, config_dir: str | Path = CONFIG_DIR) -> list[str]:
    """The `overrides` list of configs/demo/NAME.yaml."""
    raw = read_yaml(Path(config_dir) / f"{name}.yaml")
    items = raw.get("overrides")
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        raise ConfigError(
            f"{config_dir}/{name}.yaml: `overrides` must be a list of section.key=value strings"
        )
    return items


PHASES_FILE = "phases.json"  # each finished phase's result and wall time: what --resume skips
SETTINGS_FILE = "settings.json"  # the settings the directory was written with: --resume must match them


@dataclass
class Phases:
    """Runs the demo's phases in order with a header, a wall time each, and a clear failure message.
    `run` records a finished phase's result (paths) in OUT/phases.json; a resumed demo takes it from
    there instead of running the phase again."""

    console: object
    out: Path
    total: int
    seconds: dict[str, float] = field(default_factory=dict)
    finished: dict[str, dict] = field(default_factory=dict)  # name -> {"result", "seconds"}

    @contextmanager
    def __call__(self, name: str, what: str) -> Iterator[None]:
        n = len(self.seconds) + 1
        self.console.rule(f"[bold]demo {n}/{self.total}: {what}")
        start = time.perf_counter()
        try:
            yield
        except DemoShortfall:
            raise  # its one line says it all
        except Exception as e:
            raise DemoError(
                f"demo phase {name!r} ({what}) failed: {type(e).__name__}: {e}\n"
                f"partial outputs are in {self.out}; fix the cause and continue with the same command and "
                "--resume (or start over without it)"
            ) from e
        self.seconds[name] = round(time.perf_counter() - start, 1)
        self.console.print(f"[green]done[/] {what} in {self.seconds[name]:.1f} s")

    def run(self, name: str, what: str, work: Callable[[], Result], skipped: str | None = None) -> Result:
        """`skipped`: why this phase has nothing to do (its work returns at once), printed instead of
        its header's details and a wall time of 0.0 s."""
        if skipped is not None:
            self.console.rule(f"[bold]demo {len(self.seconds) + 1}/{self.total}: {what.split(' (')[0]}")
            self.console.print(f"skipped ({skipped})")
            self.seconds[name] = 0.0
            return work()
        if name in self.finished:
            self.console.rule(f"[bold]demo {len(self.seconds) + 1}/{self.total}: {what}")
            self.console.print("[green]done[/] before the demo was interrupted")
            self.seconds[name] = self.finished[name]["seconds"]
            return _paths(self.finished[name]["result"])
        with self(name, what):
            result = work()
        self.finished[name] = {"result": _strings(result), "seconds": self.seconds[name]}
        tmp = self.out / f"{PHASES_FILE}.tmp"  # whole or absent: a kill while writing loses no phase
        tmp.write_text(json.dumps(self.finished, indent=2) + "\n")
        os.replace(tmp, self.out / PHASES_FILE)
        return result


Result = TypeVar("Result", Path, tuple[Path, Path])
T = TypeVar("T")


def _strings(result: Path | tuple[Path, ...]) -> str | list[str]:
    return str(result) if isinstance(result, Path) else [str(p) for p in result]


def _paths(saved: str | list[str]) -> Path | tuple[Path, ...]:
    return Path(saved) if isinstance(saved, str) else tuple(Path(p) for p in saved)


def prepare_out(out: str | Path, settings: dict | None = None, resume: bool = False) -> Path:
    """The output directory: replaced if a previous demo wrote it, refused if not; with `resume`, kept
    if it was written with the same `settings` (its finished phases are then skipped)."""
    out = Path(out)
    if resume:
        return _resumable(out, settings)
    if out.exists() and any(out.iterdir()):
        if not (out / MARKER).exists():
            raise DemoError(
                f"{out} exists and was not written by `tirl demo`: choose another --out or remove it yourself"
            )
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("written by `tirl demo`; the next run replaces this directory\n")
    if settings is not None:
        (out / SETTINGS_FILE).write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
    return out


def _resumable(out: Path, settings: dict | None) -> Path:
    if not (out / MARKER).exists():
        raise DemoError(f"--resume: {out} holds no demo to continue; run without --resume")
    saved = out / SETTINGS_FILE
    if not saved.exists() or json.loads(saved.read_text()) != settings:
        raise DemoError(
            f"--resume: {out} was written with other settings: give the same overrides, --compare and "
            "--seeds, or start over without --resume"
        )
    return out


def _finished_phases(out: Path) -> dict[str, dict]:
    path = out / PHASES_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def settings_record(settings: DemoSettings, compare: str | None, seeds: int) -> dict:
    """What a demo directory was written with (OUT/settings.json), compared by --resume."""
    record = {name: getattr(settings, name) for name in SECTIONS}
    record |= {"demo": settings.demo.model_dump(mode="json"), "agent": settings.agent.model_dump(mode="json")}
    return json.loads(json.dumps(record | {"compare": compare, "seeds": seeds}))


def run_demo(
    out: str | Path = "runs/demo",
    compare: str | None = None,
    overrides: list[str] | None = None,
    config_dir: str | Path = CONFIG_DIR,
    progress: bool = True,
    seeds: int = 1,
    resume: bool = False,
) -> dict:
    """The whole experiment; returns the summary (also written to OUT/summary.json).

    `seeds` RL runs per algorithm (seeds demo.seed, demo.seed + 1, ...), all from the one SFT model.
    `resume` continues an interrupted demo in `out` (same settings): finished phases are skipped, an
    interrupted SFT or RL run continues from its last checkpoint."""
    from rich.console import Console

    from tirl.eval.report import EvalReport

    if compare is not None and compare not in COMPARE:
        raise ConfigError(f"--compare {compare!r}: the only baseline is {', '.join(COMPARE)}")
    if seeds < 1:
        raise ConfigError(f"--seeds {seeds}: give at least 1")
    settings = load_settings(config_dir, overrides)
    out = prepare_out(out, settings_record(settings, compare, seeds), resume)
    console = Console(stderr=True, quiet=not progress)
    runs: dict[str, str | None] = {"rl": None} | ({compare: COMPARE[compare]} if compare else {})
    units = [(k, name) for k in range(seeds) for name in runs]  # one RL run + its evaluation each
    phases = 8 + 2 * len(units) + (settings.demo.model is not None)
    phase = Phases(console, out, total=phases, finished=_finished_phases(out))
    started = time.perf_counter()
    # The model and the problems are deterministic and take a second: made again on resume.
    pretrained = settings.demo.model is not None
    what = f"load {settings.demo.model}" if pretrained else f"create the {settings.demo.preset!r} tiny model"
    with phase("model", what):
        init_model = _create_model(settings.demo, out)
    with phase("data", "generate synthetic problems (train / held-out)"):
        sft_problems, rl_data, heldout = _make_problems(settings.demo, out)
        _check_training(settings, init_model, rl_data, out)
    eval_dirs = {}
    if pretrained:  # what the method starts from: the model as it is, with the same agent settings
        eval_dirs["base"] = phase.run(
            "eval_base",
            "evaluate the pretrained model as it is on held-out problems",
            partial(_evaluate_alone, settings, init_model, heldout, out / "eval_base", progress),
        )
    traces = phase.run(
        "traces",
        "write SFT traces (real tool outputs from the sandbox)",
        partial(_write_traces, settings, sft_problems, out),
    )
    drilled = phase.run(
        "drills",
        f"SFT on copy drills until {settings.demo.drill_target:.0%} of held-out drills are copied "
        f"(at most {settings.demo.drill_steps} steps)",
        partial(_drill, settings, init_model, out, console.print),
        skipped=None if settings.demo.drill_steps else "demo.drill_steps=0",
    )
    checks = Checks(settings.demo.checks, console.print)
    checks.expect(drills_shortfall(out / "drills"))
    drilled = phase.run(
        "shaped_drills",
        f"SFT on drills in the traces' shapes until {settings.demo.shaped_drill_target:.0%} of held-out "
        f"ones are done exactly (at most {settings.demo.shaped_drill_steps} steps)",
        partial(_shaped_drill, settings, drilled, sft_problems, out, console.print),
        skipped=None if settings.demo.shaped_drill_steps else "demo.shaped_drill_steps=0",
    )
    checks.expect(drills_shortfall(out / "shaped_drills"))
    drills = f" + {settings.demo.copy_drills} copy drills" if settings.demo.copy_drills else ""
    sft_model = phase.run(
        "sft",
        f"SFT on {_count_lines(traces)} examples (tool-using traces with imperfections{drills})",
        partial(_sft, settings.sft, settings, drilled, traces, out, progress, resume),
    )

    def unit(k: int, name: str) -> tuple[str | None, str, int]:  # RL run k of `name`: its roc, tag, seed
        return runs[name], name if seeds == 1 else f"{name}_seed{k}", settings.demo.seed + k

    # One runtime for the SFT model's evaluation, the first RL run and its evaluation (SharedRuntime).
    roc, tag, seed = unit(*units[0])
    with SharedRuntime(train_config(settings, sft_model, rl_data, out, tag, roc, seed)) as shared:
        eval_dirs["sft"] = phase.run(
            "eval_sft",
            "evaluate the SFT model on held-out problems",
            partial(_evaluate_into, settings, sft_model, heldout, out / "eval_sft", progress, shared),
        )
        sft_numbers = _eval_numbers(EvalReport.read(eval_dirs["sft"]))
        checks.expect(
            sft_shortfall(sft_numbers, settings.demo.min_sft_tool_use, settings.demo.min_sft_accuracy)
        )
        train_dirs, groups = {}, {name: [] for name in runs}
        rl_started, ran = time.perf_counter(), 0  # units trained by this call (a resumed demo skips some)
        for done, (k, name) in enumerate(units):
            roc, tag, seed = unit(k, name)
            algo = "GRPO-RoC" if roc is None else f"plain GRPO (roc={roc})"
            left = (time.perf_counter() - rl_started) / ran * (len(units) - done) if ran else None
            eta = "" if left is None else f", ~{left / 60:.0f} min left"
            what = f"{algo}: {settings.demo.rl_steps} steps from the SFT model, seed {seed} [{done + 1}/{len(units)}{eta}]"
            ran += tag not in phase.finished
            train_dirs[tag], model = phase.run(
                tag,
                what,
                partial(_train, settings, sft_model, rl_data, out, tag, roc, progress, seed, resume, shared),
            )
            eval_dirs[tag] = phase.run(
                f"eval_{tag}",
                f"evaluate the {algo} model (seed {seed}) on held-out problems",
                partial(_evaluate_into, settings, model, heldout, out / f"eval_{tag}", progress, shared),
            )
            groups[name].append(tag)
    with phase("report", "write report.md, plots and summary.json"):
        phase.seconds["total"] = round(time.perf_counter() - started, 1)
        evals = {tag: EvalReport.read(d) for tag, d in eval_dirs.items()}
        checks.expect(rl_shortfall(sft_numbers["accuracy"], _mean_accuracy(evals, groups["rl"])), stops=False)
        summary = _report(settings, out, evals, train_dirs, groups, phase.seconds, checks.warnings)
    console.print(
        f"[bold]held-out accuracy: SFT {summary['sft_accuracy']:.1f}% -> GRPO-RoC {summary['rl_accuracy']:.1f}%"
        + (f", plain GRPO {summary[f'{compare}_accuracy']:.1f}%" if compare else "")
        + f"[/]  ({summary['wall_seconds']['total']:.0f} s). Report: {out / 'report.md'}"
    )
    return summary


# ---- phases ----


def _create_model(demo: DemoConfig, out: Path) -> Path:
    from tirl.tiny_model import create_tiny_model

    if demo.model is not None:
        return Path(demo.model)
    return create_tiny_model(out / "init_model", preset=demo.preset, seed=demo.seed)


def _check_training(settings: DemoSettings, model: Path, data: str, out: Path) -> None:
    """The RL runs' checks that need only their config and data (a prompt longer than
    train.engine.max_model_len, ...), now rather than after SFT, minutes later (tirl.rl.preflight)."""
    from tirl.rl.preflight import preflight_train

    preflight_train(train_config(settings, model, data, out, "rl"))


def _make_problems(demo: DemoConfig, out: Path):
    from tirl.demo.synthetic import generate, write_jsonl

    train = generate(demo.sft_problems + demo.rl_problems, "train", seed=demo.seed)
    heldout = generate(demo.heldout_problems, "heldout", seed=demo.seed)
    sft, rl = train[: demo.sft_problems], train[demo.sft_problems :]
    rl_path = write_jsonl(rl, out / "data" / "rl_train.jsonl")
    write_jsonl(sft, out / "data" / "sft_problems.jsonl")
    write_jsonl(heldout, out / "data" / "heldout.jsonl")
    return sft, str(rl_path), heldout


def _sandbox_config(settings: DemoSettings):
    from tirl.sandbox import SandboxConfig

    return SandboxConfig.model_validate(settings.train.get("sandbox", {}))


def _write_traces(settings: DemoSettings, problems, out: Path) -> Path:
    return asyncio.run(_make_traces(settings, problems, out))


async def _make_traces(settings: DemoSettings, problems, out: Path) -> Path:
    from tirl.demo.sft_traces import copy_drills, make_traces, write_traces
    from tirl.sandbox import open_executor

    # The traces' brute forces each hold a slot for the whole tool timeout, mostly waiting for a CPU
    # share, so more slots than RL's overlap them (same outputs; docs/results.md, "--quick's margin").
    sandbox = _sandbox_config(settings).model_copy(update={"slots": settings.demo.trace_slots})
    async with open_executor(sandbox) as executor:
        traces = await make_traces(
            problems, executor, settings.agent, settings.demo.traces, settings.demo.seed
        )
    drills = copy_drills(settings.demo.copy_drills, settings.demo.seed)
    return write_traces(traces + drills, out / "data" / "sft_traces.jsonl")


def _count_lines(path: Path) -> int:
    with path.open("rb") as f:
        return sum(1 for _ in f)


def _drill(settings: DemoSettings, init_model: Path, out: Path, say: Callable[[str], object]) -> Path:
    """Stage 0a: copy drills until the model copies (tirl.demo.drills; skipped when demo.drill_steps
    is 0). Its outcome (drills/drill_outcome.json) is checked after the phase (tirl.demo.checks)."""
    from tirl.demo.drills import StopRule
    from tirl.rl.checkpoint import latest_model_dir

    d = settings.demo
    if d.drill_steps == 0:
        return init_model
    rule = StopRule(d.drill_steps, d.drill_check_every, d.drill_target, d.drill_heldout)
    outcome = _run_drills(settings, init_model, out, rule, say)
    say(outcome.message())
    return latest_model_dir(out / "drills")


def _run_drills(settings: DemoSettings, init_model: Path, out: Path, rule, say: Callable[[str], object]):
    from tirl.demo.drills import run_drills
    from tirl.demo.sft_traces import copy_drills, write_traces

    n = rule.max_steps * int(settings.drills.get("batch_size", 32))
    train = copy_drills(n, settings.demo.seed + 1)
    heldout = copy_drills(rule.heldout, -1 - settings.demo.seed)  # another stream than any seed's
    path = write_traces(train, out / "data" / "copy_drills.jsonl")
    cfg = SFTConfig.model_validate(_sft_raw(settings, settings.drills, init_model, path, out))
    return run_drills(cfg, train, heldout, rule, say)


def _shaped_drill(
    settings: DemoSettings, drilled: Path, problems, out: Path, say: Callable[[str], object]
) -> Path:
    """Stage 0b: drills in the traces' own shapes (tirl.demo.sft_traces.shaped_drills), from the copy
    drills' model, until a held-out check passes; the held-out ones come from problems the drills never
    draw. Skipped when demo.shaped_drill_steps is 0."""
    from tirl.demo.drills import StopRule, run_drills
    from tirl.demo.sft_traces import shaped_drills, write_traces
    from tirl.rl.checkpoint import latest_model_dir

    d = settings.demo
    if d.shaped_drill_steps == 0:
        return drilled
    rule = StopRule(d.shaped_drill_steps, d.drill_check_every, d.shaped_drill_target, d.drill_heldout)
    held = min(d.drill_heldout, len(problems) // 2)
    batch = int(settings.drills.get("batch_size", 32))
    train = shaped_drills(problems[held:], rule.max_steps * batch, settings.agent, d.seed)
    heldout = shaped_drills(problems[:held], rule.heldout, settings.agent, -1 - d.seed)
    path = write_traces(train, out / "data" / "shaped_drills.jsonl")
    raw = settings.drills | {"run_name": "shaped_drills", "max_length": settings.sft.get("max_length", 512)}
    cfg = SFTConfig.model_validate(_sft_raw(settings, raw, drilled, path, out))
    outcome = run_drills(cfg, train, heldout, rule, say, "shaped drills", "demo.shaped_drill_steps")
    say(outcome.message())
    return latest_model_dir(out / "shaped_drills")


def _sft_raw(settings: DemoSettings, raw: dict, init_model: Path, data: Path, out: Path) -> dict:
    """An SFTConfig's fields: the section's, with the demo's model, data and output; a section that
    names the agent protocol (sft.yaml: the traces) gets the demo's, the drills none."""
    fields = {
        "model": str(init_model),
        "data": [str(data)],
        "output_dir": str(out),
        "seed": settings.demo.seed,
    }
    if "agent" in raw:
        fields["agent"] = settings.agent.model_dump(mode="json")
    return raw | fields


def _sft(
    raw: dict, settings: DemoSettings, init_model: Path, data: Path, out: Path, progress: bool, resume: bool
) -> Path:
    from tirl.rl.checkpoint import latest_model_dir
    from tirl.rl.sft import run_sft

    cfg = SFTConfig.model_validate(_sft_raw(settings, raw, init_model, data, out))
    return latest_model_dir(run_sft(cfg, resume=resume and _checkpointed(cfg.run_dir), progress=progress))


def _checkpointed(run_dir: Path) -> bool:
    """An interrupted run that can continue from a checkpoint (else it starts over in its directory)."""
    from tirl.rl.checkpoint import latest_checkpoint

    return latest_checkpoint(run_dir) is not None


def _train_raw(
    settings: DemoSettings,
    model: Path,
    data: str,
    out: Path,
    name: str,
    roc: str | None = None,
    seed: int | None = None,
):
    raw = json.loads(json.dumps(settings.train))  # a deep copy: both runs start from the same settings
    if roc is not None:
        raw.setdefault("algorithm", {})["roc"] = roc
    stage = (raw.get("stages") or [{}])[0]
    return raw | {
        "model": str(model),
        "output_dir": str(out),
        "run_name": name,
        "seed": settings.demo.seed if seed is None else seed,
        "agent": settings.agent.model_dump(mode="json"),
        "stages": [{"name": stage.get("name", "synthetic"), "steps": settings.demo.rl_steps, "data": data}],
    }


def train_config(
    settings: DemoSettings,
    model: Path,
    data: str,
    out: Path,
    name: str,
    roc: str | None = None,
    seed: int | None = None,
) -> TrainConfig:
    """The TrainConfig of one RL run; `roc` overrides algorithm.roc (the baseline, e.g. "off"),
    `seed` the demo's seed."""
    return TrainConfig.model_validate(_train_raw(settings, model, data, out, name, roc, seed))


def _train(
    settings: DemoSettings,
    model: Path,
    data: str,
    out: Path,
    name: str,
    roc: str | None,
    progress: bool,
    seed: int,
    resume: bool,
    shared: SharedRuntime,
) -> tuple[Path, Path]:
    from tirl.rl.checkpoint import latest_model_dir
    from tirl.rl.trainer import run_training, train_on

    cfg = train_config(settings, model, data, out, name, roc, seed)
    resume = resume and _checkpointed(cfg.run_dir)  # its engines start from the checkpoint's weights
    if shared.serves(cfg) and not resume:
        run_dir = shared.run(lambda rt: train_on(rt, cfg, progress))
        shared.now_holds(latest_model_dir(run_dir))  # synced after the last step
    else:
        shared.close()  # it holds weights no later phase needs
        run_dir = run_training(cfg, resume=resume, progress=progress)
    return run_dir, latest_model_dir(run_dir)


def _eval_raw(settings: DemoSettings) -> dict:
    return settings.eval | {"agent": settings.agent.model_dump(mode="json")}


async def _evaluate_on(rt: Runtime, settings: DemoSettings, problems, out_dir: Path, progress: bool):
    from tirl.eval import evaluate

    cfg = EvalConfig.model_validate(_eval_raw(settings))
    report = await evaluate(rt, {"heldout": problems}, cfg, progress=progress)
    report.write(out_dir)
    return report


async def _evaluate(settings: DemoSettings, model: Path, problems, out_dir: Path, progress: bool):
    """The demo's evaluation of `model` on a runtime of its own (the benchmarks')."""
    from tirl.engines.config import EngineConfig
    from tirl.reward import RewardConfig
    from tirl.runtime import ClusterConfig, open_runtime

    engine = EngineConfig.model_validate(settings.train.get("engine", {}) | {"model": str(model)})
    reward = RewardConfig.model_validate(settings.train.get("reward", {}))
    async with open_runtime(ClusterConfig(), engine, _sandbox_config(settings), reward) as rt:
        return await _evaluate_on(rt, settings, problems, out_dir, progress)


def _evaluate_alone(settings: DemoSettings, model: Path, problems, out_dir: Path, progress: bool) -> Path:
    asyncio.run(_evaluate(settings, model, problems, out_dir, progress))
    return out_dir


def _evaluate_into(
    settings: DemoSettings, model: Path, problems, out_dir: Path, progress: bool, shared: SharedRuntime
) -> Path:
    shared.run_on(model, lambda rt: _evaluate_on(rt, settings, problems, out_dir, progress))
    return out_dir


class SharedRuntime:
    """One runtime (engines, sandbox, reward workers) for the SFT model's evaluation, the first RL run
    and its evaluation: the engines hold the weights each of them needs in turn (the SFT model, then the
    RL run's, synced after its last step), so the demo starts them once instead of three times (each
    start and close ~10 s of 2 cores). Opened by the first phase that runs (a resumed demo skips some),
    with the first RL run's cluster, engine, sandbox and reward settings (the evaluations' too); a phase
    whose model the engines do not hold (a later RL run, a resumed one) closes it for good and opens
    its own, as before."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.holds: str | None = str(Path(cfg.model))  # the model whose weights the engines hold
        self._runner = asyncio.Runner()  # one event loop for every phase: the runtime's tasks live on it
        self._stack: AsyncExitStack | None = None
        self._runtime: Runtime | None = None

    def __enter__(self) -> SharedRuntime:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def serves(self, cfg: TrainConfig) -> bool:
        """Whether an RL run of `cfg` can train on it: the same settings, from the weights it holds."""
        return self.holds == str(Path(cfg.model)) and self.cfg == cfg

    def now_holds(self, model: Path) -> None:
        self.holds = str(Path(model))

    def run(self, work: Callable[[Runtime], Coroutine[Any, Any, T]]) -> T:
        """`work(runtime)` on the shared runtime (opened now if need be)."""
        if self._runtime is None:
            self._runtime = self._runner.run(self._open())
        return self._runner.run(work(self._runtime))

    def run_on(self, model: Path, work: Callable[[Runtime], Coroutine[Any, Any, T]]) -> T:
        """`work(runtime)` with engines serving `model`: the shared runtime if it holds its weights,
        else a runtime of its own for this call (and the shared one is closed: nothing follows in it)."""
        if self.holds == str(Path(model)):
            return self.run(work)
        self.close()
        return asyncio.run(self._alone(model, work))

    async def _open(self) -> Runtime:
        self._stack = AsyncExitStack()
        return await self._stack.enter_async_context(self._opening(self.holds))

    async def _alone(self, model: Path, work: Callable[[Runtime], Coroutine[Any, Any, T]]) -> T:
        async with self._opening(model) as rt:
            return await work(rt)

    def _opening(self, model: str | Path) -> AbstractAsyncContextManager[Runtime]:
        from tirl.runtime import open_runtime

        cfg = self.cfg
        engine = cfg.engine.model_copy(update={"model": str(model)})
        return open_runtime(cfg.cluster, engine, cfg.sandbox, cfg.reward)

    def close(self) -> None:
        """Close the runtime (if it was opened) and its event loop; later phases open their own."""
        self.holds = None
        try:
            if self._stack is not None:
                self._runner.run(self._stack.aclose())
        finally:
            self._stack = self._runtime = None
            self._runner.close()


# ---- report ----


def error_ratio_in_correct(trajectories) -> float | None:
    """Errored tool calls among the calls of correct trajectories (the paper's Figure 4 quantity);
    None when no correct trajectory called the tool (the ratio is undefined, not 0)."""
    return tool_error_ratio(t for t in trajectories if t.reward > 0)


def _pct(x: float | None) -> float | None:
    return None if x is None else round(100 * x, 2)


def _eval_numbers(report) -> dict:
    bench = report.benchmarks["heldout"]
    flat = [t for group in bench.trajectories for t in group]
    m = bench.metrics
    return {
        "accuracy": round(100 * m.pass1, 2),
        "tool_error_ratio_in_correct": _pct(error_ratio_in_correct(flat)),
        "tool_use_rate": _pct(sum(t.num_tool_calls > 0 for t in flat) / max(len(flat), 1)),
        "tool_error_rate": _pct(m.tool_error_rate),
        "response_tokens": round(m.mean_response_tokens, 1),
        "tool_calls_per_trajectory": round(m.tool_calls_per_trajectory, 3),
    }


def _mean_accuracy(evals: dict, tags: list[str]) -> float:
    return sum(_eval_numbers(evals[t])["accuracy"] for t in tags) / len(tags)


def _training_numbers(metrics: list[dict], window: int = 5) -> dict:
    """Means over the first and last `window` steps of the quantities the plots show."""

    def mean(rows, key):
        vals = [r[key] for r in rows if r.get(key) is not None]  # None: n/a that step
        return round(sum(vals) / len(vals), 4) if vals else None

    first, last = metrics[:window], metrics[-window:]
    keys = {
        "reward": "reward/mean",
        "error_ratio_in_correct": "tools/error_ratio_in_correct",
        "response_length": "response/length_mean",
        "tool_calls": "tools/calls_per_traj",
    }
    return {
        f"{name}_{where}": mean(rows, key)
        for name, key in keys.items()
        for where, rows in (("first", first), ("last", last))
    }


def _report(
    settings: DemoSettings,
    out: Path,
    evals: dict,
    train_dirs: dict,
    groups: dict,
    seconds: dict,
    warnings: list[str] | None = None,
) -> dict:
    """`evals` and `train_dirs` by run tag (rl, grpo, or rl_seed0, ...); `groups`: run name -> its tags."""
    from tirl.demo.plots import plot_accuracy, plot_comparison, plot_training
    from tirl.demo.seed_stats import summarize
    from tirl.rl.metrics import read_metrics

    numbers = {tag: _eval_numbers(report) for tag, report in evals.items()}
    training = {tag: read_metrics(d) for tag, d in train_dirs.items()}
    accuracy = {name: [numbers[name]["accuracy"]] for name in ("base", "sft") if name in numbers}
    accuracy |= {name: [numbers[t]["accuracy"] for t in tags] for name, tags in groups.items()}
    summary = {f"{name}_accuracy": round(sum(v) / len(v), 2) for name, v in accuracy.items()}
    summary |= {
        f"{tag}_tool_error_ratio_in_correct": n["tool_error_ratio_in_correct"] for tag, n in numbers.items()
    }
    summary |= {
        "improvement_points": round(summary["rl_accuracy"] - summary["sft_accuracy"], 2),
        "eval": numbers,
        "training": {tag: _training_numbers(rows) for tag, rows in training.items()},
        "heldout_problems": settings.demo.heldout_problems,
        "eval_samples": settings.eval.get("samples"),
        "eval_temperature": settings.eval.get("temperature"),
        "wall_seconds": dict(seconds),
        "warnings": list(warnings or []),
    }
    for stage in ("drills", "shaped_drills"):
        if (out / stage / OUTCOME_FILE).exists():
            summary[stage] = json.loads((out / stage / OUTCOME_FILE).read_text())
    if len(groups) > 1 or any(len(tags) > 1 for tags in groups.values()):
        by_seed = {name: [training[t] for t in tags] for name, tags in groups.items()}
        summary["comparison"] = summarize(by_seed, accuracy)
    plots = [plot_accuracy({n: summary[f"{n}_accuracy"] for n in accuracy}, out)]
    if all(len(tags) == 1 for tags in groups.values()):
        plots += plot_training(training, out)
    if "comparison" in summary:
        plots += plot_comparison(summary["comparison"], out)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "report.md").write_text(_markdown(settings, summary, evals, plots))
    return summary


LABELS = {"base": "base model", "sft": "SFT", "rl": "GRPO-RoC", "grpo": "plain GRPO"}


def _cell(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def _interval_cell(iv: dict | None, scale: float = 1.0) -> str:
    if iv is None:
        return "n/a"
    p = "" if iv.get("p") is None else f", p={iv['p']:.3f}"
    return f"{scale * iv['mean']:.2f} [{scale * iv['low']:.2f}, {scale * iv['high']:.2f}]{p}"


def _comparison_markdown(comparison: dict | None) -> list[str]:
    """The multi-seed table: each quantity's mean [95% interval] per run and the paired difference."""
    if comparison is None:
        return []
    from tirl.demo.seed_stats import CURVES

    names = [n for n in comparison["heldout_accuracy"] if n not in ("sft", "difference")]
    head = " | ".join(LABELS.get(n, n) for n in names)
    lines = [
        f"## Comparison over {comparison['seeds']} seeds (mean [95% interval])",
        "",
        f"Training quantities: means over the last {comparison['last_steps']} steps of each seed; held-out "
        "accuracy: after RL, SFT shown for reference. Difference: first run minus second, paired by seed.",
        "",
        f"| quantity | {head} | difference |",
        "| --- |" + " --- |" * (len(names) + 1),
    ]
    rows = [(CURVES[k][0], comparison["final"][k], CURVES[k][1]) for k in CURVES]
    rows.append(("Held-out accuracy (%)", comparison["heldout_accuracy"], 1.0))
    for title, values, scale in rows:
        cells = [_interval_cell(values.get(n), scale) for n in [*names, "difference"]]
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    sft = comparison["heldout_accuracy"].get("sft")
    if sft:
        lines += ["", f"SFT model (the start of every run): {sft['mean']:.2f}% held-out accuracy."]
    return [*lines, "", *_claims_markdown(comparison, names)]


def _claims_markdown(comparison: dict, names: list[str]) -> list[str]:
    """The paper's claims, each with its paired test (only for GRPO-RoC against plain GRPO)."""
    from tirl.demo.seed_stats import claims

    if names != ["rl", "grpo"]:
        return []
    lines = [
        "## The paper's claims, tested",
        "",
        f"Change: a run's mean over its last {comparison['last_steps']} steps minus its first "
        f"{comparison['last_steps']}; difference: GRPO-RoC minus plain GRPO, paired by seed. Mean "
        "[95% interval], two-sided t-test against zero.",
        "",
        "| claim | tested | mean [95% interval], p | verdict |",
        "| --- | --- | --- | --- |",
    ]
    for row in claims(comparison):
        lines.append(
            f"| {row['claim']} | {row['tested']} | {_interval_cell(row['interval'])} | {row['verdict']} |"
        )
    return [*lines, ""]


def _drills_markdown(drills: dict | None) -> list[str]:
    """A drill stage's outcome in one line, with the held-out copy accuracy at each check."""
    if drills is None:
        return []
    from tirl.demo.drills import DrillOutcome

    curve = ", ".join(f"{h['step']}: {h['copy_accuracy']:.0%}" for h in drills["history"])
    line = DrillOutcome(**drills).message()
    return [f"{line[0].upper()}{line[1:]} (held-out copy accuracy by step: {curve}).", ""]


def _model_words(demo: DemoConfig) -> str:
    if demo.model is None:
        return f"A {demo.preset!r} tiny Qwen3 model"
    return f"The pretrained model {Path(demo.model).name} (evaluated as it is first)"


def _markdown(settings: DemoSettings, summary: dict, evals: dict, plots: list[Path]) -> str:
    ev = summary["eval"]
    cols = ("accuracy", "tool_use_rate", "tool_error_ratio_in_correct", "tool_error_rate", "response_tokens")
    rows = [f"| {LABELS.get(n, n)} | " + " | ".join(_cell(v[c]) for c in cols) + " |" for n, v in ev.items()]
    lines = [
        "# tirl demo report",
        "",
        *(f"**Warning: {w}.**\n" for w in summary.get("warnings", [])),
        f"{_model_words(settings.demo)}, SFT on programmatic tool-using traces, then "
        f"{settings.demo.rl_steps} RL steps against the real sandbox. Held-out: {summary['heldout_problems']} "
        f"synthetic problems x {summary['eval_samples']} samples at temperature {summary['eval_temperature']} "
        "(identical settings for every model).",
        "",
        "| model | held-out accuracy % | tool use % | tool-error ratio in correct % | tool-error rate % | response tokens |",
        "| --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
        f"RL gain over SFT: **{summary['improvement_points']:+.1f} points**.",
        "",
        *_drills_markdown(summary.get("drills")),
        *_drills_markdown(summary.get("shaped_drills")),
        *_comparison_markdown(summary.get("comparison")),
        "## Plots",
        "",
        *(f"![{p.stem}]({p.name})" for p in plots),
        "",
        "## Training (means over the first / last 5 steps)",
        "",
        "```json",
        json.dumps(summary["training"], indent=2),
        "```",
        "",
        "## Wall time (s)",
        "",
        *(f"- {k}: {v}" for k, v in summary["wall_seconds"].items()),
        "",
    ]
    for name, report in evals.items():
        body = report.to_markdown().replace(
            "# Evaluation report", f"## Evaluation: {LABELS.get(name, name)}", 1
        )
        lines += [body, ""]
    return "\n".join(lines)
