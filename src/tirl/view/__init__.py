"""tirl.view: `tirl view PATH`, a trajectory viewer in one self-contained HTML file.

PATH is an eval output directory, a training run directory (its sampled trajectories and metrics
curves) or a trajectories.jsonl. `records` turns stored trajectories into what the page shows,
`report` writes the page (assets/ holds its HTML, CSS and JS), `serve` serves it on localhost.
"""

from tirl.view.records import Source, ViewError, load_source, view_record
from tirl.view.report import build_html, printable, write_view

__all__ = ["Source", "ViewError", "build_html", "load_source", "printable", "view_record", "write_view"]
