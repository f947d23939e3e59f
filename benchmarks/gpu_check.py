"""The GPU check (issue 39): one command that checks, on one lent GPU and in a few minutes, what only a
GPU can, and prints a verdict per part with its numbers (JSON lines, then a markdown table).

    python3 benchmarks/gpu_check.py [--only memory,speed] [--device cuda|cpu] [--budget-s 450]
                                    [--out DIR] [--wheels .gpu-wheels] [--layers N] [--commit SHA]

Parts, in this order (by value; docs/gpu-validation.md says what each proves and what it cannot):
  e2e        `tirl train` (a subprocess) with the tiny demo model, the HF engine and the real sandbox,
             3 steps in bf16 and in fp32 (the engine log-prob gap of each); the suite's CUDA-only tests.
  memory     tirl's RL update (tirl.rl.update.grpo_update through tirl.rl.policy.Policy: bf16 mixed
             precision, the chunked head, activation checkpointing, the padding mask, AdamW, clipping)
             on a Qwen3-14B-width model with random weights and as many layers as fit, at the rstar2
             recipe's micro-batch (2 x 16K tokens), 3 micro-batches per update; then the same with FSDP2
             forced on over a one-rank process group. Peak allocated/reserved next to `tirl plan`'s.
  colocated  a small model: one update, the trainer's state offloaded and back, a sharded checkpoint and
             its Hugging Face export (full and LoRA), loaded back, one more step resumed exactly.
  speed      the part-1 update's tokens/s and MFU; the chunked head against the unchunked one at 8K and
             32K tokens (time, memory); the same-device weight handoff through the flat buffer.

`--device cpu` runs every part at toy size (the test suite does, so the script cannot rot unseen); what
needs CUDA says SKIP with the reason. A failed part prints its traceback's head and FAIL; the others run.
A part the budget cuts (not started, or its subprocess stopped) is SKIP, not FAIL. With --out, each
part's line is written the moment it ends: a run killed later still returns what it finished.
`--commit SHA` (or TIRL_COMMIT) names the commit where the copied tree has no .git.
`--wheels DIR`: install the wheels `make gpu-wheels` downloaded (no index) before anything else.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import functools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # the copied tree on the GPU machine has tirl uninstalled

import torch  # noqa: E402

# By value, most first: the parts that run late are the ones a short budget cuts. e2e is the only
# end-to-end evidence (and touches no CUDA in this process, so memory's plan child still forks).
PARTS = ("e2e", "memory", "colocated", "speed")
# A part's subprocesses (tirl train, pytest) get at most this much of what is left, so one slow part
# leaves the next ones their turn.
PART_SHARE_S = {"e2e": 200.0}
GiB = 2**30
RECIPE_MICRO_BATCH_TOKENS = 32768  # src/tirl/configs/rstar2/train.yaml: optim.micro_batch_tokens
RECIPE_SEQUENCE = 16384  # engine.max_model_len there: the worst micro-batch is 2 x 16K
MICRO_BATCHES = 3  # gradients accumulate over at least three
H100_BF16_PEAK = (
    989e12  # dense bf16 by the datasheet (the H200's is the same); the measured one is reported too
)
CARD_SHARE = 0.70  # of the card's memory for the weights, their gradients and AdamW state, and the stream
QWEN3_14B_WIDTH = dict(
    hidden_size=5120,
    intermediate_size=17408,
    num_attention_heads=40,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
)
TOY_WIDTH = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
)


@dataclass(frozen=True)
class Sizes:
    """What each part runs at: the real sizes on CUDA, toy ones on CPU."""

    width: dict
    sequence: int  # tokens of the longest sequence
    micro_batch_tokens: int
    head_tokens: tuple[int, ...]  # the head comparison's token counts
    small_width: dict  # the colocated part's model
    small_layers: int

    @classmethod
    def for_device(cls, device: str) -> Sizes:
        if device == "cuda":
            small = QWEN3_14B_WIDTH | dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16)
            small |= dict(num_key_value_heads=8, vocab_size=32768)
            return cls(QWEN3_14B_WIDTH, RECIPE_SEQUENCE, RECIPE_MICRO_BATCH_TOKENS, (8192, 32768), small, 4)
        return cls(TOY_WIDTH, 64, 128, (64, 256), TOY_WIDTH, 2)


@dataclass
class Result:
    part: str
    verdict: str  # PASS | FAIL | SKIP
    numbers: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0


@dataclass(eq=False)  # hashed by identity: the parts share what they build through functools.cache
class Ctx:
    device: torch.device
    sizes: Sizes
    work: Path
    deadline: float
    layers: int | None = None  # the part-1 model's layers (None: as many as fit)
    env: dict = field(default_factory=dict)  # for subprocesses: tirl and the wheels importable

    part_deadline: float = float("inf")  # the running part's own end (PART_SHARE_S)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def budget(self, part: str, reserve: float) -> float:
        """Seconds a subprocess of `part` may take: what is left of the budget and of the part's share,
        less `reserve` for what follows it; at least 1 (it then stops at once: the part is SKIP)."""
        left = min(self.deadline, self.part_deadline) - time.monotonic()
        return max(1.0, left - reserve)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


# ---- the models ----


def _qwen3_config(width: dict, layers: int):
    from transformers import Qwen3Config

    return Qwen3Config(
        **width,
        num_hidden_layers=layers,
        tie_word_embeddings=False,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        pad_token_id=0,
    )


def _parameters(width: dict, layers: int) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_qwen3_config(width, layers))
    return sum(p.numel() for p in model.parameters())


def layers_that_fit(ctx: Ctx) -> int:
    """As many decoder layers as the card holds under the update: 16 bytes per parameter (fp32 weight,
    fp32 gradient, AdamW's two moments) plus each layer's checkpointed fp32 residual stream, leaving
    30% of the card for the recomputed layer, the head's chunks and the allocator (`tirl plan` puts
    those at ~19 GiB at 2 x 16K tokens: 5 layers, a 66.7 GiB peak, on an 80 GB card)."""
    if ctx.layers:
        return ctx.layers
    if not ctx.cuda:
        return 2
    one, two = _parameters(ctx.sizes.width, 1), _parameters(ctx.sizes.width, 2)
    per_layer, fixed = two - one, 2 * one - two
    stream = ctx.sizes.micro_batch_tokens * ctx.sizes.width["hidden_size"] * 4
    total = torch.cuda.get_device_properties(ctx.device).total_memory
    return max(1, int((CARD_SHARE * total - 16 * fixed) // (16 * per_layer + stream)))


def save_random_model(width: dict, layers: int, out: Path, device: torch.device) -> Path:
    """A Qwen3 of that width with random weights, written in bf16 (half the bytes to write and read:
    the trainer loads it in fp32 as it would any checkpoint). Initialized on the device: seconds, not
    the minutes a 14B-width init takes on the host."""
    from transformers import AutoModelForCausalLM

    if (out / "config.json").exists():
        return out
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(_qwen3_config(width, layers), dtype=torch.bfloat16)
    model.save_pretrained(out)
    del model
    _free(device)
    return out


@functools.cache
def _big_model(ctx: Ctx) -> tuple[Path, int]:
    layers = layers_that_fit(ctx)
    return save_random_model(ctx.sizes.width, layers, ctx.work / f"wide_{layers}", ctx.device), layers


def _free(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ---- the update, as the trainer runs it ----


def recipe_samples(vocab: int, sequence: int, micro_batch_tokens: int, seed: int = 0):
    """MICRO_BATCHES micro-batches of the recipe's worst shape (as many sequences of `sequence` tokens as
    the budget takes), every second sequence a little shorter so the padding mask is exercised; the
    prompt (first eighth) untrained, the response trained."""
    import numpy as np

    from tirl.rl.policy import TrainSample

    rng = np.random.default_rng(seed)
    per_batch = max(1, micro_batch_tokens // sequence)
    out = []
    for i in range(per_batch * MICRO_BATCHES):
        n = sequence - (sequence // 16 if i % 2 else 0)
        prompt = n // 8
        ids = rng.integers(10, vocab, n).tolist()
        out.append(TrainSample(ids, [0] * (prompt - 1) + [1] * (n - prompt), float(rng.normal())))
    return out


@dataclass(frozen=True)
class OneRankFSDP:
    """DistInfo of a world of one that still shards: FSDP2 over a one-rank group, which is what each
    rank of a multi-GPU run executes (its collectives are no-ops with one rank)."""

    rank: int
    world_size: int
    device: torch.device
    is_main: bool = True
    enabled: bool = True


@contextlib.contextmanager
def one_rank_group(device: torch.device) -> Iterator[OneRankFSDP]:
    import torch.distributed as dist

    from tirl.distributed.groups import init_distributed

    init_distributed(str(device))  # a world of one, with the trainer's CUDA allocator settings

    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield OneRankFSDP(0, 1, device)
    finally:
        dist.destroy_process_group()


def optim_config(ctx: Ctx, **kw):
    from tirl.rl.config import OptimConfig

    base = dict(
        lr=1e-6,
        warmup_steps=0,
        grad_clip=1.0,
        micro_batch_tokens=ctx.sizes.micro_batch_tokens,
        gradient_checkpointing=True,
        dtype="auto",
        device=str(ctx.device),
    )
    return OptimConfig(**(base | kw))


def timed_update(ctx: Ctx, model_dir: Path, fsdp: bool) -> dict:
    """Two updates through tirl.rl.update.grpo_update (the first allocates AdamW's state); the second is
    the steady state the plan predicts: its peak memory and its time are measured."""
    from tirl.distributed.groups import init_distributed
    from tirl.rl.config import AlgorithmConfig
    from tirl.rl.policy import Policy
    from tirl.rl.update import grpo_update

    group = one_rank_group(ctx.device) if fsdp else contextlib.nullcontext(init_distributed(str(ctx.device)))
    with group as info:
        policy = Policy(str(model_dir), optim_config(ctx), info, total_steps=4)
        vocab = policy.model.config.vocab_size
        samples = recipe_samples(vocab, ctx.sizes.sequence, ctx.sizes.micro_batch_tokens)
        grpo_update(policy, samples, AlgorithmConfig())
        _free(ctx.device)
        if ctx.cuda:
            torch.cuda.reset_peak_memory_stats(ctx.device)
        start = time.perf_counter()
        metrics = grpo_update(policy, samples, AlgorithmConfig())
        if ctx.cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        out = {
            "update_s": round(seconds, 3),
            "padded_tokens": sum(len(s.input_ids) for s in samples),
            "trained_tokens": metrics["train/trained_tokens"],
            "loss": metrics["train/loss"],
            "grad_norm": metrics["train/grad_norm"],
            "peak_allocated_gib": None,
            "peak_reserved_gib": None,
        }
        if ctx.cuda:
            out["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated(ctx.device) / GiB, 2)
            out["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved(ctx.device) / GiB, 2)
        del policy
        _free(ctx.device)
    return out


def guarded_update(ctx: Ctx, model_dir: Path, fsdp: bool) -> dict:
    """timed_update, or what ran out of memory and where (the other variant and parts still run)."""
    try:
        return timed_update(ctx, model_dir, fsdp)
    except torch.OutOfMemoryError as e:
        peak = torch.cuda.max_memory_allocated(ctx.device) / GiB if ctx.cuda else 0.0
        return {"error": f"OOM at {peak:.1f} GiB allocated: rerun with a smaller --layers ({str(e)[:120]})"}


@functools.cache
def _plain_update(ctx: Ctx) -> dict:
    model_dir, _ = _big_model(ctx)
    return guarded_update(ctx, model_dir, fsdp=False)


def _plan_child(config_dict: dict, gpu_memory: int, micro_batch: tuple[int, int], bf16: bool, queue) -> None:
    try:
        from transformers import Qwen3Config

        from tirl.rl.plan import ClusterShape, Workload
        from tirl.rl.planner import make_plan

        config, cluster = Qwen3Config(**config_dict), ClusterShape(1, gpu_memory, colocated=False)
        plan = make_plan(config, cluster, Workload(micro_batch, bf16), advise=False)  # no search for fixes
        queue.put({"peak": plan.training.peak, "total": plan.training_total, "verdict": plan.verdict()})
    except BaseException as e:
        queue.put({"error": f"{type(e).__name__}: {e}"[:400]})


def plan_prediction(ctx: Ctx, layers: int) -> dict:
    """`tirl plan --gpus 1` for the same model and settings, through its public function (make_plan), in
    a child process: the plan runs its fake process group, which must not meet this process's."""
    import multiprocessing as mp

    config = _qwen3_config(ctx.sizes.width, layers).to_dict()
    memory = torch.cuda.get_device_properties(ctx.device).total_memory if ctx.cuda else 80 * GiB
    micro = (max(1, ctx.sizes.micro_batch_tokens // ctx.sizes.sequence), ctx.sizes.sequence)
    # fork (no re-import: seconds on a loaded CPU) while this process has not touched CUDA, else spawn
    spawn = mp.get_context("spawn" if torch.cuda.is_initialized() else "fork")
    queue = spawn.Queue()
    child = spawn.Process(target=_plan_child, args=(config, memory, micro, ctx.cuda, queue))
    child.start()
    try:
        return queue.get(timeout=max(30.0, min(ctx.left(), 240.0)))
    except Exception:
        return {"error": "the plan did not answer in time"}
    finally:
        child.join(timeout=5)
        if child.is_alive():
            child.kill()


def part_memory(ctx: Ctx) -> Result:
    layers = layers_that_fit(ctx)
    started = time.monotonic()
    plan = plan_prediction(ctx, layers)  # first: on CPU its child is forked before any work here
    plan_s = round(time.monotonic() - started, 1)
    model_dir, layers = _big_model(ctx)
    plain = _plain_update(ctx)
    fsdp = guarded_update(ctx, model_dir, fsdp=True)
    n = {"layers": layers, "parameters": _parameters(ctx.sizes.width, layers)}
    n |= {f"plain_{k}": v for k, v in plain.items()} | {f"fsdp_{k}": v for k, v in fsdp.items()}
    notes = [f"{MICRO_BATCHES} micro-batches of {ctx.sizes.micro_batch_tokens} padded tokens, steady state"]
    if "error" in plain or "error" in fsdp:
        return Result("memory", "FAIL", n | {f"plan_{k}": v for k, v in plan.items()}, notes)
    ok = all(math.isfinite(r["loss"]) for r in (plain, fsdp))
    if "error" in plan:
        n["plan_error"] = plan["error"]
        notes.append("tirl plan could not predict this model: " + plan["error"])
        return Result("memory", "FAIL", n, notes)
    n["plan_s"] = plan_s
    n["plan_peak_bytes"] = plan["peak"]
    n["plan_peak_gib"] = round(plan["peak"] / GiB, 2)
    n["plan_training_total_gib"] = round(plan["total"] / GiB, 2)
    if not ctx.cuda:
        notes.append("CPU: no allocator to measure; the plan's prediction and the update's numbers only")
        return Result("memory", "PASS" if ok else "FAIL", n, notes)
    # Like with like: `tirl plan --gpus 1` plans the unsharded model (one GPU has nothing to shard), so
    # only the plain update is judged against it; FSDP2 over one rank (its all-gather buffers and bf16
    # copies) is reported beside it, as what sharding adds.
    gap = (n["plain_peak_allocated_gib"] - n["plan_peak_gib"]) / n["plan_peak_gib"]
    n["plain_plan_gap"] = round(gap, 3)
    n["fsdp_over_plain_gib"] = round(n["fsdp_peak_allocated_gib"] - n["plain_peak_allocated_gib"], 2)
    within = abs(gap) <= 0.10
    if not within:
        notes.append("the plan is more than 10% off the measured peak: fix the plan (issue 39)")
    return Result("memory", "PASS" if ok and within else "FAIL", n, notes)


# ---- colocated: offload, checkpoint, export, resume ----


COLOCATED_LR = {"full": 1e-5, "lora": 1e-3}


def _small_model(ctx: Ctx) -> Path:
    return save_random_model(ctx.sizes.small_width, ctx.sizes.small_layers, ctx.work / "small", ctx.device)


def _colocated_samples(vocab: int, seed: int):
    return recipe_samples(vocab, 48, 96, seed)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].float().cpu() - b[k].float().cpu()).abs().max()) for k in a)


