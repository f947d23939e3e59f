"""The tiny demo's GRPO-RoC with LoRA adapters next to full fine-tuning, from one finished `tirl demo`
(same SFT model, data, seed, step budget and evaluation; only `optim` differs): held-out accuracy,
RL wall and step time, trainable parameters, the trainer's gradient + AdamW bytes, and the peak RSS of
each side's process.

    .venv/bin/python benchmarks/lora_demo.py --demo runs/demo [--rank 16] [--lr 1e-3] [--out runs/lora_demo]

The two sides run at the same time, each in its own process, so both see the same machine load (on a
shared 2-core machine, back to back runs see different loads and their times do not compare). Each
side is a full `tirl train` of the demo config plus the demo's held-out evaluation
(benchmarks/async_demo.py's `run`). Results: OUT/full.json, OUT/lora.json, OUT/lora_demo.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

from async_demo import run  # this directory is on sys.path when the script runs
from tirl.demo.pipeline import load_settings, train_config
from tirl.rl.config import TrainConfig

SIDES = ("full", "lora")
BYTES_PER_TRAINABLE = 4 + 8  # fp32 gradient + AdamW's two fp32 moments


def side_overrides(side: str, rank: int, lr: float | None) -> list[str]:
    """The demo settings of one side: LoRA on all linear layers at `lr` (default: the demo's own lr)."""
    if side == "full":
        return []
    extra = [
        "train.optim.lora.enabled=true",
        f"train.optim.lora.rank={rank}",
        f"train.optim.lora.alpha={2 * rank}",
    ]
    return extra + ([f"train.optim.lr={lr}"] if lr is not None else [])


def trainer_state(cfg: TrainConfig) -> dict:
    """Trainable parameters and their gradient + AdamW bytes, counted on the meta device (exact)."""
    from tirl.rl.lora import apply_lora, meta_model

    policy = meta_model(cfg.model)
    if cfg.optim.lora.enabled:
        apply_lora(policy, cfg.optim.lora)
    total = sum(p.numel() for p in policy.parameters())
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    return {"parameters": total, "trainable": trainable, "grad_adamw_bytes": trainable * BYTES_PER_TRAINABLE}


def run_side(side: str, args: argparse.Namespace) -> dict:
    from tirl.rl.checkpoint import latest_model_dir

    demo, out = Path(args.demo), Path(args.out)
    settings = load_settings(overrides=[*args.overrides, *side_overrides(side, args.rank, args.lr)])
    cfg = train_config(
        settings, latest_model_dir(demo / "sft"), str(demo / "data" / "rl_train.jsonl"), out, side
    )
    result = run(settings, demo, out, side)
    result |= trainer_state(cfg) | {"lr": cfg.optim.lr}
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux
    (out / f"{side}.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def table(results: list[dict]) -> str:
    head = (
        f"{'side':<6} {'lr':>8} {'trainable':>10} {'grad+AdamW MB':>14} {'peak RSS MB':>12} "
        f"{'RL wall s':>10} {'step s':>7} {'reward (last 5)':>16} {'gap max':>9} {'held-out':>9}"
    )
    lines = [head]
    for r in results:
        gap = "n/a" if r["engine_gap_max"] is None else f"{r['engine_gap_max']:.1e}"
        lines.append(
            f"{r['run']:<6} {r['lr']:>8.0e} {r['trainable']:>10,} {r['grad_adamw_bytes'] / 2**20:>14.2f} "
            f"{r['peak_rss_mb']:>12.0f} {r['rl_wall_s']:>10.0f} {r['step_s']:>7.1f} {r['reward_last5']:>16.3f} "
            f"{gap:>9} {r['heldout_accuracy']:>8.1f}%"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--demo", required=True, help="a finished `tirl demo` output directory")
    ap.add_argument("--out", default="runs/lora_demo")
    ap.add_argument("--rank", type=int, default=16, help="optim.lora.rank (alpha = 2 x rank)")
    ap.add_argument("--lr", type=float, default=1e-3, help="the LoRA side's optim.lr")
    ap.add_argument("--side", choices=SIDES, help="run one side in this process (the parent runs both)")
    ap.add_argument("overrides", nargs="*", help="demo settings for both sides, e.g. demo.seed=1")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    demo, out = Path(args.demo), Path(args.out)
    if not (demo / "sft").is_dir() or not (demo / "data" / "heldout.jsonl").is_file():
        raise SystemExit(f"{demo} is not a finished `tirl demo` directory (no sft/ or data/heldout.jsonl)")
    out.mkdir(parents=True, exist_ok=True)
    if args.side:
        run_side(args.side, args)
        return
    argv = sys.argv[1:] if argv is None else argv
    children = [subprocess.Popen([sys.executable, __file__, *argv, "--side", side]) for side in SIDES]
    if any(child.wait() for child in children):
        raise SystemExit("a side failed (its output is above)")
    results = [json.loads((out / f"{side}.json").read_text()) for side in SIDES]
    (out / "lora_demo.json").write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))


if __name__ == "__main__":
    from tirl.lifetime import children_die_with_me

    children_die_with_me()  # its engines, sandboxes and workers die with it, even on kill -9
    main()
