"""tirl's sandbox service vs a process per call (code-judge / SandboxFusion style), side by side.

Usage: python benchmarks/sandbox_bench.py [--calls 300] [--concurrency 1,4,32] [--rss-calls 5000]
       [--workloads trivial,numpy,sympy,session]
Prints a markdown table (calls/s, p50/p99 latency, speed-up) and the service RSS before/after.
"""

from __future__ import annotations

import argparse

from tirl.sandbox.bench import main

if __name__ == "__main__":
    from tirl.lifetime import children_die_with_me

    children_die_with_me()  # its engines, sandboxes and workers die with it, even on kill -9
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=300, help="calls per workload and concurrency level")
    p.add_argument("--concurrency", default="1,4,32", help="comma-separated concurrency levels")
    p.add_argument("--slots", type=int, default=None, help="service slots (default: CPU cores)")
    p.add_argument(
        "--workloads", default="", help="comma-separated words: only matching workloads (e.g. trivial)"
    )
    p.add_argument("--rss-calls", type=int, default=5000, help="calls between the RSS readings (0: skip)")
    a = p.parse_args()
    main(
        calls=a.calls,
        levels=[int(c) for c in a.concurrency.split(",")],
        slots=a.slots,
        rss_calls=a.rss_calls,
        workloads=[w for w in a.workloads.split(",") if w],
    )
