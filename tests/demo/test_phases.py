"""The demo's phase lines: a phase with nothing to do (e.g. the drills under `--quick`) says "skipped"
and why, not "(at most 0 steps)" and a wall time of 0.0 s."""

from __future__ import annotations

from pathlib import Path

from tirl.demo.pipeline import Phases


class Lines:
    """A console that keeps what it is asked to print."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def rule(self, text: str) -> None:
        self.lines.append(f"rule {text}")

    def print(self, text: str) -> None:
        self.lines.append(text)


def test_a_skipped_phase_says_skipped_and_why(tmp_path: Path):
    console = Lines()
    phases = Phases(console, tmp_path, total=2)
    result = phases.run(
        "drills",
        "SFT on copy drills until 90% are copied (at most 0 steps)",
        lambda: tmp_path,
        "demo.drill_steps=0",
    )
    assert result == tmp_path and phases.seconds == {"drills": 0.0}
    assert console.lines == [
        "rule [bold]demo 1/2: SFT on copy drills until 90% are copied",
        "skipped (demo.drill_steps=0)",
    ]
    phases.run("sft", "SFT on 8 examples", lambda: tmp_path)
    assert console.lines[2] == "rule [bold]demo 2/2: SFT on 8 examples" and console.lines[3].startswith(
        "[green]done[/]"
    )
