"""Each demo phase checks its own outcome and says in one line when it falls short.

A demo whose copy drills never learned to copy, or whose SFT model never calls its tool, used to run
its RL phase to the end and report `SFT 0.0% -> GRPO-RoC 0.0%` with no word on why. Now each check
below returns None or one line naming what fell short; `Checks` either stops the demo there
(demo.checks=stop, the default: RL from a useless SFT model is minutes spent for nothing) or keeps the
line as a warning that report.md and summary.json carry at the top (demo.checks=warn).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tirl.demo.drills import OUTCOME_FILE, DrillOutcome


class DemoShortfall(RuntimeError):
    """A phase's outcome fell short of its check (demo.checks=stop); the message is one line."""


def drills_shortfall(run_dir: Path) -> str | None:
    """The drills' outcome (written by tirl.demo.drills) short of its target, or None. A directory
    without an outcome (demo.drill_steps=0: no drills) has nothing to check."""
    if not (run_dir / OUTCOME_FILE).exists():
        return None
    outcome = DrillOutcome.read(run_dir)
    return None if outcome.learned else outcome.message()


def sft_shortfall(numbers: dict, min_tool_use: float, min_accuracy: float) -> str | None:
    """The SFT model's held-out numbers (percentages) below the floors, or None."""
    use, acc = numbers["tool_use_rate"] or 0.0, numbers["accuracy"]
    if use >= min_tool_use and acc >= min_accuracy:
        return None
    return (
        f"the SFT model is useless: it calls the tool in {use:.1f}% of held-out trajectories (floor "
        f"{min_tool_use:g}%) and solves {acc:.1f}% (floor {min_accuracy:g}%); RL from it learns little: "
        "check the drills' outcome (drills/drill_outcome.json) and the SFT loss (sft/metrics.jsonl)"
    )


def rl_shortfall(sft_accuracy: float, rl_accuracy: float) -> str | None:
    """RL did not beat SFT on held-out accuracy, or None."""
    if rl_accuracy > sft_accuracy:
        return None
    return (
        f"RL did not beat SFT: held-out accuracy {sft_accuracy:.1f}% -> {rl_accuracy:.1f}%; see the "
        "training curves (plots, rl/metrics.jsonl) and the alerts in the run's log"
    )


@dataclass
class Checks:
    """`stop`: the first shortfall ends the demo (DemoShortfall); `warn`: it is kept in `warnings`."""

    mode: str = "stop"
    say: object = print
    warnings: list[str] = field(default_factory=list)

    def expect(self, shortfall: str | None, stops: bool = True) -> None:
        """Act on one check's result; `stops=False` for a check with nothing left to stop (RL's)."""
        if shortfall is None:
            return
        if self.mode == "stop" and stops:
            raise DemoShortfall(f"{shortfall} (demo.checks=warn carries on regardless)")
        self.warnings.append(shortfall)
        self.say(f"warning: {shortfall}")
