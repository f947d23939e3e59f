"""Where a command's CPU goes, by kind of process: runs it (default: the test suite as `make test` runs
it) while sampling every process on the machine every half second, then prints CPU-seconds per kind.

    .venv/bin/python benchmarks/suite_cpu.py [--json FILE] [-- COMMAND ...]

Samples with psutil, so a process shorter than the interval is missed and each one's last half second
too: the totals are a floor. A process alive at the start counts only what it used after it. Run it on
an otherwise idle machine: every process is counted, yours too (docs/development.md, "Where the suite's
CPU goes").
"""

from __future__ import annotations

import argparse
import json
import subprocess
import threading
from collections import Counter
from pathlib import Path

import psutil

DEFAULT = [".venv/bin/pytest", "-q", "-n", "3"]
# (kind, what a process's command line or name contains), first match wins.
KINDS = [
    ("pytest workers (in-process tests)", ("[pytest-xdist", "bin/pytest", "-m pytest")),
    ("sandbox zygotes and their forks", ("tirl.sandbox.zygote",)),
    ("Ray sandbox-node and reward actors", ("ray::SandboxNod", "ray::RewardWork")),
    ("Ray engine and trainer actors", ("ray::EngineWork", "ray::TrainerWor", "ray::Member")),
    ("Ray's own processes", ("ray::", "raylet", "gcs_server", "log_monitor", "dashboard")),
    ("vLLM engine cores and servers", ("EngineCor", "VLLM", "vllm.entrypoints")),
    ("math-verify reward workers", ("tirl.reward.worker",)),
    ("tirl commands", ("-m tirl.cli", "bin/tirl ")),
]


def kind(cmdline: str, name: str) -> str:
    for label, marks in KINDS:
        if any(m in cmdline[:200] or name.startswith(m) for m in marks):
            return label
    if any(arg.endswith(".py") for arg in cmdline.split()[:3]):
        return "python scripts"
    return "unnamed python (torchrun ranks, forked children)" if name.startswith("python") else name


class Sampler:
    """Each process's CPU-seconds (user + system) since the sampler started, keyed by pid and start time."""

    def __init__(self, interval: float = 0.5):
        self.interval = interval
        self.seen: dict[str, tuple[str, str, float]] = {}  # key -> (cmdline, name, cpu since start)
        self._base: dict[str, float] = {}
        self._stop = threading.Event()
        self._sample(first=True)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self, first: bool = False) -> None:
        for p in psutil.process_iter(["pid", "cmdline", "name", "cpu_times", "create_time"]):
            info = p.info
            if info["cpu_times"] is None:  # gone, or not ours to read
                continue
            key = f"{info['pid']}-{info['create_time']}"
            cpu = info["cpu_times"].user + info["cpu_times"].system
            if first:
                self._base[key] = cpu
            used = cpu - self._base.get(key, 0.0)
            cmdline = " ".join(info["cmdline"] or [])
            if key not in self.seen or used >= self.seen[key][2]:
                self.seen[key] = (cmdline, info["name"] or "", used)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def by_kind(self) -> tuple[Counter, Counter]:
        cpu, count = Counter(), Counter()
        for cmdline, name, used in self.seen.values():
            k = kind(cmdline, name)
            cpu[k] += used
            count[k] += 1
        return cpu, count


def table(cpu: Counter, count: Counter, rows: int = 14) -> str:
    total = sum(cpu.values()) or 1.0
    lines = [f"{'CPU s':>8} {'share':>6} {'count':>6}  kind"]
    for k, v in cpu.most_common(rows):
        lines.append(f"{v:8.0f} {100 * v / total:5.1f}% {count[k]:6d}  {k}")
    lines.append(f"{total:8.0f} in all ({sum(count.values())} processes)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write every process's (cmdline, name, CPU s)")
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("command", nargs="*", help="what to run (after --); default: the suite")
    args = parser.parse_args(argv)
    sampler = Sampler(args.interval)
    try:
        code = subprocess.run(args.command or DEFAULT).returncode
    finally:
        sampler.stop()
    print(table(*sampler.by_kind()))
    if args.json:
        args.json.write_text(json.dumps(sampler.seen))
    return code


if __name__ == "__main__":
    from tirl.lifetime import children_die_with_me

    children_die_with_me()  # what the command started dies with it, even on kill -9
    raise SystemExit(main())
