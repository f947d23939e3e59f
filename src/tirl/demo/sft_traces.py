"""Programmatic tool-using SFT traces for the synthetic tasks, with realistic imperfections.

A trace is exactly what the agent loop would produce for the problem, as text: the loop's prompt
(tirl.agent.protocol), then assistant turns and tool-response segments rendered by the same protocol
functions, with the REAL output of each call (run in the sandbox; a malformed call gets the loop's own
parse error). Written as `{"prompt", "completion"}` lines for `tirl sft`, which trains on the
completion minus the <tool_response> blocks; so SFT sees the very token layout RL samples.

The mix makes the SFT policy capable but unreliable, and puts it in the paper's noisy-success regime
(outcome-only reward credits messy trajectories), so RL, and RoC in particular, has something to fix:
  - tool:     plan, one correct call, read the output, answer;
  - code_fix: the first call fails, the error comes back, the next turn runs the right code and
              answers correctly. Failures of five kinds (FAILURES): a syntax error, a runtime error
              (typo, undefined name), reading stdin that was never passed, a malformed call (broken
              JSON), and a brute force that times out (sum_big, fixed by the closed form);
  - give_up:  the first call fails and the trace guesses instead (right by luck on last_digit);
  - no_tool:  a guess without running code (right by luck on last_digit, wrong elsewhere);
  - a few answers repeat the <answer> block (RoC's p_format penalizes it).
Correct trajectories with failed calls earn the same reward as clean ones; RoC's p_err is what
prefers the clean ones (the paper's Figure 4).

A model trained from scratch also lacks what pretraining gives for free: copying a digit string it has
just read (from the problem into code, from the tool's output into the answer). `copy_drills` are
short instruction-following examples that teach copying itself ("Repeat: 812 40" -> "812 40"); they
never mention the tasks. `shaped_drills` then drill the same skill in the traces' own shapes: a trace's
first turn (the problem's numbers into the call's code) and its last (the tool's output into \\boxed{}),
because on some seeds the plain copy skill did not carry over to those contexts (docs/results.md).
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tirl.agent.config import AgentConfig
from tirl.agent.protocol import (
    TOOL_SCHEMA,
    ToolCallError,
    build_prompt_text,
    parse_tool_calls,
    tool_response_text,
    truncate_middle,
)
from tirl.data.problem import Problem
from tirl.demo.synthetic import guess_range

END = "<|im_end|>"
TOOL_PLANS = ("I will compute this with Python.", "Let me run Python to get the exact value.")
FIX_PLANS = ("The code failed. Let me fix it.", "There is an error in my code; fixing it.")
GUESS_PLANS = ("This looks easy to estimate: about {g}.", "A rough mental estimate gives {g}.")
GIVE_UP_PLANS = ("The tool failed. I will estimate instead: about {g}.", "No result; my best guess is {g}.")
INFRA_RETRIES = 5  # per snippet, for infrastructure failures (starved, queue timeout)
FAILURES = ("syntax", "runtime", "stdin", "malformed", "timeout")  # kinds of failed first calls
DONE = "The code printed the result.</reason>\n<answer>\\boxed{{{n}}}</answer>"


class TraceMix(BaseModel):
    """Shares of the trace kinds (the rest are clean one-call traces)."""

    model_config = ConfigDict(extra="forbid")

    no_tool: float = Field(0.2, ge=0, le=1)
    code_fix: float = Field(0.3, ge=0, le=1)
    give_up: float = Field(0.05, ge=0, le=1)
    redundant_answer: float = Field(0.05, ge=0, le=1)  # of the traces that answer after a tool call

    @model_validator(mode="after")
    def _fits(self) -> TraceMix:
        total = self.no_tool + self.code_fix + self.give_up
        if total > 1:
            raise ValueError(f"no_tool + code_fix + give_up = {total} > 1")
        return self


@dataclass
class _Plan:
    """What one trace will do, decided before any code runs."""

    problem: Problem
    kind: str  # tool | code_fix | give_up | no_tool
    redundant: bool
    failure: str = ""  # one of FAILURES for code_fix and give_up
    failed_call: str = ""  # the text of the failed <tool_call> block
    failed_code: str = ""  # what that call runs ("" when it is malformed and runs nothing)
    seed: int = 0  # picks the phrasings


def tool_call_text(code: str, cfg: AgentConfig) -> str:
    """A call of the config's tool (only the required `code` argument), as the template writes it."""
    schema = cfg.tool_schema or TOOL_SCHEMA
    name = schema.get("function", schema)["name"]
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": {"code": code}}) + "\n</tool_call>"


