"""Programmatic tool-using SFT traces for the synthetic tasks, with realistic imperfections.

A trace is exactly what the agent loop would produce for the problem, as text: the loop's prompt
(tirl.agent.protocol), then assistant turns and tool-response segments rendered by the same protocol
functions, with the REAL output of each call (run in the sandbox). Written as `{"prompt", "completion"}`
lines for `tirl sft`, which trains on the completion minus the <tool_response> blocks; so SFT sees the
very token layout RL samples.

The mix makes the SFT policy capable but unreliable, so RL has something to learn:
  - tool:     plan, one correct call, read the output, answer;
  - code_fix: the first call has a bug (NameError, typo, missing import), the error comes back, the
              next turn fixes it (RoC's p_err prefers correct trajectories without such detours);
  - no_tool:  a guess without running code (usually wrong: RL learns that the tool pays off);
  - a few answers repeat the <answer> block (RoC's p_format penalizes it).

A model trained from scratch also lacks what pretraining gives for free: copying a digit string it has
just read (from the problem into code, from the tool's output into the answer). `copy_drills` are
short instruction-following examples that teach exactly that; they never mention the tasks.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tirl.agent.config import AgentConfig
from tirl.agent.protocol import TOOL_SCHEMA, build_prompt_text, tool_response_text, truncate_middle
from tirl.data.problem import Problem

END = "<|im_end|>"
TOOL_PLANS = ("I will compute this with Python.", "Let me run Python to get the exact value.")
FIX_PLANS = ("The code failed. Let me fix it.", "There is an error in my code; fixing it.")
GUESS_PLANS = ("This looks easy to estimate: about {g}.", "A rough mental estimate gives {g}.")
DONE = "The code printed the result.</reason>\n<answer>\\boxed{{{n}}}</answer>"


class TraceMix(BaseModel):
    """Shares of the trace kinds (the rest are clean one-call traces)."""

    model_config = ConfigDict(extra="forbid")

    no_tool: float = Field(0.3, ge=0, le=1)
    code_fix: float = Field(0.15, ge=0, le=1)
    redundant_answer: float = Field(0.05, ge=0, le=1)  # of the traces that answer after a tool call

    @model_validator(mode="after")
    def _fits(self) -> TraceMix:
        if self.no_tool + self.code_fix > 1:
            raise ValueError(f"no_tool + code_fix = {self.no_tool + self.code_fix} > 1")
        return self


@dataclass
class _Plan:
    """What one trace will do, decided before any code runs."""

    problem: Problem
    kind: str  # tool | code_fix | no_tool
    redundant: bool
    buggy_code: str = ""
    seed: int = 0  # picks the phrasings


def tool_call_text(code: str, cfg: AgentConfig) -> str:
    """A call of the config's tool (only the required `code` argument), as the template writes it."""
    schema = cfg.tool_schema or TOOL_SCHEMA
    name = schema.get("function", schema)["name"]
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": {"code": code}}) + "\n</tool_call>"


def buggy_variant(code: str, rng: random.Random) -> str:
    """A realistic first attempt that fails: a typo, a wrong variable, or a missing import."""
    body = code.removeprefix("import math\n")
    expr = body.removeprefix("print(").removesuffix(")")
    variants = [body.replace("print(", "prnt(", 1), f"result = {expr}\nprint(answer)"]
    if code.startswith("import math\n"):
        variants.append(body)  # math.lcm without the import
    return rng.choice(variants)


def guess(answer: str, rng: random.Random) -> str:
    """A number of the answer's size that is almost surely wrong (the model's head cannot do this)."""
    n = len(answer.lstrip("-"))
    while True:
        g = str(rng.randint(10 ** (n - 1) if n > 1 else 0, 10**n - 1))
        if g != answer:
            return g


def plan_traces(problems: list[Problem], mix: TraceMix, seed: int = 0) -> list[_Plan]:
    rng = random.Random(seed)
    plans = []
    for p in problems:
        code = _code_of(p)
        r = rng.random()
        kind = "no_tool" if r < mix.no_tool else "code_fix" if r < mix.no_tool + mix.code_fix else "tool"
        plans.append(
            _Plan(
                problem=p,
                kind=kind,
                redundant=kind != "no_tool" and rng.random() < mix.redundant_answer,
                buggy_code=buggy_variant(code, rng) if kind == "code_fix" else "",
                seed=rng.randrange(1 << 30),
            )
        )
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
    if plan.kind == "no_tool":
        g = guess(p.answer, rng)
        text = rng.choice(GUESS_PLANS).format(g=g) + f"</reason>\n<answer>\\boxed{{{g}}}</answer>{END}"
        return {"prompt": prompt, "completion": text, "kind": plan.kind, "id": p.id}
    code = _code_of(p)
    parts = [rng.choice(TOOL_PLANS) + "\n"]
    if plan.kind == "code_fix":
        parts += [
            tool_call_text(plan.buggy_code, cfg),
            tool_response_text([outputs[plan.buggy_code]], cfg, False),
        ]
        parts.append(rng.choice(FIX_PLANS) + "\n")
    parts += [tool_call_text(code, cfg), tool_response_text([outputs[code]], cfg, False)]
    result = _printed_value(outputs[code])
    final = DONE.format(n=result)
    if plan.redundant:
        final += f"\n<answer>\\boxed{{{result}}}</answer>"
    parts.append(final + END)
    return {"prompt": prompt, "completion": "".join(parts), "kind": plan.kind, "id": p.id}


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
    plans = plan_traces(problems, mix or TraceMix(), seed)
    snippets = sorted(
        {c for pl in plans if pl.kind != "no_tool" for c in (_code_of(pl.problem), pl.buggy_code) if c}
    )
    gate = asyncio.Semaphore(64)

    async def run(code: str) -> str:
        async with gate:
            result = await executor.run(code, "", cfg.tool_timeout)
        if result.is_infra_error:
            raise RuntimeError(
                f"the sandbox failed while making SFT traces ({result.status}): {result.message}"
            )
        return truncate_middle(result.render(show_time=cfg.show_exec_time), cfg.tool_output_max_chars)

    outputs = dict(zip(snippets, await asyncio.gather(*(run(c) for c in snippets)), strict=True))
    for pl in plans:
        if pl.kind != "no_tool" and _printed_value(outputs[_code_of(pl.problem)]) != pl.problem.answer:
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


def write_traces(traces: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(t) + "\n" for t in traces))
    return path
