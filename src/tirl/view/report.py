"""The viewer's one HTML file: viewer.html with viewer.css, viewer.js and the data inlined.

The file needs nothing else: no server, no CDN, no network. The data is one JSON block that the
page parses once; `<` is escaped inside it so no trajectory text can close the script element.
"""

from __future__ import annotations

import html
import json
import math
import os
import re
from importlib.resources import files
from pathlib import Path

from tirl.view.records import Source, ViewError, load_source, view_record

# metrics.jsonl keys plotted as the training curves (the page's names on the right).
CURVES = {
    "reward/mean": "reward",
    "tools/error_ratio_in_correct": "err_correct",
    "response/length_mean": "length",
}


def page_data(source: Source) -> dict:
    """Everything the page shows, as one JSON-able dict."""
    return {
        "kind": source.kind,
        "source": str(source.path),
        "summary": source.summary,
        "curves": [
            {
                "step": row["step"],
                # null: logged but empty at that step (e.g. no correct trajectory), not "not logged"
                **{
                    short: row[key] if _number(row[key]) else None
                    for key, short in CURVES.items()
                    if key in row
                },
            }
            for row in source.curves
            if _number(row.get("step"))
        ],
        "trajectories": [view_record(raw, i, source.agent) for i, raw in enumerate(source.records)],
    }


# The template's slots, filled in one pass over the template alone: a path or record that holds
# "__DATA__" or "__JS__" is never taken for a slot.
_SLOT = re.compile(r"__(TITLE|CSS|JS|DATA)__")
# A lone surrogate (a JSON "\\ud800" escape, or a file name that is not UTF-8) cannot be written as
# UTF-8: it is shown as U+FFFD instead of stopping the viewer.
_SURROGATE = re.compile("[\ud800-\udfff]")


def _number(value: object) -> bool:
    """A value a curve can plot (a metrics row written by someone else may hold anything)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def build_html(source: Source) -> str:
    assets = files("tirl.view") / "assets"
    template = (assets / "viewer.html").read_text(encoding="utf-8")
    data = json.dumps(page_data(source), ensure_ascii=False, separators=(",", ":")).replace("<", "\\u003c")
    slots = {
        "TITLE": html.escape(f"tirl view: {source.path}"),
        "CSS": (assets / "viewer.css").read_text(encoding="utf-8"),
        "JS": (assets / "viewer.js").read_text(encoding="utf-8"),
        "DATA": data,
    }
    return printable(_SLOT.sub(lambda m: slots[m.group(1)], template))


def printable(text: object) -> str:
    """`text` with lone surrogates as U+FFFD: what a page or a terminal can show of it."""
    return _SURROGATE.sub("\ufffd", str(text))


def default_output(path: Path) -> Path:
    """DIR/view.html for a directory, FILE.html next to a JSONL file."""
    return path / "view.html" if path.is_dir() else path.with_suffix(".html")


def write_view(path: str | Path, out: str | Path | None = None) -> tuple[Path, int]:
    """Write the viewer for PATH; returns (the HTML file, the number of trajectories in it)."""
    source = load_source(path)
    target = Path(out) if out else default_output(Path(path))
    if target.is_dir():
        raise ViewError(f"--out {target} is a directory: give a file name such as {target / 'view.html'}")
    target.parent.mkdir(parents=True, exist_ok=True)
    _write_unfollowed(target, build_html(source))
    return target, len(source.records)


def _write_unfollowed(target: Path, text: str) -> None:
    """Write `target` itself, never through a symbolic link at its path: a run directory someone shared
    may hold `view.html -> ~/.bashrc`, and viewing the run would overwrite that file with the page."""
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if not target.is_symlink():
            raise
        raise ViewError(
            f"{target} is a symbolic link (to {os.readlink(target)}): tirl view writes its page only to a "
            "file of its own; remove the link, or give --out FILE"
        ) from e
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