def _weights(policy) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for k, v in policy.model.state_dict().items()}


def colocated_round(ctx: Ctx, lora: bool) -> dict:
    """One update, offload and back, a checkpoint (sharded state + export), one more update; then a
    fresh policy restored from the checkpoint takes the same second update: the weights must agree."""
    from tirl.distributed.groups import init_distributed
    from tirl.rl.checkpoint import checkpoint_model_dir, latest_checkpoint, load_trainer_state
    from tirl.rl.config import AlgorithmConfig, LoraConfig
    from tirl.rl.local_learner import LocalLearner
    from tirl.rl.policy import Policy

    model_dir = _small_model(ctx)
    optim = optim_config(ctx, micro_batch_tokens=96, lr=COLOCATED_LR["lora" if lora else "full"])
    if lora:
        optim = optim.model_copy(update={"lora": LoraConfig(enabled=True, rank=8, alpha=16)})
    info = init_distributed(str(ctx.device))
    run_dir = ctx.work / ("run_lora" if lora else "run_full")
    learner = LocalLearner(Policy(str(model_dir), optim, info, total_steps=4))
    vocab = learner.policy.model.config.vocab_size
    first, second = _colocated_samples(vocab, 1), _colocated_samples(vocab, 2)
    out: dict = {}
    learner.update(first, AlgorithmConfig())
    allocated = torch.cuda.memory_allocated(ctx.device) if ctx.cuda else 0
    started = time.perf_counter()
    out["offloaded"] = learner.offload("all")
    out["offload_s"] = round(time.perf_counter() - started, 4)
    if ctx.cuda:
        out["offload_freed_gib"] = round((allocated - torch.cuda.memory_allocated(ctx.device)) / GiB, 3)
    started = time.perf_counter()
    learner.onload()
    if ctx.cuda:
        torch.cuda.synchronize()
    out["onload_s"] = round(time.perf_counter() - started, 4)
    started = time.perf_counter()
    learner.policy.save(run_dir, 1, None, {"step": 1}, keep_last=2)
    out["checkpoint_s"] = round(time.perf_counter() - started, 3)  # shards + HF export (LoRA: the adapter)
    ckpt = latest_checkpoint(run_dir)
    exported = checkpoint_model_dir(ckpt)
    out["export_matches"] = _export_matches(exported, learner.policy, lora)
    before = _weights(learner.policy)
    learner.update(second, AlgorithmConfig())
    want = _weights(learner.policy)
    del learner
    _free(ctx.device)
    resumed = LocalLearner(Policy(str(model_dir), optim, info, total_steps=4))
    resumed.restore(load_trainer_state(ckpt))
    resumed.update(second, AlgorithmConfig())
    got = _weights(resumed.policy)
    out["resume_max_diff"] = _max_diff(got, want)
    out["resume_exact"] = out["resume_max_diff"] == 0.0
    out["resume_rel_step"] = resume_error(got, want, before)
    del resumed
    _free(ctx.device)
    return out


