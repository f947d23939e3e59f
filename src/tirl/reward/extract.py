"""Answer extraction: the final `\\boxed{}` the model wrote, never one a tool printed.

The answer is the last `\\boxed{}` inside the last `<answer>` block; when there is no such box, the last
`\\boxed{}` of the final turn (the text after the last `</tool_response>`). Tool responses are removed
first, so a program printing `\\boxed{42}` cannot answer for the model.
"""

from __future__ import annotations

import re

_TOOL_RESPONSE = re.compile(r"<tool_response>.*?(?:</tool_response>|\Z)", re.DOTALL)
# An unclosed <answer> (the model stopped right after its answer) still counts up to the end of the text.
_ANSWER_BLOCK = re.compile(r"<answer>(.*?)(?:</answer>|\Z)", re.DOTALL)
_BOXED = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def extract_answer(response: str) -> str | None:
    """The model's final answer (the content of its last `\\boxed{}`), or None when it gave none."""
    model_text = _TOOL_RESPONSE.sub("", response)
    blocks = _ANSWER_BLOCK.findall(model_text)
    if blocks:
        answer = last_boxed(blocks[-1])
        if answer is not None:
            return answer
    final_turn = response.rsplit("</tool_response>", 1)[-1]
    return last_boxed(_TOOL_RESPONSE.sub("", final_turn))


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
