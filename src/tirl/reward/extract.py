"""Answer extraction: the final `\\boxed{}` the model wrote, never one a tool printed.

The answer is the last `\\boxed{}` inside the last `<answer>` block; when there is no such box, the last
`\\boxed{}` of the final turn. It is read from the model's own turns (tirl.agent.Trajectory.model_turns:
the text of its generated tokens, loss mask 1), so no tool output can answer for the model, whatever it
prints: a closing `</tool_response>` tag and an `<answer>` included. A single string is read as a whole
transcript (records written by other tools, displays): tool responses are removed from it by their
tags first, which a printed closing tag defeats, so nothing that scores passes one.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_TOOL_RESPONSE = re.compile(r"<tool_response>.*?(?:</tool_response>|\Z)", re.DOTALL)
# An unclosed <answer> (the model stopped right after its answer) still counts up to the end of the text.
_ANSWER_BLOCK = re.compile(r"<answer>(.*?)(?:</answer>|\Z)", re.DOTALL)
_BOXED = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_TURN = "\x00"  # joins the model's turns: a box is read within one turn


def extract_answer(response: str | Sequence[str]) -> str | None:
    """The model's final answer (the content of its last `\\boxed{}`), or None when it gave none.

    `response`: the model's own turns, in order (or one transcript string, see the module's doc)."""
    if isinstance(response, str):
        model_text = _TOOL_RESPONSE.sub("", response)
        final_turn = response.rsplit("</tool_response>", 1)[-1]
    else:
        # An answer block may span turns, a box may not. Text the model itself wrapped in
        # <tool_response> tags never answered, and still does not.
        model_text = _TURN.join(_TOOL_RESPONSE.sub("", turn) for turn in response)
        final_turn = response[-1] if response else ""
    blocks = _ANSWER_BLOCK.findall(model_text)
    if blocks:
        answer = _last_boxed_of_a_turn(blocks[-1])
        if answer is not None:
            return answer
    return last_boxed(_TOOL_RESPONSE.sub("", final_turn))


def _last_boxed_of_a_turn(text: str) -> str | None:
    for part in reversed(text.split(_TURN)):
        answer = last_boxed(part)
        if answer is not None:
            return answer
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last complete `\\boxed{...}` (nested braces allowed) or `\\boxed x`; None if none."""
    for match in reversed(list(_BOXED.finditer(text))):
        content = _boxed_content(text, match.end())
        if content:
            return content
    return None


def _boxed_content(text: str, start: int) -> str | None:
    i = start
    while i < len(text) and text[i] in " \t":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":  # `\boxed 5`: one token, up to whitespace, the closing `$` or markup (`</answer>`)
        token = re.match(r"[^\s$<]+", text[i:])
        return token.group(0) if token else None
    depth = 0
    j = i
    while j < len(text):
        ch = text[j]
        if ch == "\\":  # `\{` and `\}` are literal braces (sets), not grouping
            j += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip().strip("$").strip() or None
        j += 1
    return None  # unclosed: the box was cut off