def resume_error(got: dict, want: dict, before: dict) -> float:
    """How far the resumed step landed from the uninterrupted one, as a share of that step's size (L2
    norms over all weights): 0.0 when bitwise equal; a nondeterministic GPU kernel moves it a little,
    a wrong resume (optimizer state, schedule, RNG) by the order of the step itself."""
    diff = math.sqrt(sum(float((got[k] - want[k]).double().pow(2).sum()) for k in want))
    step = math.sqrt(sum(float((want[k] - before[k]).double().pow(2).sum()) for k in want))
    return 0.0 if diff == 0.0 else diff / max(step, 1e-30)


def _export_matches(exported: Path, policy, lora: bool) -> float:
    """Max |exported - live| over the weights (LoRA: the merged model against the live one's merge)."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).state_dict()
    if lora:
        from tirl.rl.lora import merged_tensors

        live = {name: lazy.make().detach().float().cpu() for name, lazy in merged_tensors(policy.model)}
    else:
        live = _weights(policy)
    return _max_diff({k: loaded[k] for k in live if k in loaded}, live)


def part_colocated(ctx: Ctx) -> Result:
    n: dict = {}
    for kind in ("full", "lora"):
        n |= {f"{kind}_{k}": v for k, v in colocated_round(ctx, kind == "lora").items()}
    # GPU kernels with atomics need not repeat bit for bit: there the resumed step must land within 1%
    # of the step's own size (L2 over all weights); on CPU exactly. resume_exact says whether bitwise.
    tolerance = 0.01 if ctx.cuda else 0.0
    ok = all(n[f"{k}_resume_rel_step"] <= tolerance for k in ("full", "lora"))
    ok &= all(n[f"{k}_export_matches"] <= 1e-2 for k in ("full", "lora"))  # LoRA merge: bf16 base
    ok &= all(n[f"{k}_offloaded"] == ctx.cuda for k in ("full", "lora"))
    notes = [
        "one GPU has no collectives: NCCL, multi-rank sharded checkpoints and cross-GPU syncs are unproven"
    ]
    return Result("colocated", "PASS" if ok else "FAIL", n, notes)


# ---- speed ----


def _time(fn: Callable[[], object], device: torch.device, repeats: int = 3) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_peak(device: torch.device) -> float:
    """bf16 FLOP/s of a large product on random data (the ceiling MFU is also given against)."""
    n = 8192 if device.type == "cuda" else 256
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    return 2 * n**3 / _time(lambda: a @ b, device, 10)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    n = GiB if device.type == "cuda" else 2**24
    src = torch.randn(n // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * n / _time(lambda: dst.copy_(src), device, 10)


def update_flops(
    parameters: int, embedding: int, padded_tokens: int, sequence: int, width: dict, layers: int
) -> float:
    """Model FLOPs of grpo_update: the old log-probs' forward (2N per token) and the training forward
    and backward (6N), N without the input embedding; causal attention on top (recompute not counted)."""
    n = parameters - embedding
    attention_fwd = (
        2 * layers * width["num_attention_heads"] * width["head_dim"] * sequence
    )  # per token, causal
    return padded_tokens * (8 * n + 4 * attention_fwd)


def head_comparison(ctx: Ctx, tokens: int) -> dict:
    """The chunked head (tirl.rl.losses.chunked_logprobs) against the unchunked one, forward + backward."""
    from tirl.rl.losses import chunked_logprobs, entropy_from_logits, head_chunk_tokens

    w = ctx.sizes.width
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    g = torch.Generator(device=ctx.device).manual_seed(0)
    hidden = torch.randn(
        tokens, w["hidden_size"], device=ctx.device, dtype=dtype, generator=g
    ).requires_grad_()
    weight = (
        torch.randn(w["vocab_size"], w["hidden_size"], device=ctx.device, dtype=dtype, generator=g) * 0.02
    )
    weight.requires_grad_()
    targets = torch.randint(0, w["vocab_size"], (tokens,), device=ctx.device, generator=g)
    chunk = head_chunk_tokens(w["vocab_size"])

    def chunked() -> None:
        lp, ent = chunked_logprobs(hidden, weight, targets, chunk)
        (lp.sum() + ent.sum()).backward()

    def unchunked() -> None:
        logits = torch.nn.functional.linear(hidden, weight).float()
        lp = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
        (lp.sum() + entropy_from_logits(logits).sum()).backward()

    out = {}
    for name, fn in (("chunked", chunked), ("unchunked", unchunked)):
        hidden.grad = weight.grad = None
        _free(ctx.device)
        base = torch.cuda.memory_allocated(ctx.device) if ctx.cuda else 0
        if ctx.cuda:
            torch.cuda.reset_peak_memory_stats(ctx.device)
        try:
            out[f"{name}_s"] = round(_time(fn, ctx.device), 4)
            if ctx.cuda:
                out[f"{name}_peak_gib"] = round((torch.cuda.max_memory_allocated(ctx.device) - base) / GiB, 2)
        except torch.OutOfMemoryError:
            out[f"{name}_s"] = "OOM"
        hidden.grad = weight.grad = None
    return out


class FlatCopyEngine:
    """The engine side of the same-device handoff, in this process: an HF engine whose load opens the
    flat buffer's views and copies them into its weights, as vLLM's worker does after opening the CUDA
    IPC handle (tirl.engines.vllm.WeightSyncExtension.tirl_load_ipc; vLLM cannot travel to the GPU)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.dtype = next(engine.model.parameters()).dtype
        self.device = next(engine.model.parameters()).device

    def near(self, device: torch.device) -> bool:
        return device.type == "cuda" and device == self.device

    def load_flat(self, handoff) -> None:
        from tirl.engines.handoff import unpack_flat

        params = dict(self.engine.model.named_parameters())
        with torch.no_grad():
            for name, view in unpack_flat(handoff.buf, handoff.plan):
                params[name].copy_(view)


