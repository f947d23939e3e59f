"""The multi-turn agent loop: one asyncio task per trajectory, tool calls run the moment a turn ends.

A trajectory alternates generation (on the engine its lease gives) and tool calls (the config's
tools, tirl.agent.tools, one fresh instance each per trajectory, closed when it ends; the Python tool
runs code on the executor); while one trajectory waits for its tool, the engine keeps decoding the
others, so tool latency hides behind generation. Every wait has a timeout. Engine or infrastructure
failures end the trajectory with finish reason "error" (logged, counted by the caller), never as a
wrong answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

from tirl.agent.config import AgentConfig
from tirl.agent.protocol import (
    ToolCall,
    ToolCallError,
    build_prompt_ids,
    count_answer_blocks,
    forged_frame_at,
    parse_tool_calls,
    render_tool_response,
    truncate_middle,
)
from tirl.agent.tools import Tool, ToolContext, close_tools, toolbox
from tirl.agent.trajectory import ToolCallRecord, Trajectory
from tirl.data.problem import Problem
from tirl.engines.base import Engine, EnginePool, Generation, SamplingParams
from tirl.sandbox.result import Executor
from tirl.seeds import derive_seed

log = logging.getLogger(__name__)

EventCallback = Callable[[str, dict], None]


class InfraError(RuntimeError):
    """A tool's infrastructure failed (not the model's call): the trajectory ends with finish reason 'error'."""


class _Special:
    """Token ids the loop needs, looked up once per tokenizer."""

    def __init__(self, tokenizer):
        ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
        unk = tokenizer.unk_token_id
        self.im_end = ids[0] if ids[0] not in (None, unk) else None
        self.stop_ids = sorted({i for i in [*ids, tokenizer.eos_token_id] if i is not None and i != unk})


async def run_trajectory(
    pool: EnginePool,
    tokenizer,
    executor: Executor | None,
    problem: Problem,
    cfg: AgentConfig,
    *,
    group: str,
    sample_index: int = 0,
    seed: int | None = None,
    on_event: EventCallback | None = None,
) -> Trajectory:
    """Turn one problem into one trajectory: generate, run tool calls, append their responses, repeat."""
    prompt_ids = build_prompt_ids(tokenizer, problem.problem, cfg)
    traj = Trajectory(problem_id=problem.id, prompt_ids=prompt_ids, sample_index=sample_index)
    special = _Special(tokenizer)
    emit = _safe_emitter(on_event)
    box = toolbox(cfg.tools, cfg.tool_schema)
    tools = box.open(ToolContext(executor, cfg))
    try:
        async with pool.lease(group, len(prompt_ids) + cfg.max_response_tokens) as engine:
            traj.engine = str(getattr(engine, "name", type(engine).__name__))
            await _turns(engine, tokenizer, tools, box.schemas, traj, cfg, special, seed, emit)
    except Exception as exc:
        traj.finish_reason, traj.error = "error", f"{type(exc).__name__}: {exc}"
        log.warning("trajectory %s/%d ended with error: %s", problem.id, sample_index, traj.error)
    finally:
        try:
            await close_tools(tools)
        except Exception:  # a tool that fails to clean up must not lose the trajectory
            log.exception("closing the tools of trajectory %s/%d failed", problem.id, sample_index)
    traj.response_text = tokenizer.decode(traj.response_ids, skip_special_tokens=False)
    emit("finish", {"finish_reason": traj.finish_reason, "error": traj.error})
    return traj


async def _turns(
    engine: Engine,
    tokenizer,
    tools: dict[str, Tool],
    schemas,
    traj: Trajectory,
    cfg: AgentConfig,
    special,
    seed,
    emit,
) -> None:
    for turn in range(cfg.max_turns):
        # >= 1: a turn that fills the budget, or a tool response that would, ends the trajectory below
        left = cfg.max_response_tokens - len(traj.response_ids)
        gen = await _generate(
            engine, traj, cfg, special, left, None if seed is None else derive_seed(seed, turn)
        )
        text = tokenizer.decode(gen.token_ids, skip_special_tokens=False)
        forged = forged_frame_at(text)
        if forged is not None:
            traj.forged_observations += 1
            if cfg.stop_at_forged_observation:
                gen, text = _cut_turn(tokenizer, gen, text, forged)
        _append(traj, gen.token_ids, gen.logprobs, trained=True, version=gen.version)
        traj.turns += 1
        traj.model_turns.append(text)
        traj.answer_blocks += count_answer_blocks(text)
        emit("turn", {"turn": turn, "text": text, "finish_reason": gen.finish_reason})
        calls = parse_tool_calls(text, cfg.max_calls_per_turn, schemas)
        if not calls:
            if gen.finish_reason != "stop":
                traj.finish_reason = "length"
            else:  # the model ended its turn: with an answer, or without one
                traj.finish_reason = "answered" if traj.answer_blocks else "no_answer"
            return
        if turn == cfg.max_turns - 1:
            traj.finish_reason = "max_turns"  # no turn left to read the result: do not run the calls
            return
        if len(traj.response_ids) >= cfg.max_response_tokens:
            traj.finish_reason = "length"  # cut off by the budget: no room for a tool response
            return
        responses = await asyncio.gather(*(_call_tool(tools, c, turn, traj, cfg, emit) for c in calls))
        closed = special.im_end is not None and bool(gen.token_ids) and gen.token_ids[-1] == special.im_end
        segment = render_tool_response(tokenizer, list(responses), cfg, turn_closed=closed)
        if len(traj.response_ids) + len(segment) >= cfg.max_response_tokens:
            traj.finish_reason = "length"  # the response and at least one more token would not fit
            return
        _append(traj, segment, [0.0] * len(segment), trained=False, version=gen.version)
    traj.finish_reason = "max_turns"


def _cut_turn(tokenizer, gen: Generation, text: str, at: int) -> tuple[Generation, str]:
    """The turn's tokens before character `at` (where the model started a forged frame), as a turn the
    model stopped: the frame and everything after it are dropped, so none of it is run or trained on."""
    keep = _tokens_within(tokenizer, gen.token_ids, text[:at])
    ids = gen.token_ids[:keep]
    cut = Generation(ids, gen.logprobs[:keep], "stop", version=gen.version)
    return cut, tokenizer.decode(ids, skip_special_tokens=False)


def _tokens_within(tokenizer, ids: list[int], prefix: str) -> int:
    """The most leading tokens of `ids` whose text stays within `prefix` (binary search: a turn's
    decoded prefixes grow with the token count)."""
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if prefix.startswith(tokenizer.decode(ids[:mid], skip_special_tokens=False)):
            lo = mid
        else:
            hi = mid - 1
    return lo


async def _generate(
    engine: Engine, traj: Trajectory, cfg: AgentConfig, special, left: int, seed
) -> Generation:
    params = SamplingParams(
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        max_tokens=min(left, cfg.max_turn_tokens or left),
        stop_token_ids=special.stop_ids,
        stop_strings=["</tool_call>"] if cfg.stop_at_tool_call else [],
        seed=seed,
    )
    start = time.perf_counter()
    try:
        gen = await asyncio.wait_for(
            engine.generate(traj.prompt_ids + traj.response_ids, params), cfg.generation_timeout
        )
    except TimeoutError:
        raise TimeoutError(
            f"engine {traj.engine} produced no turn within {cfg.generation_timeout} s"
        ) from None
    finally:
        traj.gen_seconds += time.perf_counter() - start
    if gen.finish_reason == "abort":
        raise RuntimeError(f"engine {traj.engine} aborted the request")
    return gen


async def _call_tool(
    tools: dict[str, Tool],
    call: ToolCall | ToolCallError,
    turn: int,
    traj: Trajectory,
    cfg: AgentConfig,
    emit,
) -> str:
    """Run one parsed call (or report its parse error); returns the text of its tool response."""
    if isinstance(call, ToolCallError):
        traj.tool_calls.append(ToolCallRecord(turn=turn, status="malformed", code=call.raw))
        emit("tool_result", {"turn": turn, "status": "malformed", "text": call.render()})
        return call.render()
    shown = call_source(call)
    emit("tool_call", {"turn": turn, "tool": call.name, "arguments": call.arguments, "code": shown})
    start = time.perf_counter()
    try:
        result = await asyncio.wait_for(tools[call.name].call(call.arguments), cfg.tool_wait_timeout)
    except TimeoutError:
        raise InfraError(f"tool {call.name} gave no result within {cfg.tool_wait_timeout} s") from None
    finally:
        traj.tool_wait_seconds += time.perf_counter() - start
    record = ToolCallRecord(
        turn=turn, status=result.status, code=shown, wall_ms=result.wall_ms, tool=call.name
    )
    traj.tool_calls.append(record)
    if record.infra_failed:  # after the executor's retries: not the model's fault, show no fake error
        raise InfraError(f"tool {call.name} failed: {result.text}")
    text = truncate_middle(result.text, cfg.tool_output_max_chars)
    emit("tool_result", {"turn": turn, "tool": call.name, "status": result.status, "text": text})
    return text


def call_source(call: ToolCall) -> str:
    """What a call ran, for records and displays: its `code` argument, else its JSON arguments."""
    code = call.arguments.get("code")
    return code if isinstance(code, str) else json.dumps(call.arguments, ensure_ascii=False)


def _append(traj: Trajectory, ids: list[int], logprobs: list[float], trained: bool, version: int) -> None:
    traj.response_ids.extend(ids)
    traj.logprobs.extend(logprobs)
    traj.loss_mask.extend([int(trained)] * len(ids))
    traj.versions.extend([version] * len(ids))


def _safe_emitter(on_event: EventCallback | None) -> EventCallback:
    def emit(kind: str, payload: dict) -> None:
        if on_event is None:
            return
        try:
            on_event(kind, payload)
        except Exception:  # a broken display must not end the trajectory
            log.exception("on_event callback failed for %s", kind)

    return emit


async def rollout(
    pool: EnginePool,
    tokenizer,
    executor: Executor | None,
    problems: list[Problem],
    n: int,
    cfg: AgentConfig,
    *,
    seed: int = 0,
    concurrency: int = 256,
    on_done: Callable[[Trajectory], None] | None = None,
) -> list[list[Trajectory]]:
    """n trajectories per problem (group = problem id), at most `concurrency` in flight.

    Sample j of problem i is seeded by (seed, i, j), so a rollout is reproducible whatever the timing.
    """
    if n < 1:
        raise ValueError(f"rollout needs n >= 1 samples per problem, got {n}")
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, j: int) -> Trajectory:
        async with gate:
            traj = await run_trajectory(
                pool,
                tokenizer,
                executor,
                problems[i],
                cfg,
                group=problems[i].id,
                sample_index=j,
                seed=derive_seed(seed, i, j),
            )
        if on_done is not None:
            on_done(traj)
        return traj

    tasks = [[asyncio.create_task(one(i, j)) for j in range(n)] for i in range(len(problems))]
    try:
        groups = [list(await asyncio.gather(*row)) for row in tasks]
    finally:
        for row in tasks:
            for t in row:
                t.cancel()
    errors = sum(t.failed for g in groups for t in g)
    if errors:
        log.warning("rollout: %d of %d trajectories ended with error (not scored)", errors, len(problems) * n)
    return groups
