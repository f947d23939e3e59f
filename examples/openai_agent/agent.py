"""A plain Python agent written against the OpenAI API: it knows nothing of tirl.

It asks the model, runs the Python code of a <tool_call> in a subprocess (its own tool), sends the
output back as a `tool` message and repeats until the model answers. Pointed at tirl's endpoint
(base URL http://HOST:PORT/t/<trajectory id>/v1) every one of its episodes is recorded for training.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys

from openai import APIStatusError, AsyncOpenAI

TOOL = {"name": "python", "parameters": {"properties": {"code": {"type": "string"}}, "required": ["code"]}}
SYSTEM = "Use the python tool.\n\n# Tools\n<tools>\n" + json.dumps(TOOL) + "\n</tools>"
CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def run_python(code: str, timeout_s: float = 2.0, max_chars: int = 400) -> str:
    """The agent's tool: the code's output (its first max_chars, as the demo's agent keeps) and a
    status line ("42\\n[ok]")."""
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return f"[timeout: Timed out after {timeout_s:g} s]"
    status = "ok" if done.returncode == 0 else "runtime_error"
    body = done.stdout + (done.stderr.strip().splitlines()[-1] + "\n" if done.stderr.strip() else "")
    return f"{body[:max_chars]}[{status}]"


def tool_output(turn: str) -> str | None:
    """The output for the turn's tool call, an error for a malformed one, None when it made none."""
    match = CALL.search(turn)
    if match is None:
        return None
    try:
        call = json.loads(match.group(1))
        return run_python(call["arguments"]["code"])
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        return f"Error: malformed tool call ({type(e).__name__})"


async def solve(
    client: AsyncOpenAI, problem: str, seed: int, max_turns: int = 4, max_tokens: int = 192
) -> str:
    """One episode; the model's last message."""
    messages: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": problem}]
    text = ""
    for turn in range(max_turns):
        try:
            reply = await client.chat.completions.create(
                model="policy",
                messages=messages,
                temperature=1.0,
                max_tokens=max_tokens,
                stop=["</tool_call>"],  # run the call the moment it is written
                seed=seed * 100 + turn,
            )
        except APIStatusError:  # no room for another turn (token budget or context used up): done
            break
        text = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})
        output = await asyncio.to_thread(tool_output, text)  # many episodes share this event loop
        if output is None or reply.choices[0].finish_reason == "length":
            break
        messages.append({"role": "tool", "content": output})
    return text
