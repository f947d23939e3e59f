"""Object addresses in printed reprs: found by the process that printed them, renumbered for the model.

`<generator object <genexpr> at 0x55d03cfdf2a0>` differs in every process (ASLR, allocation history),
so a seed would not reproduce the tokens a model sees. Renumbering every hex number after " at "
also rewrote values a program computed (`print(f"peak at {hex(n)}")`), and two different values
could come out as one. So the process that printed the text decides: the call's runner (cell.py)
notes each hex number after " at " written through sys.stdout or sys.stderr, and its report lists
those that lie in its own memory mappings (`mapped`), i.e. real object addresses; the result carries
them (`extra["addresses"]`) and `stable_addresses` renumbers only those. Text written around Python's
streams (`os.write(1, ...)`) is not watched: its addresses stay as they are.
"""

from __future__ import annotations

import re
from collections.abc import Collection

AFTER_AT = re.compile(r"(?<= at )0x[0-9a-fA-F]+")
REPORTED_MAX = 64  # addresses one report lists (the report's text is bounded)
# Without a list from the process (a result from an older service): only what has the shape of a
# CPython repr's address: inside `<...>`, lower-case %p hex of an 8-aligned user-space pointer.
_REPR_SHAPE = re.compile(r"(?<= at )0x[0-9a-f]+(?=[>:;,])")
_USER_SPACE = range(0x10000, 1 << 48)

_seen: set[str] = set()  # hex numbers after " at " the current cell wrote (the runner's, per process)


def note(text: str) -> None:
    """Remember the hex numbers after " at " in text the user's code writes (cheap when there are none)."""
    if " at 0x" in text:
        _seen.update(AFTER_AT.findall(text))


def reported() -> str | None:
    """The noted numbers that are addresses in this process's memory, space-separated (None: nothing
    was noted); then forgotten."""
    if not _seen:
        return None
    mappings = _mappings()
    found = [a for a in sorted(_seen) if _is_mapped(int(a, 16), mappings)]
    _seen.clear()
    return " ".join(found[:REPORTED_MAX])


def _mappings() -> list[tuple[int, int]]:
    try:
        with open("/proc/self/maps") as f:
            spans = [line.split(" ", 1)[0].split("-") for line in f]
    except OSError:
        return []
    return [(int(lo, 16), int(hi, 16)) for lo, hi in spans]


def _is_mapped(address: int, mappings: list[tuple[int, int]]) -> bool:
    return any(lo <= address < hi for lo, hi in mappings)


def stable_addresses(text: str, addresses: Collection[str] | None = None) -> str:
    """`text` with its object addresses numbered by first appearance (0x#1, 0x#2, ...): one object
    keeps one number within a text, and a value the program computed stays as it is.

    The number's form is one no hex formatting writes (`#` is not a digit), and if the text already
    holds it (a program printed `0x#` on purpose), more `#` are used until it does not: so a
    renumbered address never equals anything the program printed (0x000000000002 could).

    `addresses`: the ones the printing process reported (`ExecResult.extra["addresses"]`); None when
    it noted none (the text came around Python's streams, or from an older service): then only
    numbers shaped like a repr's address are renumbered."""
    numbers: dict[str, str] = {}
    mark = renumber_mark(text)

    def number(m: re.Match[str]) -> str:
        return numbers.setdefault(m.group(), f"{mark}{len(numbers) + 1}")

    if addresses is None:
        return _REPR_SHAPE.sub(lambda m: number(m) if _pointer_like(m.group()) else m.group(), text)
    if not addresses:
        return text
    real = set(addresses)
    return AFTER_AT.sub(lambda m: number(m) if m.group() in real else m.group(), text)


def renumber_mark(text: str) -> str:
    """`0x#`, or `0x##`, ...: the shortest such prefix that `text` does not already contain."""
    mark = "0x#"
    while mark in text:
        mark += "#"
    return mark


def _pointer_like(hex_text: str) -> bool:
    value = int(hex_text, 16)
    return value in _USER_SPACE and value % 8 == 0
