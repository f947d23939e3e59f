"""Stage 0 SFT (`tirl sft`): teach the tool-call and answer formats, loss on assistant tokens only.

Each JSONL line is one example, in one of three forms:
  {"messages": [...], "tools": [...]?}   OpenAI-style chat: assistant messages (with optional
      "tool_calls") are trained on; system, user and "tool" results are context. Rendered with the
      tokenizer's chat template, which puts tool results in <tool_response> blocks.
  {"text": "..."}                        raw text: everything is trained on except
      <tool_response> ... </tool_response> spans (the environment's words, never the model's).
  {"prompt": "...", "completion": "..."} the completion is trained on, minus tool responses.

Tool output is tokenized as the agent loop tokenizes it (tirl.agent.framing): a control-token string
it holds (`<|im_end|>`, `</tool_response>`, printed by a program) stays plain text, so SFT trains on
the token layout RL samples. In chat examples the tool messages' content is the tool output, whatever
it prints; in text examples only their tags mark it, so a printed `</tool_response>` ends it there.
"""

from __future__ import annotations

import math
import re
import secrets
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tirl.agent.framing import Piece, encode_framed_offsets
from tirl.config import ConfigError, redacted_dump
from tirl.data.loaders import DataError, read_jsonl
from tirl.distributed.groups import all_reduce, init_distributed, shutdown_distributed
from tirl.rl.checkpoint import load_trainer_state, prepare_run_dir, resolve_model_path
from tirl.rl.config import SFTConfig
from tirl.rl.lora import check_lora
from tirl.rl.losses import BatchCounts, token_mean
from tirl.rl.metrics import MetricsLogger
from tirl.rl.policy import Policy, TrainSample

TOOL_RESPONSE = re.compile(r"<tool_response>(.*?)</tool_response>", re.DOTALL)

Span = tuple[int, int]  # [start, end) in characters


def read_examples(paths: list[str]) -> list[dict]:
    """All examples of the JSONL files; a bad line is reported with its file and line number."""
    examples = []
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"SFT data file not found: {path}")
        try:
            rows = read_jsonl(p)
        except DataError as e:
            raise ConfigError(str(e)) from e
        for n, ex in enumerate(rows, 1):
            if not ({"messages", "text"} & ex.keys() or {"prompt", "completion"} <= ex.keys()):
                raise ConfigError(
                    f"{path}: example {n}: needs 'messages', 'text', or 'prompt' + 'completion'"
                )
            examples.append(ex)
    if not examples:
        raise ConfigError(f"no SFT examples in {paths}")
    return examples


def _minus_tool_responses(text: str, start: int, end: int) -> list[Span]:
    spans, cursor = [], start
    for m in TOOL_RESPONSE.finditer(text, start, end):
        spans.append((cursor, m.start()))
        cursor = m.end()
    spans.append((cursor, end))
    return [s for s in spans if s[1] > s[0]]


def render_pieces(tokenizer, example: dict) -> tuple[list[Piece], list[Span]]:
    """The example's text as (text, trusted) pieces, tool output untrusted, and the character spans of
    their joined text to train on."""
    if "messages" in example:
        return _chat_pieces(tokenizer, example["messages"], example.get("tools"))
    if "text" in example:
        text = example["text"]
        return _tagged_pieces(text), _minus_tool_responses(text, 0, len(text))
    prompt, completion = example["prompt"], example["completion"]
    text = prompt + completion
    return _tagged_pieces(text), _minus_tool_responses(text, len(prompt), len(text))


def _tagged_pieces(text: str) -> list[Piece]:
    """Text whose tool output is marked by its tags only: what lies inside each <tool_response> block."""
    pieces: list[Piece] = []
    at = 0
    for m in TOOL_RESPONSE.finditer(text):
        pieces += [(text[at : m.start(1)], True), (m.group(1), False)]
        at = m.end(1)
    return [*pieces, (text[at:], True)]


def _chat_pieces(tokenizer, messages: list[dict], tools) -> tuple[list[Piece], list[Span]]:
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("the model's tokenizer has no chat template: use 'text' examples for SFT")

    def render(msgs, gen):
        return tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=gen)

    messages = [_text_content(m) for m in messages]
    # Each tool message's content goes through the template as an unguessable mark, so tirl knows
    # where the template put it; the mark is then replaced by the content, as untrusted text.
    nonce = secrets.token_hex(8)
    marks = {f"tirl{nonce}m{i}x": m["content"] for i, m in enumerate(messages) if _is_tool_text(m)}
    marked = [
        {**m, "content": f"tirl{nonce}m{i}x"} if _is_tool_text(m) else m for i, m in enumerate(messages)
    ]
    full = render(marked, False)
    spans = []
    for i, msg in enumerate(marked):
        if msg.get("role") != "assistant":
            continue
        # The assistant's tokens are what the template adds between "prompt for turn i" and "turn i done".
        before, through = render(marked[:i], True), render(marked[: i + 1], False)
        if not (full.startswith(before) and full.startswith(through) and len(through) > len(before)):
            raise ConfigError(
                "the chat template does not render conversations prefix-consistently, so assistant tokens "
                "cannot be located: use 'text' examples or a template without history rewriting"
            )
        spans.append((len(before), len(through)))
    if not spans:
        raise ConfigError("a chat example has no assistant message to train on")
    pieces, unmarked = _unmark(full, marks)
    if "".join(t for t, _ in pieces) != render(messages, False):
        raise ConfigError(
            "the chat template does not write the content of tool messages as it is, so tool output "
            "cannot be kept apart from the chat format's control tokens: use a template that writes "
            "tool content verbatim, or 'text' examples"
        )
    return pieces, [(unmarked(a), unmarked(b)) for a, b in spans]