def handoff(ctx: Ctx) -> dict:
    """The same-device weight sync the trainer runs under torchrun (tirl.runtime.base.load_sources): the
    learner's tensors packed once into one flat buffer in the engine's dtype, in GPU memory allocated
    on plain segments (what CUDA IPC needs), then loaded by an HF engine on the same GPU."""
    from tirl.distributed.groups import init_distributed
    from tirl.engines.config import EngineConfig
    from tirl.engines.hf import HFEngine
    from tirl.rl.local_learner import LocalLearner
    from tirl.rl.policy import Policy
    from tirl.runtime.base import load_sources

    model_dir = _small_model(ctx)
    learner = LocalLearner(
        Policy(str(model_dir), optim_config(ctx), init_distributed(str(ctx.device)), total_steps=1)
    )
    dtype = "bfloat16" if ctx.cuda else "float32"
    engine = HFEngine(
        EngineConfig(model=str(model_dir), device=str(ctx.device), dtype=dtype, max_model_len=256)
    )
    try:
        engines = [FlatCopyEngine(engine)]
        sync = lambda: load_sources(engines, learner.sync_tensors(), learner.policy.device)  # noqa: E731
        seconds = _time(sync, ctx.device)
        stats = sync()
        nbytes = stats["sync/bytes"]
        return {
            "handoff_bytes": int(nbytes),
            "handoff_buffers": int(stats["sync/buffers"]),
            "handoff_host_bytes": int(stats["sync/host_bytes"]),  # 0: the buffer stayed on the GPU
            "handoff_s": round(seconds, 4),
            "handoff_gb_s": round(nbytes / seconds / 1e9, 2),
        }
    finally:
        asyncio.run(engine.close())