def failed_attempt(problem: Problem, kind: str, cfg: AgentConfig, rng: random.Random) -> tuple[str, str]:
    """A realistic first call that fails in the way `kind` names: (call text, code it runs or "")."""
    code = _code_of(problem)
    lines = code.split("\n")
    if kind == "timeout":
        code = problem.meta["brute_force"]
    elif kind == "syntax":
        code = code[:-1]  # the closing parenthesis of print( is missing
    elif kind == "runtime":
        typo = "\n".join([*lines[:-1], lines[-1].replace("print(", "prnt(", 1)])
        code = rng.choice([typo, f"{code.replace('print(', 'result = (', 1)}\nprint(answer)"])
    elif kind == "stdin":
        code = "x = int(input())\n" + code  # reads stdin, but the call passes none: EOFError
    elif kind == "malformed":
        return tool_call_text(code, cfg)[: -len("}\n</tool_call>")] + "\n</tool_call>", ""
    else:
        raise ValueError(f"unknown failure kind {kind!r}; choose from {', '.join(FAILURES)}")
    return tool_call_text(code, cfg), code


def failure_kinds(problem: Problem) -> tuple[str, ...]:
    """The failures a first attempt at `problem` can have; a brute force only where it would time out."""
    if "brute_force" in problem.meta:
        return ("timeout",) * 4 + FAILURES[:-1]  # the obvious attempt is usually the slow one
    return FAILURES[:-1]


def guess(problem: Problem, rng: random.Random) -> str:
    """A guess from the problem's plausible answers: right by luck only where they are few."""
    return str(rng.choice(guess_range(problem)))


def plan_traces(problems: list[Problem], mix: TraceMix, cfg: AgentConfig, seed: int = 0) -> list[_Plan]:
    rng = random.Random(seed)
    bounds = (("no_tool", mix.no_tool), ("code_fix", mix.code_fix), ("give_up", mix.give_up))
    plans = []
    for p in problems:
        r, kind, edge = rng.random(), "tool", 0.0
        for name, share in bounds:
            edge += share
            if r < edge:
                kind = name
                break
        plan = _Plan(
            problem=p,
            kind=kind,
            redundant=kind in ("tool", "code_fix") and rng.random() < mix.redundant_answer,
        )
        if kind in ("code_fix", "give_up"):
            plan.failure = rng.choice(failure_kinds(p))
            plan.failed_call, plan.failed_code = failed_attempt(p, plan.failure, cfg, rng)
        plan.seed = rng.randrange(1 << 30)
        plans.append(plan)
    return plans


def _code_of(problem: Problem) -> str:
    code = problem.meta.get("code")
    if not code:
        raise ValueError(
            f"problem {problem.id} has no reference code (meta['code']): use tirl.demo.synthetic"
        )
    return code


def render_trace(plan: _Plan, outputs: dict[str, str], cfg: AgentConfig) -> dict:
    """One {"prompt", "completion"} example; `outputs` maps code -> the tool-response text it produced."""
    p, rng = plan.problem, random.Random(plan.seed)
    prompt = build_prompt_text(None, p.problem, cfg)
    example = {"prompt": prompt, "kind": plan.kind, "failure": plan.failure, "id": p.id}
    if plan.kind == "no_tool":
        g = guess(p, rng)
        text = rng.choice(GUESS_PLANS).format(g=g) + f"</reason>\n<answer>\\boxed{{{g}}}</answer>{END}"
        return example | {"completion": text}
    code = _code_of(p)
    parts = [rng.choice(TOOL_PLANS) + "\n"]
    if plan.failure:
        parts += [plan.failed_call, tool_response_text([_failed_response(plan, outputs, cfg)], cfg, False)]
    if plan.kind == "give_up":
        g = guess(p, rng)
        parts.append(
            rng.choice(GIVE_UP_PLANS).format(g=g) + f"</reason>\n<answer>\\boxed{{{g}}}</answer>{END}"
        )
        return example | {"completion": "".join(parts)}
    if plan.failure:
        parts.append(rng.choice(FIX_PLANS) + "\n")
    parts += [tool_call_text(code, cfg), tool_response_text([outputs[code]], cfg, False)]
    result = _printed_value(outputs[code])
    final = DONE.format(n=result)
    if plan.redundant:
        final += f"\n<answer>\\boxed{{{result}}}</answer>"
    parts.append(final + END)
    return example | {"completion": "".join(parts)}


def _failed_response(plan: _Plan, outputs: dict[str, str], cfg: AgentConfig) -> str:
    """What the loop sends back for the failed call: the sandbox's output, or the parse error."""
    if plan.failed_code:
        return outputs[plan.failed_code]
    (error,) = parse_tool_calls(plan.failed_call, tools=cfg.tool_schema)
    assert isinstance(error, ToolCallError), f"the malformed call parsed: {plan.failed_call!r}"
    return error.render()


def _printed_value(response: str) -> str:
    """The program's output without the sandbox's status line."""
    return response.rsplit("\n[", 1)[0].strip() if "\n[" in response else response.strip()