def _text_content(message: dict) -> dict:
    """A tool message's content parts become their text, joined (as the OpenAI endpoint reads them)."""
    content = message.get("content")
    if message.get("role") == "tool" and isinstance(content, list):
        return {**message, "content": "".join(p.get("text", "") for p in content if isinstance(p, dict))}
    return message


def _is_tool_text(message: dict) -> bool:
    return (
        message.get("role") == "tool" and isinstance(message.get("content"), str) and bool(message["content"])
    )


def _unmark(text: str, marks: dict[str, str]) -> tuple[list[Piece], Callable[[int], int]]:
    """`text` with each mark replaced by its tool output (untrusted), and the map of a position in
    `text` outside the marks to the same place in the result."""
    if not marks:
        return [(text, True)], lambda pos: pos
    pieces: list[Piece] = []
    shifts: list[tuple[int, int]] = []  # (end of a mark in `text`, how far later text moves)
    at = moved = 0
    for hit in re.finditer("|".join(marks), text):
        pieces += [(text[at : hit.start()], True), (marks[hit.group()], False)]
        moved += len(marks[hit.group()]) - len(hit.group())
        shifts.append((hit.end(), moved))
        at = hit.end()
    pieces.append((text[at:], True))
    return pieces, lambda pos: pos + next((d for end, d in reversed(shifts) if end <= pos), 0)


def tokenize_example(tokenizer, example: dict, max_length: int) -> tuple[TrainSample, bool]:
    """(sample with the assistant-token mask, whether it was truncated to max_length)."""
    pieces, spans = render_pieces(tokenizer, example)
    try:
        ids, offsets = encode_framed_offsets(tokenizer, pieces)
    except ValueError as e:  # a tokenizer that assembles a control token from tool text
        raise ConfigError(f"an SFT example's {e}") from None
    trained = [any(a <= start < b for a, b in spans) for start, _ in offsets]
    truncated = len(ids) > max_length
    ids, trained = ids[:max_length], trained[:max_length]
    return TrainSample(ids, [int(t) for t in trained[1:]]), truncated


def run_sft(cfg: SFTConfig, resume: bool = False, progress: bool = True) -> Path:
    """Supervised fine-tuning; returns the run directory (checkpoints/step_N/model is an HF model)."""
    from rich.console import Console

    from tirl.engines.tokenizer import load_tokenizer

    info = init_distributed(cfg.optim.device)
    clean = False
    try:
        console = Console(stderr=True, quiet=not (progress and info.is_main))
        ckpt = prepare_run_dir(cfg.run_dir, cfg, resume, info.is_main, console.print)
        model_path = resolve_model_path(cfg.model)
        check_lora(model_path, cfg.optim.lora)  # a bad adapter config fails before any work
        tokenizer = load_tokenizer(model_path)
        encoded = [tokenize_example(tokenizer, ex, cfg.max_length) for ex in read_examples(cfg.data)]
        samples = [s for s, _ in encoded if s.num_trained > 0]
        if not samples:
            raise ConfigError("no SFT example has an assistant token to train on")
        per_epoch = math.ceil(len(samples) / cfg.batch_size)
        total = cfg.epochs * per_epoch
        # With LoRA the base stays the given model (a resumed run's adapter comes from its shards).
        start_from = str(ckpt / "model") if ckpt and not cfg.optim.lora.enabled else model_path
        policy = Policy(start_from, cfg.optim, info, total)
        start = 0
        if ckpt:
            saved = load_trainer_state(ckpt)
            policy.restore(saved)
            start = saved["step"]
        console.print(
            f"SFT: {len(samples)} examples ({sum(t for _, t in encoded)} truncated to {cfg.max_length} tokens), "
            f"{cfg.epochs} epochs x {per_epoch} steps"
        )
        logger = MetricsLogger(cfg.run_dir, cfg.logging, redacted_dump(cfg)) if info.is_main else None
        if logger and ckpt:
            logger.truncate_after(start)
        for step in range(start, total):
            t0 = time.perf_counter()
            epoch, k = divmod(step, per_epoch)
            order = np.random.default_rng([cfg.seed, epoch]).permutation(len(samples))
            batch = [samples[i] for i in order[k * cfg.batch_size : (k + 1) * cfg.batch_size]]
            mine = batch[info.rank :: info.world_size]
            (tokens,) = all_reduce([sum(s.num_trained for s in mine)], info)
            counts = BatchCounts(max(tokens, 1.0), len(batch))
            loss = policy.accumulate(mine, lambda mb, c=counts: token_mean(-mb.logprobs, mb.mask, c))
            (loss,) = all_reduce([loss], info)
            lr = policy.lr
            grad_norm = policy.step()
            policy.advance_schedule()
            if (step + 1) % cfg.checkpoint.every == 0 or step + 1 == total:
                state = {"step": step + 1, "epoch": epoch}
                policy.save(cfg.run_dir, step + 1, tokenizer, state, cfg.checkpoint.keep_last)
            seconds = time.perf_counter() - t0
            metrics = {"train/loss": loss, "train/lr": lr, "train/grad_norm": grad_norm, "train/epoch": epoch}
            metrics |= {"train/trained_tokens": int(tokens), "perf/train_tokens_per_s": tokens / seconds}
            if logger:
                logger.log(step + 1, metrics)
            console.print(f"sft step {step + 1}/{total} loss {loss:.4f} lr {lr:.2e} gnorm {grad_norm:.2f}")
        if logger:
            logger.close()
        clean = True
        return cfg.run_dir
    finally:
        shutdown_distributed(synchronize=clean)
