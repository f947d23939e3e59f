"""Copy drills until the model copies (stage 0a of `tirl demo`).

A randomly initialized model learns to copy numbers ("Repeat: 812 40" -> "812 40") abruptly, in an
induction-head phase change whose step moves with the seed, the float rounding and the thread count
(docs/results.md, "why SFT fell"): a fixed step budget made the demo a coin toss. The demo preset's
copy heads (tirl.tiny_model.init_copy_heads) make the change early on every seed measured, and the
drills still run until the skill is MEASURED: every `check_every` steps the model's greedy copy of held-out drills is
checked (teacher-forced argmax over the whole completion: exactly what greedy decoding would emit),
and the drills stop once `target` of them are copied exactly, or at `max_steps` (the outcome then
says the model did not learn to copy, and the demo says so in one line).
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from tirl.rl.config import SFTConfig

OUTCOME_FILE = "drill_outcome.json"


@dataclass(frozen=True)
class StopRule:
    """When the drills end: `target` held-out exact-copy share reached, checked every `check_every`
    steps (at least `min_steps` first), or `max_steps` (the cap) spent."""

    max_steps: int
    check_every: int = 25
    target: float = 0.95
    heldout: int = 128
    min_steps: int = 0

    def __post_init__(self) -> None:
        if self.check_every < 1 or not 0.0 < self.target <= 1.0 or self.heldout < 1:
            raise ValueError(f"bad drill stop rule {self}: check_every >= 1, 0 < target <= 1, heldout >= 1")

    def checks_at(self, step: int) -> bool:
        return step >= self.min_steps and (step % self.check_every == 0 or step == self.max_steps)


@dataclass
class DrillOutcome:
    """What the drills reached: the steps run, the last held-out copy accuracy, and every check."""

    steps: int
    accuracy: float
    target: float
    max_steps: int
    history: list[dict] = field(default_factory=list)  # {"step", "loss", "copy_accuracy"} per check
    name: str = "copy drills"  # what drilled, in the messages
    cap_knob: str = "demo.drill_steps"  # the setting that raises the cap

    @property
    def learned(self) -> bool:
        return self.accuracy >= self.target

    def message(self) -> str:
        """One line: what the drills reached (and, short of the target, what to do about it)."""
        if self.learned:
            return (
                f"{self.name}: the model copies {self.accuracy:.0%} of held-out drills exactly after "
                f"{self.steps} steps (target {self.target:.0%})"
            )
        return (
            f"{self.name} did not learn to copy: {self.accuracy:.0%} of held-out drills copied exactly after "
            f"the cap of {self.max_steps} steps (target {self.target:.0%}); the SFT model would be useless: "
            f"raise {self.cap_knob} or drills.optim.lr, or change demo.seed"
        )

    def write(self, run_dir: Path) -> None:
        (run_dir / OUTCOME_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def read(cls, run_dir: Path) -> DrillOutcome:
        return cls(**json.loads((run_dir / OUTCOME_FILE).read_text()))


def _samples(tokenizer, drills: list[dict], max_length: int):
    from tirl.rl.sft import tokenize_example

    return [tokenize_example(tokenizer, d, max_length)[0] for d in drills]


@torch.no_grad()
def copy_accuracy(model: torch.nn.Module, samples, pad_id: int) -> float:
    """The share of samples whose every trained token is the model's argmax given the tokens before
    it: the share greedy decoding would copy exactly."""
    was_training = model.training
    model.eval()
    try:
        longest = max(len(s.input_ids) for s in samples)
        ids = torch.full((len(samples), longest), pad_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        mask = torch.zeros((len(samples), longest - 1), dtype=torch.bool)
        for i, s in enumerate(samples):
            ids[i, : len(s.input_ids)] = torch.tensor(s.input_ids)
            attn[i, : len(s.input_ids)] = 1
            mask[i, : len(s.loss_mask)] = torch.tensor(s.loss_mask, dtype=torch.bool)
        device = next(model.parameters()).device
        logits = model(input_ids=ids.to(device), attention_mask=attn.to(device)).logits
        right = logits[:, :-1].argmax(-1).cpu() == ids[:, 1:]
        return float((right | ~mask).all(-1).float().mean())
    finally:
        model.train(was_training)


def run_drills(
    cfg: SFTConfig,
    train: list[dict],
    heldout: list[dict],
    rule: StopRule,
    say=print,
    name: str = "copy drills",
    cap_knob: str = "demo.drill_steps",
) -> DrillOutcome:
    """Train on `train` drills (cfg.batch_size per step, in order) until `rule` stops; saves the model
    as the run's one checkpoint (cfg.run_dir, like `tirl sft`) and the outcome beside it. A run
    interrupted before it finished starts over (the drills take a minute or two on idle cores)."""
    from tirl.distributed.groups import init_distributed
    from tirl.engines.tokenizer import load_tokenizer
    from tirl.rl.checkpoint import prepare_run_dir, resolve_model_path
    from tirl.rl.losses import BatchCounts, token_mean
    from tirl.rl.policy import Policy

    needed = rule.max_steps * cfg.batch_size
    if len(train) < needed:
        raise ValueError(f"{len(train)} drills for {rule.max_steps} steps of {cfg.batch_size}: need {needed}")
    info = init_distributed(cfg.optim.device)
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    prepare_run_dir(cfg.run_dir, cfg, resume=False, is_main=True, say=say)
    model_path = resolve_model_path(cfg.model)
    tokenizer = load_tokenizer(model_path)
    held = _samples(tokenizer, heldout[: rule.heldout], cfg.max_length)
    policy = Policy(model_path, cfg.optim, info, rule.max_steps)
    outcome = DrillOutcome(0, 0.0, rule.target, rule.max_steps, name=name, cap_knob=cap_knob)
    for step in range(1, rule.max_steps + 1):
        batch = _samples(
            tokenizer, train[(step - 1) * cfg.batch_size : step * cfg.batch_size], cfg.max_length
        )
        counts = BatchCounts(max(sum(s.num_trained for s in batch), 1), len(batch))
        loss = policy.accumulate(batch, lambda mb, c=counts: token_mean(-mb.logprobs, mb.mask, c))
        policy.step()
        policy.advance_schedule()
        if not math.isfinite(loss):
            raise FloatingPointError(f"{name}: loss {loss} at step {step}: lower drills.optim.lr")
        if rule.checks_at(step):
            acc = copy_accuracy(policy.model, held, policy.pad_id)
            outcome.steps, outcome.accuracy = step, acc
            outcome.history.append({"step": step, "loss": round(loss, 4), "copy_accuracy": round(acc, 4)})
            say(f"{name} step {step}/{rule.max_steps} loss {loss:.4f} held-out copy accuracy {acc:.0%}")
            if outcome.learned:
                break
    policy.save(cfg.run_dir, outcome.steps, tokenizer, {"step": outcome.steps, "epoch": 0}, keep_last=1)
    outcome.write(cfg.run_dir)
    return outcome