async def make_traces(
    problems: list[Problem], executor, cfg: AgentConfig, mix: TraceMix | None = None, seed: int = 0
) -> list[dict]:
    """Traces for `problems`, running every distinct snippet once in `executor` (tirl.sandbox)."""
    if cfg.use_chat_template:
        raise ValueError(
            "SFT traces render the built-in ChatML prompt: set agent.use_chat_template=false in the "
            "config the traces are made for (the loop must render the same prompt)"
        )
    plans = plan_traces(problems, mix or TraceMix(), cfg, seed)
    snippets = sorted(
        {c for pl in plans if pl.kind != "no_tool" for c in (_code_of(pl.problem), pl.failed_code) if c}
    )
    gate = asyncio.Semaphore(16)

    async def run(code: str) -> tuple[bool, str]:
        """(whether the call ran without error, the tool-response text the model sees)."""
        for attempt in range(INFRA_RETRIES + 1):  # a starved, queued-out or lost call is the machine's fault
            async with gate:
                try:  # the agent loop's hard cap on one call, too: a lost call must not hang the demo
                    result = await asyncio.wait_for(
                        executor.run(code, "", cfg.tool_timeout), cfg.tool_wait_timeout
                    )
                except TimeoutError:
                    result = None
            if result is not None and not result.is_infra_error:
                break
            await asyncio.sleep(2.0 * (attempt + 1))
        else:
            what = (
                f"{result.status}: {result.message}"
                if result
                else f"no result within {cfg.tool_wait_timeout} s"
            )
            raise RuntimeError(
                f"the sandbox failed {INFRA_RETRIES + 1} times while making SFT traces ({what}); "
                "if the machine is overloaded, rerun when it is quieter"
            )
        text = truncate_middle(result.render(show_time=cfg.show_exec_time), cfg.tool_output_max_chars)
        return result.ok, text

    results = dict(zip(snippets, await asyncio.gather(*(run(c) for c in snippets)), strict=True))
    outputs = {code: text for code, (_, text) in results.items()}
    for pl in plans:
        if pl.failed_code and results[pl.failed_code][0]:
            raise RuntimeError(
                f"the failed first attempt ({pl.failure}) at {pl.problem.id} ran without error, so its trace "
                f"would say a working call failed: {pl.failed_code!r}. Lower agent.tool_timeout "
                f"({cfg.tool_timeout} s) below what this machine needs to run it"
            )
        if (
            pl.kind in ("tool", "code_fix")
            and _printed_value(outputs[_code_of(pl.problem)]) != pl.problem.answer
        ):
            raise RuntimeError(
                f"reference code of {pl.problem.id} did not print its answer: {outputs[_code_of(pl.problem)]!r}"
            )
    return [render_trace(pl, outputs, cfg) for pl in plans]


def copy_drills(n: int, seed: int = 0, max_digits: int = 3) -> list[dict]:
    """`n` SFT examples "Repeat: 812 40 571" -> "812 40 571" (ChatML; only the copy is trained on).

    Numbers have up to `max_digits` digits: 3 keeps each one a single token of the demo tokenizer.
    """
    rng = random.Random(f"drills-{seed}")
    drills = []
    for _ in range(n):
        sizes = [rng.randint(1, max_digits) for _ in range(rng.randint(2, 6))]
        numbers = " ".join(str(rng.randint(0, 10**k - 1)) for k in sizes)
        prompt = f"<|im_start|>user\nRepeat: {numbers}<|im_end|>\n<|im_start|>assistant\n"
        drills.append({"prompt": prompt, "completion": numbers + END, "kind": "copy_drill"})
    return drills


def shaped_drills(problems: list[Problem], n: int, cfg: AgentConfig, seed: int = 0) -> list[dict]:
    """`n` drills in the traces' shapes, alternating: a trace's first turn up to its plan (the prompt)
    -> its call of the reference code, and its last turn, a tool response holding the answer (the
    prompt) -> `DONE` with that answer boxed. Every completion is determined by its prompt, so greedy
    exact match measures the skill (tirl.demo.drills.copy_accuracy)."""
    rng = random.Random(f"shaped-{seed}")
    head = "<|im_start|>user\nAnswer from the tool's output."  # a tool response closes this turn itself
    drills = []
    for i in range(n):
        p = rng.choice(problems)
        if i % 2 == 0:
            prompt = build_prompt_text(None, p.problem, cfg) + TOOL_PLANS[0] + "\n"
            completion = tool_call_text(_code_of(p), cfg)
        else:
            prompt = head + tool_response_text([f"{p.answer}\n[ok]"], cfg, False)
            completion = DONE.format(n=p.answer)
        drills.append({"prompt": prompt, "completion": completion + END, "kind": "shaped_drill"})
    return drills


def write_traces(traces: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(t) + "\n" for t in traces))
    return path