def update_speed(ctx: Ctx) -> dict:
    """Tokens/s and MFU of the part-1 update (timed there; run here if part 1 did not run)."""
    _, layers = _big_model(ctx)
    update = _plain_update(ctx)
    if "error" in update:
        return {"update_error": update["error"]}
    peak = matmul_peak(ctx.device)
    width = ctx.sizes.width
    parameters, embedding = _parameters(width, layers), width["vocab_size"] * width["hidden_size"]
    flops = update_flops(parameters, embedding, update["padded_tokens"], ctx.sizes.sequence, width, layers)
    rate = flops / update["update_s"]
    n = {
        "update_tokens_per_s": round(update["padded_tokens"] / update["update_s"], 1),
        "update_model_tflops": round(rate / 1e12, 2),
        "matmul_bf16_tflops": round(peak / 1e12, 1),
        "mfu_vs_measured_peak": round(rate / peak, 3),
    }
    if ctx.cuda:
        n["mfu_vs_datasheet_peak"] = round(rate / H100_BF16_PEAK, 3)
    return n


def part_speed(ctx: Ctx) -> Result:
    n = update_speed(ctx)
    for tokens in ctx.sizes.head_tokens:
        n |= {f"head_{tokens}_{k}": v for k, v in head_comparison(ctx, tokens).items()}
    n |= handoff(ctx)
    n["copy_gb_s"] = round(copy_bandwidth(ctx.device) / 1e9, 1)
    n["handoff_share_of_copy"] = round(n["handoff_gb_s"] / n["copy_gb_s"], 4)
    notes = []
    ok = "update_error" not in n and all(
        isinstance(n[f"head_{t}_chunked_s"], float) for t in ctx.sizes.head_tokens
    )
    if ctx.cuda and n.get("mfu_vs_datasheet_peak", 0.0) < 0.40:
        notes.append("MFU under the 40% goal")
    if not ctx.cuda:
        notes.append("CPU: times only; the MFU, head and handoff figures mean something on a GPU")
    return Result("speed", "PASS" if ok else "FAIL", n, notes)


