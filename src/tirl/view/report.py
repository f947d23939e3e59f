"""The viewer's one HTML file: viewer.html with viewer.css, viewer.js and the data inlined.

The file needs nothing else: no server, no CDN, no network. The data is one JSON block that the
page parses once; `<` is escaped inside it so no trajectory text can close the script element.
"""

from __future__ import annotations

import html
import json
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
            {"step": row["step"], **{short: row[key] for key, short in CURVES.items() if key in row}}
            for row in source.curves
            if "step" in row
        ],
        "trajectories": [view_record(raw, i, source.agent) for i, raw in enumerate(source.records)],
    }


def build_html(source: Source) -> str:
    assets = files("tirl.view") / "assets"
    template = (assets / "viewer.html").read_text(encoding="utf-8")
    data = json.dumps(page_data(source), ensure_ascii=False, separators=(",", ":")).replace("<", "\\u003c")
    page = (
        template.replace("__TITLE__", html.escape(f"tirl view: {source.path}"))
        .replace("__CSS__", (assets / "viewer.css").read_text(encoding="utf-8"))
        .replace("__JS__", (assets / "viewer.js").read_text(encoding="utf-8"))
    )
    head, tail = page.split("__DATA__")  # last, so no placeholder is ever looked for inside the data
    return head + data + tail


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
    target.write_text(build_html(source), encoding="utf-8")
    return target, len(source.records)
