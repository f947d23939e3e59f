"""A bounded sample of each RL step's trajectories, for `tirl view` (logging.trajectories_per_step).

Appended to RUN/trajectories.jsonl: per step, up to k trajectories drawn uniformly (seeded by the
step, so a resumed run writes the same ones) from all scored rollouts, kept and dropped alike, each
with what RoC saw (p_err, p_format, p_total), whether it was kept, its advantage and its group's
outcome. Token ids and log-probs are left out (per-turn token counts stay), so a long run stays small.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tirl.agent.trajectory import Trajectory, turn_token_counts
from tirl.reward import extract_answer
from tirl.rl.advantages import resolve_advantage
from tirl.rl.roc import is_positive, penalties
from tirl.seeds import derive_seed

FILE = "trajectories.jsonl"
_STREAM = 0x7472616A  # keeps this sample's random numbers apart from every other use of (seed, step)


def compact(t: Trajectory) -> dict:
    """The trajectory without its token ids and log-probs; token counts per turn instead."""
    d = t.to_dict()
    for key in ("prompt_ids", "response_ids", "loss_mask", "logprobs", "versions"):
        del d[key]
    return d | {"prompt_tokens": len(t.prompt_ids), "turn_tokens": turn_token_counts(t.loss_mask)}


def step_sample(
    step: int,
    stage: int,
    problems: Sequence,
    groups: Sequence[Sequence[Trajectory]],
    kept: Sequence[Sequence[int]],
    k: int,
    seed: int,
    advantage: str,
    no_tool_p_err: float,
) -> list[dict]:
    """Records of up to k of this step's trajectories (`groups[i]` are the rollouts of `problems[i]`)."""
    members = [(i, j) for i, g in enumerate(groups) for j in range(len(g))]
    rng = np.random.default_rng(derive_seed(seed, step, _STREAM))
    chosen = sorted(rng.choice(len(members), size=min(k, len(members)), replace=False).tolist())
    records = []
    for i, j in (members[n] for n in chosen):
        t, group = groups[i][j], groups[i]
        advantages = dict(
            zip(kept[i], resolve_advantage(advantage)([group[m].reward for m in kept[i]]), strict=True)
        )
        p = penalties(t, no_tool_p_err)
        roc = {
            "kept": j in advantages,
            "advantage": advantages.get(j),
            "p_err": p.p_err,
            "p_format": p.p_format,
            "p_total": p.p_total,
            "no_tool_p_err": no_tool_p_err,
            "group": i,
            "group_size": len(group),
            "group_kept": len(kept[i]),
            "group_correct": sum(is_positive(m) for m in group),
        }
        records.append(
            {
                "step": step,
                "stage": stage,
                "problem": problems[i].problem,
                "reference": problems[i].answer,
                "answer": extract_answer(t.model_turns),  # the model's own, never a tool's
                "roc": roc,
                **compact(t),
            }
        )
    return records


def append(run_dir: Path, records: list[dict]) -> None:
    with (Path(run_dir) / FILE).open("a", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def truncate_after(run_dir: Path, step: int) -> None:
    """On resume, drop the samples of steps the checkpoint does not contain (they will be redone)."""
    path = Path(run_dir) / FILE
    if path.exists():
        lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
        keep = [ln for ln in lines if json.loads(ln).get("step", 0) <= step]
        path.write_text("".join(ln + "\n" for ln in keep), encoding="utf-8")