# ---- end to end ----


def e2e_steps(ctx: Ctx) -> int:
    return 3 if ctx.cuda else 1  # one step on CPU: the test suite's budget


def _train_config(ctx: Ctx, model: Path, data: Path, dtype: str, sandbox: str) -> Path:
    from tirl.config import dump_config
    from tirl.rl.config import TrainConfig

    steps = e2e_steps(ctx)
    cfg = TrainConfig(
        model=str(model),
        output_dir=str(ctx.work / "e2e"),
        run_name=f"{dtype}_{sandbox}",
        engine={
            "backend": "hf",
            "device": str(ctx.device),
            "dtype": dtype,
            "max_model_len": 1280,
            "max_batch_size": 16,
        },
        agent={"max_turns": 2, "max_response_tokens": 48 if ctx.cuda else 24},
        sandbox={"mode": sandbox},
        reward={"workers": 1},
        algorithm={"prompts_per_step": 4 if ctx.cuda else 2, "group_size": 4 if ctx.cuda else 2},
        optim={"lr": 1e-4, "warmup_steps": 0, "device": str(ctx.device), "dtype": dtype},
        stages=[{"name": "e2e", "steps": steps, "data": str(data)}],
        checkpoint={"every": 1000},
        logging={"tensorboard": False},
    )
    path = ctx.work / f"e2e_{dtype}_{sandbox}.yaml"
    dump_config(cfg, path)
    return path


