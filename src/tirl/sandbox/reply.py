"""The service's replies, capped on what is sent: the JSON bytes after escaping, not the raw output.

A call keeps `keep_bytes` of the head and tail of each stream, but JSON escaping can grow that
text up to six times (a control character becomes `\\u0001`, a quote or backslash two bytes, an
invalid byte's `\\xff` escape five), so a cap counted on raw bytes let replies grow far past it.
`fit` measures each result's encoded JSON (the encoding the response uses) and, when a reply would
pass the cap, cuts the middle of the largest results' streams until it fits; a cut result says so
(`extra["reply_cut_bytes"]`, and its truncated-byte counts grow by what was cut).
"""

from __future__ import annotations

import json

from tirl.sandbox.result import ExecResult

ESCAPE_GROWTH = 6  # the most bytes JSON escaping turns one character of text into
SLACK_BYTES = 256  # room for a cut result's larger counts and the reply's own brackets


def encode(content: object) -> bytes:
    """JSON exactly as the service's responses are encoded (starlette's JSONResponse.render)."""
    return json.dumps(
        content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
    ).encode()


def fit(results: list[ExecResult], cap_bytes: int) -> list[ExecResult]:
    """`results`, with the largest cut in the middle of their streams so the reply fits `cap_bytes`."""
    if sum(_upper_bound(r) for r in results) <= cap_bytes:
        return results  # the common case: nothing is measured
    sizes = [len(encode(r.to_dict())) + 1 for r in results]
    if sum(sizes) + SLACK_BYTES <= cap_bytes:
        return results
    share = (cap_bytes - SLACK_BYTES) // len(results)
    small = sum(s for s in sizes if s <= share)
    big = [i for i, s in enumerate(sizes) if s > share]
    allowance = (cap_bytes - SLACK_BYTES - small) // len(big)
    out = list(results)
    for i in big:
        out[i] = _cut(results[i], allowance)
    return out


def _upper_bound(result: ExecResult) -> int:
    text = len(result.stdout) + len(result.stderr) + len(result.message)
    return ESCAPE_GROWTH * text + 4096


def _cut(result: ExecResult, allowance: int) -> ExecResult:
    """A copy of `result` whose encoded JSON fits `allowance` bytes: its streams cut in the middle."""
    base = len(encode(ExecResult.from_dict({**result.to_dict(), "stdout": "", "stderr": ""}).to_dict()))
    room = max(allowance - base - SLACK_BYTES, 0)
    costs = {name: len(encode(getattr(result, name))) for name in ("stdout", "stderr")}
    total = sum(costs.values()) or 1
    fields = result.to_dict()
    cut_bytes = 0
    for name, cost in costs.items():
        text = getattr(result, name)
        fields[name] = _keep_ends(text, room * cost // total)
        cut = _utf8_len(text) - _utf8_len(fields[name])
        fields[f"{name}_truncated_bytes"] += cut
        cut_bytes += cut
    fields["extra"] = {**fields["extra"], "reply_cut_bytes": cut_bytes}
    return ExecResult.from_dict(fields)


def _keep_ends(text: str, budget: int) -> str:
    """The head and tail of `text` whose JSON encoding fits `budget` bytes."""
    if len(encode(text)) <= budget:
        return text
    keep = min(len(text), budget) // 2  # characters at each end; shrunk until the escapes fit
    while keep > 0:
        candidate = text[:keep] + text[len(text) - keep :]
        if len(encode(candidate)) <= budget:
            return candidate
        keep = keep * max(budget, 1) // (len(encode(candidate)) + 1)
    return ""


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))
