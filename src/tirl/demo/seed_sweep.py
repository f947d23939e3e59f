"""`tirl demo --demo-seeds N`: the whole demo (drills, SFT, RL) once per `demo.seed`, and the spread.

`--seeds` varies only the RL seed from one SFT model; the demo's luck lives earlier (whether the copy
skill emerges: docs/results.md, "why SFT fell"), so this varies `demo.seed` itself: seeds demo.seed,
demo.seed + 1, ... each a full demo in OUT/seed<S> (with demo.checks=warn: a seed that falls short is
a row of the table, not the end of the sweep). Resumable: with `resume` a finished seed (its
summary.json) is kept, an interrupted one continues with the demo's own --resume, a new one starts;
so a sweep can also be extended with a larger N. OUT/report.md and OUT/summary.json give the per-seed
table (drill outcome, SFT, RL, minutes) and each number's mean [95% interval] (tirl.demo.seed_stats).
"""

from __future__ import annotations

import json
from pathlib import Path

from tirl.demo.pipeline import CONFIG_DIR, MARKER, load_settings, prepare_out, run_demo, settings_record
from tirl.demo.seed_stats import interval

SUMMARY = "summary.json"


def run_demo_seeds(
    out: str | Path,
    n: int,
    overrides: list[str] | None = None,
    config_dir: str | Path = CONFIG_DIR,
    progress: bool = True,
    resume: bool = False,
    say=print,
) -> dict:
    """N full demos with consecutive demo.seed values; returns the sweep's summary (OUT/summary.json)."""
    from tirl.config import ConfigError

    if n < 1:
        raise ConfigError(f"--demo-seeds {n}: give at least 1")
    overrides = [*(overrides or []), "demo.checks=warn"]
    settings = load_settings(config_dir, overrides)
    record = settings_record(settings, None, 1) | {"demo_seeds": "per-seed directories"}
    out = _prepare(Path(out), record, resume)
    rows = []
    for k in range(n):
        seed = settings.demo.seed + k
        run_dir = out / f"seed{seed}"
        if resume and (run_dir / SUMMARY).exists():
            say(f"demo seed {seed} [{k + 1}/{n}]: finished before, kept")
        else:
            say(f"demo seed {seed} [{k + 1}/{n}]: the whole demo in {run_dir}")
            again = resume and (run_dir / MARKER).exists()
            run_demo(run_dir, overrides=[*overrides, f"demo.seed={seed}"], config_dir=config_dir,
                     progress=progress, resume=again)  # fmt: skip
        rows.append(seed_row(seed, json.loads((run_dir / SUMMARY).read_text())))
    summary = {"seeds": rows, "spread": spread(rows)}
    (out / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
    (out / "report.md").write_text(markdown(summary, overrides))
    return summary


def _prepare(out: Path, record: dict, resume: bool) -> Path:
    """The sweep's directory: --resume continues only one written with the same base settings (the
    seed and N aside: a sweep may be extended)."""
    if resume and not (out / MARKER).exists():
        resume = False  # nothing to continue: a fresh sweep
    return prepare_out(out, record, resume)


def seed_row(seed: int, summary: dict) -> dict:
    """One seed's line of the table from its demo's summary.json."""
    drills, shaped = summary.get("drills"), summary.get("shaped_drills")
    return {
        "seed": seed,
        "drill_steps": drills["steps"] if drills else None,
        "drill_copy_accuracy": round(100 * drills["accuracy"], 1) if drills else None,
        "drills_learned": drills["accuracy"] >= drills["target"] if drills else None,
        "shaped_drill_steps": shaped["steps"] if shaped else None,
        "shaped_drill_accuracy": round(100 * shaped["accuracy"], 1) if shaped else None,
        "sft_accuracy": summary["sft_accuracy"],
        "rl_accuracy": summary["rl_accuracy"],
        "minutes": round(summary["wall_seconds"]["total"] / 60, 1),
        "warnings": summary.get("warnings", []),
    }


def spread(rows: list[dict]) -> dict:
    """Mean [95% interval], min and max of each number over the seeds."""
    result = {}
    for key in ("sft_accuracy", "rl_accuracy", "drill_steps", "minutes"):
        values = [r[key] for r in rows if r[key] is not None]
        iv = interval(values)
        result[key] = None if iv is None else {
            "mean": round(iv.mean, 2), "low": round(iv.low, 2), "high": round(iv.high, 2),
            "min": min(values), "max": max(values),
        }  # fmt: skip
    gains = [r["rl_accuracy"] - r["sft_accuracy"] for r in rows]
    iv = interval(gains)
    result["gain_points"] = {"mean": round(iv.mean, 2), "low": round(iv.low, 2), "high": round(iv.high, 2)}
    return result


def _cell(x) -> str:
    return "n/a" if x is None else str(x)


def markdown(summary: dict, overrides: list[str]) -> str:
    rows, s = summary["seeds"], summary["spread"]
    lines = [
        f"# tirl demo over {len(rows)} values of demo.seed",
        "",
        "Each seed is a whole demo (its own data, model, drills, SFT and RL) in seed<S>/; overrides: "
        f"`{' '.join(overrides)}`.",
        "",
        "| demo.seed | copy drills: steps, held-out % | shaped drills: steps, held-out % | SFT % | GRPO-RoC % "
        "| gain (points) | minutes | warnings |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        drills = f"{_cell(r['drill_steps'])}, {_cell(r['drill_copy_accuracy'])}"
        shaped = f"{_cell(r.get('shaped_drill_steps'))}, {_cell(r.get('shaped_drill_accuracy'))}"
        gain = r["rl_accuracy"] - r["sft_accuracy"]
        lines.append(
            f"| {r['seed']} | {drills} | {shaped} | {r['sft_accuracy']:.1f} | {r['rl_accuracy']:.1f} | {gain:+.1f} | "
            f"{r['minutes']} | {'; '.join(r['warnings']) or '-'} |"
        )
    lines += ["", "Spread over the seeds (mean [95% interval], min-max):", ""]
    for key, title in (("sft_accuracy", "SFT %"), ("rl_accuracy", "GRPO-RoC %"), ("minutes", "minutes")):
        v = s.get(key)
        if v is not None:
            lines.append(f"- {title}: {v['mean']} [{v['low']}, {v['high']}], {v['min']}-{v['max']}")
    g = s["gain_points"]
    lines.append(f"- RL gain (points): {g['mean']} [{g['low']}, {g['high']}]")
    return "\n".join(lines) + "\n"