def train_run(ctx: Ctx, model: Path, data: Path, dtype: str, sandbox: str) -> dict:
    """`tirl train` in a subprocess; its steps' engine log-prob gap."""
    from tirl.rl.metrics import read_metrics

    config = _train_config(ctx, model, data, dtype, sandbox)
    cmd = [sys.executable, "-m", "tirl.cli", "train", "--config", str(config)]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=ctx.env, timeout=ctx.budget("e2e", 20), cwd=ROOT
    )
    rows = read_metrics(ctx.work / "e2e" / f"{dtype}_{sandbox}")
    gaps = [r.get("train/engine_logprob_gap") for r in rows]
    out = {
        "rc": proc.returncode,
        "steps": len(rows),
        "gap_max": max((g for g in gaps if g is not None), default=None),
    }
    if proc.returncode:
        out["stderr_tail"] = proc.stderr.strip().splitlines()[-3:]
    return out


def cuda_only_tests(root: Path = ROOT) -> list[str]:
    """Node ids of the suite's tests that skip without CUDA (`skipif(not torch.cuda.is_available())`)."""
    import ast

    found = []
    for path in sorted((root / "tests").rglob("test_*.py")):
        text = path.read_text()
        if "cuda.is_available()" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test"):
                marks = [ast.unparse(d) for d in node.decorator_list]
                if any("skipif" in m and "cuda.is_available()" in m for m in marks):
                    found.append(f"{path.relative_to(root)}::{node.name}")
    return found


def cuda_tests(ctx: Ctx) -> dict:
    """The suite's CUDA-only tests, run as pytest runs them."""
    tests = cuda_only_tests()
    if not tests:
        return {"cuda_tests": [], "cuda_tests_rc": 0, "cuda_tests_summary": "none found"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *tests]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=ctx.env, timeout=ctx.budget("e2e", 10), cwd=ROOT
    )
    tail = proc.stdout.strip().splitlines()[-1:] if proc.stdout.strip() else [proc.stderr.strip()[-300:]]
    return {"cuda_tests": tests, "cuda_tests_rc": proc.returncode, "cuda_tests_summary": tail[0]}


def part_e2e(ctx: Ctx) -> Result:
    from tirl.data import write_problems
    from tirl.demo.synthetic import generate
    from tirl.tiny_model import create_tiny_model

    model = create_tiny_model(ctx.work / "tiny")
    data = ctx.work / "problems.jsonl"
    write_problems(data, generate(32, seed=0))
    n: dict = {}
    notes: list[str] = []
    dtypes = ("bfloat16", "float32") if ctx.cuda else ("float32",)
    ok = True
    for dtype in dtypes:
        run = train_run(ctx, model, data, dtype, "local")
        if run["rc"]:  # where the machine's kernel refuses a sandbox feature: record it, run without it
            notes.append(f"{dtype} with the local sandbox failed: {run.get('stderr_tail')}")
            run = train_run(ctx, model, data, dtype, "inprocess") | {"sandbox": "inprocess"}
        n |= {f"{dtype}_{k}": v for k, v in run.items()}
        ok &= run["rc"] == 0 and run["steps"] == e2e_steps(ctx)
    if ctx.cuda:
        n |= cuda_tests(ctx)
        ok &= n["cuda_tests_rc"] == 0
    else:
        notes.append("SKIP the CUDA-only tests and bf16: they need CUDA")
    return Result("e2e", "PASS" if ok else "FAIL", n, notes)


# ---- running the parts ----

RUNNERS: dict[str, Callable[[Ctx], Result]] = {
    "memory": part_memory,
    "colocated": part_colocated,
    "speed": part_speed,
    "e2e": part_e2e,
}
CUDA_ONLY: dict[str, str] = {}  # part -> why it cannot run on CPU (every part has a toy-size CPU form today)
MIN_SECONDS = {"memory": 60.0, "colocated": 20.0, "speed": 30.0, "e2e": 30.0}


def run_part(name: str, ctx: Ctx) -> Result:
    """One part; an exception is its FAIL, with the traceback's head, and the next part runs."""
    start = time.monotonic()
    if not ctx.cuda and name in CUDA_ONLY:
        return Result(name, "SKIP", notes=[CUDA_ONLY[name]])
    if ctx.left() < MIN_SECONDS[name] * (1 if ctx.cuda else 0.1):
        return Result(name, "SKIP", notes=[f"budget: {ctx.left():.0f} s left"])
    ctx.part_deadline = start + PART_SHARE_S.get(name, float("inf"))
    try:
        result = RUNNERS[name](ctx)
    except subprocess.TimeoutExpired as e:  # the budget ran out inside the part: not a verdict on it
        result = Result(
            name,
            "SKIP",
            notes=[f"budget: stopped after {e.timeout:.0f} s: {' '.join(map(str, e.cmd))[:160]}"],
        )
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt):
            raise
        lines = traceback.format_exc().strip().splitlines()
        result = Result(name, "FAIL", {"error": f"{type(e).__name__}: {e}"[:500]}, lines[:3] + lines[-6:])
    _free(ctx.device)
    result.seconds = round(time.monotonic() - start, 1)
    return result


def markdown(results: list[Result], device: str) -> str:
    lines = [f"| part | verdict | seconds | numbers ({device}) |", "| --- | --- | --- | --- |"]
    for r in results:
        nums = ", ".join(f"{k}={v}" for k, v in r.numbers.items() if not isinstance(v, list | dict))
        lines.append(
            f"| {r.part} | {r.verdict} | {r.seconds} | {nums}{'; ' if r.notes else ''}{'; '.join(r.notes)} |"
        )
    return "\n".join(lines)


