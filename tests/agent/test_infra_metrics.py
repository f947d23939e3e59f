"""The metrics see what really happens: a sandbox that fails fires the sandbox alert, and RoC never
trains on the trajectory it ended."""

from __future__ import annotations

import socket

import pytest
from tests.agent.conftest import CFG, SCRIPTS

from tirl.agent import run_trajectory
from tirl.rl.config import AlgorithmConfig, LoggingConfig
from tirl.rl.metrics import AlertMonitor, rollout_metrics
from tirl.rl.trainer import roc_select
from tirl.sandbox import SandboxClient

pytestmark = pytest.mark.asyncio(loop_scope="session")


def _dead_endpoint() -> str:
    """A loopback URL nothing listens on: every connection is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


async def test_a_dead_sandbox_fires_the_sandbox_alert(pool, tokenizer, sandbox, taught):
    problem = SCRIPTS["fix"].problem  # a malformed call, then a Python call, then the answer
    async with SandboxClient(_dead_endpoint(), retries=1, backoff_s=0.01) as dead:
        broken = await run_trajectory(pool, tokenizer, dead, problem, CFG, group="fix")
    fine = await run_trajectory(pool, tokenizer, sandbox, problem, CFG, group="fix", sample_index=1)
    assert broken.finish_reason == "error" and "sandbox_error" in broken.error
    assert [c.status for c in broken.tool_calls] == ["malformed", "sandbox_error"]
    assert [c.status for c in fine.tool_calls] == ["malformed", "ok"] and fine.finish_reason == "answered"
    fine.reward = 1.0

    group = [broken, fine]
    kept = [roc_select(group, AlgorithmConfig(group_size=2), seed=0)]
    assert kept == [[1]]  # the trajectory the sandbox ended is never trained on ...
    m = rollout_metrics([group], kept, no_tool_p_err=0.5)  # ... but the metrics see it
    assert (m["tools/calls"], m["rollout/errors"], m["finish/error"], m["roc/dropped"]) == (4, 1, 0.5, 0)
    assert m["tools/sandbox_failure_ratio"] == 0.25
    assert (
        m["tools/error_ratio"] == 0.5
    )  # the two malformed calls; the infrastructure failure is not the model's
    assert AlertMonitor(LoggingConfig(alert_min_calls=4)).check(m) == [
        "sandbox failure ratio 25.0%: check the sandbox service (tirl sandbox serve)"
    ]
    assert AlertMonitor(LoggingConfig(alert_min_calls=5)).check(m) == []  # 4 calls: too few to judge
