"""benchmarks/suite_cpu.py counts a command's processes by kind, with the CPU each used."""

from __future__ import annotations

import json
import sys

import suite_cpu

BUSY = "import time\nend = time.process_time() + 1.0\nwhile time.process_time() < end: pass"


def test_a_busy_child_is_counted_with_its_cpu(tmp_path, capsys):
    out = tmp_path / "seen.json"
    script = tmp_path / "busy.py"
    script.write_text(BUSY)
    assert suite_cpu.main(["--json", str(out), "--", sys.executable, str(script)]) == 0
    seen = json.loads(out.read_text())
    [(cmdline, name, cpu)] = [v for v in seen.values() if str(script) in v[0]]
    assert 0.5 <= cpu <= 3.0  # its one second of CPU, less the unsampled tail
    assert suite_cpu.kind(cmdline, name) == "python scripts"
    assert "python scripts" in capsys.readouterr().out


def test_kinds_by_command_line():
    assert (
        suite_cpu.kind("/x/.venv/bin/python -m tirl.sandbox.zygote", "python")
        == "sandbox zygotes and their forks"
    )
    assert (
        suite_cpu.kind("ray::SandboxNode.ensure", "ray::SandboxNod") == "Ray sandbox-node and reward actors"
    )
    assert suite_cpu.kind("", "VLLM::EngineCor") == "vLLM engine cores and servers"
    assert suite_cpu.kind(
        "/r/.pyenv/bin/python -m tirl.cli train --config /tmp/pytest-of-root/a.yaml", "python"
    ) == ("tirl commands")
    assert (
        suite_cpu.kind("[pytest-xdist running] tests/x.py", "python") == "pytest workers (in-process tests)"
    )
    assert suite_cpu.kind("python", "python") == "unnamed python (torchrun ranks, forked children)"
