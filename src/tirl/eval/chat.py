"""`tirl chat`: an interactive terminal agent that shows reasoning, tool calls and tool results as they come.

Ctrl-C during an answer stops that answer; Ctrl-C or EOF (Ctrl-D) at the prompt exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import re

from rich.console import Console
from rich.panel import Panel
from rich.syntax import Syntax
from rich.text import Text

from tirl.agent.config import AgentConfig
from tirl.data.problem import Problem
from tirl.engines.config import EngineConfig
from tirl.reward import extract_answer
from tirl.runtime import ClusterConfig, Runtime, open_runtime

PROMPT = "problem> "
# Terminal control characters (ESC, CSI, BEL, ...; newline and tab excepted): a program's output, or the
# model's text, could erase lines, move the cursor over the answer line, or set the clipboard (OSC 52).
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
CONTEXT_FOR_PROMPT = 4096  # room for the system prompt, tool schema and the typed problem


def chat(
    engine_cfg: EngineConfig, sandbox_cfg, agent_cfg: AgentConfig, console: Console | None = None
) -> None:
    """Read problems from the terminal until EOF / Ctrl-C; run the agent on each, printing events."""
    console = console or Console()
    with asyncio.Runner() as runner:
        stack = contextlib.AsyncExitStack()
        runtime: Runtime = runner.run(
            stack.enter_async_context(open_runtime(ClusterConfig(), engine_cfg, sandbox_cfg, reward=None))
        )
        try:
            for index in itertools.count():
                try:
                    text = console.input(PROMPT)
                except (EOFError, KeyboardInterrupt):
                    console.print("\nbye")
                    return
                if not text.strip():
                    continue
                problem = Problem(id=f"chat-{index}", problem=text.strip(), answer="")
                try:
                    runner.run(_answer(runtime, problem, agent_cfg, console, index))
                except KeyboardInterrupt:
                    console.print("[yellow]stopped[/yellow]")
        finally:
            runner.run(stack.aclose())


async def _answer(runtime: Runtime, problem: Problem, cfg: AgentConfig, console: Console, seed: int) -> None:
    from tirl.agent.loop import run_trajectory

    def on_event(kind: str, payload: dict) -> None:
        if kind == "turn":
            console.print(
                Panel(Text(shown(payload["text"])), title=f"turn {payload['turn'] + 1}", title_align="left")
            )
        elif kind == "tool_call":
            code = Syntax(shown(payload["code"]), "python", word_wrap=True)
            console.print(Panel(code, title="tool call", border_style="cyan", title_align="left"))
        elif kind == "tool_result":
            style = "green" if payload["status"] == "ok" else "red"
            title = f"tool result ({payload['status']})"
            console.print(
                Panel(Text(shown(payload["text"])), title=title, border_style=style, title_align="left")
            )

    traj = await run_trajectory(
        runtime.pool,
        runtime.tokenizer,
        runtime.executor,
        problem,
        cfg,
        group=problem.id,
        seed=seed,
        on_event=on_event,
    )
    answer = extract_answer(traj.model_turns)
    summary = f"answer: {answer if answer is not None else '(none)'}   finish: {traj.finish_reason}"
    summary += f"   turns: {traj.turns}   tool calls: {traj.num_tool_calls}   tokens: {traj.response_length}"
    if traj.error:
        summary += f"   error: {traj.error}"
    console.print(Text(shown(summary), style="bold"))


def shown(text: str) -> str:
    """`text` with every terminal control character written as its escape (`\\x1b`), so it is shown,
    never obeyed."""
    return _CONTROL.sub(lambda m: ascii(m.group())[1:-1], text)