def device_line(device: torch.device) -> str:
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return f"{p.name}, {p.total_memory / GiB:.0f} GiB, torch {torch.__version__}"
    return f"cpu, torch {torch.__version__}"


def install_wheels(folder: Path, target: Path) -> None:
    """The wheels `make gpu-wheels` downloaded, installed without an index into `target` (the image's
    own packages stay as they are)."""
    wheels = sorted(str(p) for p in folder.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"--wheels {folder}: no wheels there (run `make gpu-wheels` first)")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    cmd += ["--no-cache-dir", "--upgrade", "--target", str(target), "--find-links", str(folder), *wheels]
    subprocess.run(cmd, check=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(PARTS), help="comma-separated parts: " + ", ".join(PARTS))
    p.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument(
        "--budget-s", type=float, default=450.0, help="wall-clock budget; later parts SKIP past it"
    )
    p.add_argument("--out", default=os.environ.get("OUT"), help="write gpu_check.jsonl and gpu_check.md here")
    p.add_argument("--wheels", default=None, help="install these wheels (no index) first: make gpu-wheels")
    p.add_argument(
        "--layers", type=int, default=None, help="the part-1 model's layers (default: as many as fit)"
    )
    p.add_argument(
        "--commit", default=os.environ.get("TIRL_COMMIT"), help="the commit to report (no .git on the GPU)"
    )
    args = p.parse_args(argv)
    parts = [x.strip() for x in args.only.split(",") if x.strip()]
    unknown = [x for x in parts if x not in PARTS]
    if unknown or not parts:
        p.error(f"--only: unknown part(s) {unknown}; choose from {', '.join(PARTS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device here (use --device cpu for the toy-size run)")
    args.parts = parts
    return args


def restart_with_wheels(argv: list[str], wheels: Path) -> None:
    """Install the wheels, then run this script again with them importable from the start (torch is
    imported already, and with it the image's typing_extensions, which pydantic wants newer)."""
    site = Path(tempfile.gettempdir()) / "tirl-gpu-check-site"
    install_wheels(wheels, site)
    rest = [a for i, a in enumerate(argv) if a != "--wheels" and (i == 0 or argv[i - 1] != "--wheels")]
    rest = [a for a in rest if not a.startswith("--wheels=")]
    path = os.pathsep.join(x for x in (str(ROOT / "src"), str(site), os.environ.get("PYTHONPATH")) if x)
    sys.stdout.flush()
    os.execve(
        sys.executable,
        [sys.executable, str(Path(__file__).resolve()), *rest],
        os.environ | {"PYTHONPATH": path},
    )


class Report:
    """What the check found so far, printed and (with --out) written the moment each part ends: a run
    killed mid-way (the device tool's time limit) still returns the parts it finished."""

    def __init__(self, out: str | None, header: dict) -> None:
        self.out, self.header, self.results = Path(out) if out else None, header, []
        print(json.dumps({"gpu_check": header}), flush=True)
        self._write()

    def add(self, result: Result) -> None:
        self.results.append(result)
        print(json.dumps(result.__dict__, default=str), flush=True)
        self._write()

    def table(self) -> str:
        return markdown(self.results, self.header["device"])

    def _write(self) -> None:
        if self.out is None:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        lines = [
            json.dumps({"gpu_check": self.header}),
            *(json.dumps(r.__dict__, default=str) for r in self.results),
        ]
        _replace(self.out / "gpu_check.jsonl", "\n".join(lines) + "\n")
        _replace(self.out / "gpu_check.md", self.table() + "\n")


def _replace(path: Path, text: str) -> None:
    """Written whole or not at all (a kill mid-write leaves the previous version)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.wheels:
        restart_with_wheels(argv, Path(args.wheels))
    start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="tirl-gpu-check-"))
    path = os.pathsep.join(x for x in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if x)
    os.environ["PYTHONPATH"] = path  # tirl importable in the children: tirl train, pytest, the plan's
    env = dict(os.environ)
    device = torch.device(args.device)
    ctx = Ctx(device, Sizes.for_device(args.device), work, start + args.budget_s, args.layers, env)
    header = {"device": device_line(device), "date": datetime.date.today().isoformat()}
    report = Report(args.out, header | {"commit": commit(args.commit)})
    try:
        for name in args.parts:
            report.add(run_part(name, ctx))
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the part-1 model alone is gigabytes on a GPU run
    print(report.table(), flush=True)
    return 0 if all(r.verdict != "FAIL" for r in report.results) else 1


def commit(given: str | None, root: Path = ROOT) -> str:
    """The commit the results belong to: --commit or TIRL_COMMIT (the tree copied to the GPU machine may
    have no .git), else git's answer where there is one, else "unknown"."""
    if given:
        return given
    try:
        proc = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=root, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else "unknown"


if __name__ == "__main__":
    from tirl.lifetime import children_die_with_me

    children_die_with_me()  # its engines, sandboxes and tirl train children die with it, even on kill -9
    sys.exit(main())
