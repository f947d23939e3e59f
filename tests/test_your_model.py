"""docs/your-model.md runs as written, with a model that is not the demo's: its JSONL blocks are saved as
the files the page names, and its shell commands run in order in a fresh directory at small sizes (fewer
steps, samples and tokens; the benchmarks from small local files). The commands that need the network
are listed with the reason they do not run here."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from tests.terminal import tirl_env
from tests.test_readme import BENCHMARK_FILES, Rule, command_line, run, shell_commands, small
from tests.test_readme import write_problems as write_benchmark

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "your-model.md"
FEW_TOKENS = ["--max-tokens", "48", "--max-turns", "2"]
SMALL_RL = [
    "algorithm.prompts_per_step=2", "algorithm.group_size=2", "agent.max_response_tokens=32",
    "rollout_concurrency=8", "optim.micro_batch_tokens=1024",
]  # fmt: skip

# Each command of the page (a prefix, as command_line writes it) and how it runs small.
SMALL: dict[str, Rule] = {
    "tirl model init": Rule(),
    "tirl data prepare --input my_problems.jsonl": Rule(),
    "tirl eval": Rule(replace={"50": "1", "4": "1"}, extra=FEW_TOKENS),
    "tirl sft": Rule(extra=["max_length=256"]),
    "tirl train": Rule(
        replace={
            "stages=[{name: mine, steps: 20, data: data/my_rl.jsonl}]": "stages=[{name: mine, steps: 1, data: data/my_rl.jsonl}]"
        },
        extra=SMALL_RL,
    ),
}
# Commands of the page that need the network (this test has none).
NOT_RUN = {
    "pip install -e .[hf]": "an install from the package index",
    "tirl data prepare --input BytedTsinghua-SIA/DAPO-Math-17k": "downloads DAPO-Math-17k from the Hub; "
    "the same command on local files runs above",
}


def page_steps() -> list[tuple[str, str]]:
    """(language, text) of the page's fenced blocks in order; a JSONL block's text is preceded by the
    file name the page says to save it as."""
    text = PAGE.read_text()
    steps = []
    for match in re.finditer(r"```(\w+)\n(.*?)```", text, flags=re.S):
        language, block = match.groups()
        if language == "jsonl":
            names = re.findall(r"`([\w./-]+\.jsonl)`", text[max(0, match.start() - 120) : match.start()])
            assert names, f"a JSONL block of {PAGE.name} does not say which file it is"
            block = f"{names[-1]}\n{block}"
        steps.append((language, block))
    return steps


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_your_model_page_runs_as_written(tmp_path: Path):
    data = tmp_path / "benchmarks"
    data.mkdir()
    for name, rows in BENCHMARK_FILES.items():
        write_benchmark(data / name, rows)
    (tmp_path / "src").symlink_to(ROOT / "src")
    env = tirl_env() | {"TIRL_DATA_DIR": str(data), "HF_HUB_OFFLINE": "1"}
    ran = []
    for language, block in page_steps():
        if language == "jsonl":
            name, _, lines = block.partition("\n")
            assert all(json.loads(line) for line in lines.splitlines())
            (tmp_path / name).write_text(lines)
            continue
        for argv in shell_commands(block) if language == "bash" else []:
            line = command_line(argv)
            if any(line.startswith(key) for key in NOT_RUN):
                continue
            key = max((k for k in SMALL if line.startswith(k)), key=len, default=None)
            assert key is not None, (
                f"`{shlex.join(argv)}` has no small-size rule here and no reason not to run"
            )
            run(small(argv, SMALL[key], port=0), tmp_path, env)
            ran.append(key)
    assert set(ran) == set(SMALL), set(SMALL) ^ set(ran)
    preset = json.loads((tmp_path / "models" / "my-model" / "tirl_preset.json").read_text())
    assert preset.get("preset") != "demo"  # not the demo's model
    assert (tmp_path / "runs" / "my-eval" / "report.md").is_file()
    assert (tmp_path / "runs" / "my-rl" / "checkpoints").is_dir()


def test_every_command_of_the_page_runs_here_or_says_why_not():
    """Fast guard: each shell command has a rule or a reason, and each rule and reason is used."""
    commands = [
        command_line(argv)
        for language, block in page_steps()
        if language == "bash"
        for argv in shell_commands(block)
    ]
    used = {k for k in [*SMALL, *NOT_RUN] for line in commands if line.startswith(k)}
    assert used == set(SMALL) | set(NOT_RUN), (set(SMALL) | set(NOT_RUN)) - used
    assert all(any(line.startswith(k) for k in [*SMALL, *NOT_RUN]) for line in commands), commands
