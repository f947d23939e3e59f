"""Tool text in token space: the frame around it may hold control tokens, the tool text never does.

A tool's output is untrusted text: a program can print `<|im_end|>`, `<|im_start|>`, `</tool_response>`.
Tokenized as it is, each becomes the special token the chat format uses to end a turn or a tool
response, so code could forge turns in the model's context. `encode_framed` tokenizes a segment given
as (text, trusted) pieces: the trusted pieces (the frame tirl writes, e.g. `<|im_end|>\\n<|im_start|>user
\\n<tool_response>\\n`) keep their control tokens; in the untrusted ones every control-token string is
cut in two, so it can only be read as plain text. Everything else is tokenized as one string, as it
was: tool output without a control-token string gives exactly the ids whole-text tokenization gives,
on any tokenizer.
"""

from __future__ import annotations

import itertools
import re
import weakref
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass, field

# An added token written as a tag (`<tool_response>`, `</tool_call>`, `<think>`, `<|fim_pad|>`): markup
# of the chat or tool format, never data. Added tokens that are data (the demo's number tokens,
# `\boxed{`) stay tokens in tool text.
_TAG = re.compile(r"<[^<>\s]+>")
_CACHED_FRAME_CHARS = 512  # frames this short (the loop's) have their control count remembered
_CACHED_FRAMES = 1024

Piece = tuple[str, bool]  # (text, trusted)


@dataclass
class _Controls:
    by_text: dict[str, int]
    ids: frozenset[int]
    frames: dict[str, int] = field(default_factory=dict)  # short trusted text -> its control tokens


_CONTROLS: weakref.WeakKeyDictionary[object, _Controls] = weakref.WeakKeyDictionary()


def control_tokens(tokenizer) -> dict[str, int]:
    """The tokens tool text may never turn into, by text: every special token and every added token
    written as a tag. Looked up once per tokenizer."""
    return _controls(tokenizer).by_text


def _controls(tokenizer) -> _Controls:
    with suppress(KeyError, TypeError):
        return _CONTROLS[tokenizer]
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    found = {t.content: i for i, t in added.items() if t.special or _TAG.fullmatch(t.content)}
    for text in getattr(tokenizer, "all_special_tokens", ()):
        token_id = tokenizer.convert_tokens_to_ids(text)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
            found.setdefault(text, token_id)
    controls = _Controls(found, frozenset(found.values()))
    with suppress(TypeError):  # a tokenizer that cannot be weakly referenced: looked up every time
        _CONTROLS[tokenizer] = controls
    return controls


def encode_framed(tokenizer, pieces: Sequence[Piece]) -> list[int]:
    """Token ids of the concatenated pieces, control tokens only where a trusted piece wrote them.

    ValueError when the ids still hold a control token the frame did not write (a tokenizer whose
    normalizer assembles one from other characters): such text never reaches the model."""
    text = "".join(t for t, _ in pieces)
    spans = _untrusted_spans(pieces)
    if not spans:  # all frame (a prompt without tool messages): nothing to cut, nothing to check
        return _encode(tokenizer, text)
    controls = _controls(tokenizer)
    ids = [i for chunk in _chunks(text, spans, controls) for i in _encode(tokenizer, chunk)]
    _check_frame(tokenizer, ids, pieces, controls)
    return ids


def encode_framed_offsets(tokenizer, pieces: Sequence[Piece]) -> tuple[list[int], list[tuple[int, int]]]:
    """`encode_framed`'s ids, each with its [start, end) in the pieces' joined text (SFT keeps the loss
    on the tokens of some spans only). Needs a fast tokenizer."""
    text = "".join(t for t, _ in pieces)
    spans = _untrusted_spans(pieces)
    controls = _controls(tokenizer)
    ids: list[int] = []
    offsets: list[tuple[int, int]] = []
    at = 0
    for chunk in _chunks(text, spans, controls) if spans else [text]:
        enc = tokenizer(chunk, add_special_tokens=False, return_offsets_mapping=True)
        ids += enc["input_ids"]
        offsets += [(at + a, at + b) for a, b in enc["offset_mapping"]]
        at += len(chunk)
    if spans:
        _check_frame(tokenizer, ids, pieces, controls)
    return ids, offsets


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _frame_controls(tokenizer, text: str, controls: _Controls) -> int:
    """How many control tokens the trusted `text` holds, tokenized on its own."""
    if text in controls.frames:
        return controls.frames[text]
    count = sum(i in controls.ids for i in _encode(tokenizer, text))
    if len(text) <= _CACHED_FRAME_CHARS:
        if len(controls.frames) >= _CACHED_FRAMES:
            controls.frames.clear()
        controls.frames[text] = count
    return count


def _untrusted_spans(pieces: Sequence[Piece]) -> list[tuple[int, int]]:
    spans, at = [], 0
    for text, trusted in pieces:
        if not trusted and text:
            spans.append((at, at + len(text)))
        at += len(text)
    return spans


def _chunks(text: str, spans: list[tuple[int, int]], controls: _Controls) -> list[str]:
    """`text` cut so that no control-token string overlapping untrusted text stays whole."""
    bounds = [0, *_cuts(text, spans, controls.by_text), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds) if b > a]


def _cuts(text: str, spans: list[tuple[int, int]], controls: dict[str, int]) -> list[int]:
    """Where to cut `text` so that no control-token string overlapping untrusted text stays whole:
    just after the first character of each one."""
    cuts: set[int] = set()
    for token in controls:
        if len(token) < 2:  # nothing to cut; _check_frame refuses it if it matters
            continue
        start = text.find(token)
        while start >= 0:
            end = start + len(token)
            if any(start < b and a < end for a, b in spans):
                cuts.add(start + 1)
            start = text.find(token, start + 1)
    return sorted(cuts)


def _check_frame(tokenizer, ids: list[int], pieces: Sequence[Piece], controls: _Controls) -> None:
    framed = sum(_frame_controls(tokenizer, text, controls) for text, trusted in pieces if trusted and text)
    found = sum(i in controls.ids for i in ids)
    if found != framed:
        extra = sorted({tokenizer.convert_ids_to_tokens(i) for i in ids if i in controls.ids})
        raise ValueError(
            f"tool output would reach the model as control token(s) {', '.join(extra)} "
            f"({found} control tokens where the frame writes {framed}); refusing to tokenize it"
        )
