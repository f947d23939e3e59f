"""How `tirl view` scales: 1,000 vs 10,000 trajectories of realistic size, side by side, in headless Chromium.

For each size: building the page (Python), its size on disk, the time from navigation until the table
is ready (parsing the embedded JSON once + the first rows), one filter, the first search (which builds
the search text of every trajectory) and a second search, each timed inside the page around the
synchronous event handler. Ratios are 10,000 / 1,000: ~10x means linear; the table itself is
virtualised, so what grows is the JSON parse and the scans, not the DOM.

    python benchmarks/view_scale.py [--sizes 1000 10000]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tests' browser harness
sys.path.insert(0, str(ROOT / "src"))

from tests.view.browser import Page, chromium, unavailable  # noqa: E402

from tirl.agent import AgentConfig  # noqa: E402
from tirl.agent.protocol import tool_response_text  # noqa: E402
from tirl.agent.trajectory import ToolCallRecord, Trajectory  # noqa: E402
from tirl.rl.trajectory_sample import compact  # noqa: E402
from tirl.view import write_view  # noqa: E402

REASONING = "Let me think about the structure of this problem and check small cases first. " * 20  # ~1.6 KB
STATUSES = ["ok", "ok", "ok", "runtime_error", "timeout", "malformed"]


def records(n: int) -> list[dict]:
    """n trajectories of ~3 turns with ~1.6 KB of reasoning, a tool call and its output per turn."""
    cfg, rows = AgentConfig(), []
    for i in range(n):
        calls, text = [], ""
        for turn in range(1 + i % 4):
            status = STATUSES[(i + turn) % len(STATUSES)]
            code = f"from sympy import factorint\nn = {i * 7919 + turn}\nprint(factorint(n), sum(range(n)))"
            call = json.dumps({"name": "execute_python_code_with_standard_io", "arguments": {"code": code}})
            text += f"{REASONING}<tool_call>{call}</tool_call>"
            text += tool_response_text([f"{{{i}: 1}} {i * (i - 1) // 2}" * 4], cfg, turn_closed=False)
            calls.append(ToolCallRecord(turn=turn, status=status, code=code, wall_ms=12.5))
        text += f"So <answer>\\boxed{{{i % 97}}}</answer><|im_end|>"
        length = 600 + 37 * (i % 200)
        traj = Trajectory(
            problem_id=f"p{i // 16}",
            prompt_ids=[],
            response_ids=[1] * length,
            loss_mask=[1] * length,
            response_text=text,
            turns=len(calls) + 1,
            tool_calls=calls,
            answer_blocks=1,
            finish_reason="length" if i % 9 == 0 else "answered",
            reward=float(i % 3 == 0),
            sample_index=i % 16,
        )
        rows.append(
            {"benchmark": f"b{i % 4}", "problem": f"Problem {i}: find n.", "reference": "1", **compact(traj)}
        )
    return rows


TIMED = """([sel, value, kind]) => {
  const el = document.querySelector(sel), t0 = performance.now();
  el.value = value;
  el.dispatchEvent(new Event(kind));
  return performance.now() - t0;
}"""


def measure(browser, n: int, work: Path) -> dict:
    path = work / f"t{n}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records(n)))
    start = time.perf_counter()
    page_file, _ = write_view(path)
    build_s = time.perf_counter() - start
    start = time.perf_counter()
    page = Page(browser, page_file.as_uri())
    ready_ms = 1000 * (time.perf_counter() - start)
    assert page.shown() == n and not page.errors, page.errors
    init_ms = float(page.page.get_attribute("body", "data-init-ms"))
    rows_in_dom = len(page.row_ids())
    filter_ms = page.page.evaluate(TIMED, ["#f-finish", "length", "change"])
    page.page.evaluate(TIMED, ["#f-finish", "", "change"])
    # the search input debounces typing; its handler is called directly to time the search itself
    search = """(term) => { document.querySelector('#q').value = term;
      const t0 = performance.now(); applyFilters(); return performance.now() - t0; }"""
    first_ms = page.page.evaluate(search, "n = 79")
    found = page.shown()
    second_ms = page.page.evaluate(search, "n = 791")
    assert 0 < page.shown() <= found
    page.close()
    return {
        "trajectories": n,
        "page MB": page_file.stat().st_size / 2**20,
        "build s": build_s,
        "open ms": ready_ms,
        "JSON parse + first rows ms": init_ms,
        "filter ms": filter_ms,
        "1st search ms": first_ms,
        "2nd search ms": second_ms,
        "rows in DOM": rows_in_dom,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10_000])
    args = parser.parse_args()
    if reason := unavailable():
        sys.exit(f"view_scale needs a browser: {reason}")
    with tempfile.TemporaryDirectory() as tmp, chromium() as browser:
        results = [measure(browser, n, Path(tmp)) for n in args.sizes]
    keys = list(results[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---:|" * len(keys))
    for r in results:
        print("| " + " | ".join(f"{r[k]:.2f}" if isinstance(r[k], float) else str(r[k]) for k in keys) + " |")
    if len(results) > 1:
        base, big = results[0], results[-1]
        ratios = ", ".join(f"{k} {big[k] / base[k]:.1f}x" for k in keys[1:] if base[k])
        print(f"ratios {big['trajectories']} / {base['trajectories']}: {ratios}")


if __name__ == "__main__":
    from tirl.lifetime import children_die_with_me

    children_die_with_me()  # its engines, sandboxes and workers die with it, even on kill -9
    main()
