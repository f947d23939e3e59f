"""RewardPool: real worker processes, real math-verify, real timeouts and kills."""

import asyncio
import time

import pytest

from tirl.reward import RewardConfig, RewardPool, score

# sympy grinds on this tower of powers for minutes (verified manually); it never answers in time.
HANG = "\\boxed{10^{10^{10}}}"


async def test_batch_keeps_order_and_matches_in_process_score():
    pairs = [
        ("<answer>\\boxed{\\frac{1}{2}}</answer>", "0.5"),
        ("<answer>\\boxed{025}</answer>", "25"),
        ("<answer>\\boxed{3}</answer>", "\\frac{6}{2}"),
        ("<answer>\\boxed{4}</answer>", "\\frac{6}{2}"),
        ("no answer", "1"),
        ("<answer>\\boxed{2\\sqrt{2}}</answer>", "\\sqrt{8}"),
        ("<answer>\\boxed{\\sqrt{2}}</answer>", "\\sqrt{8}"),
    ] * 5
    async with RewardPool(RewardConfig(workers=2, timeout=10)) as pool:
        rewards = await pool.score_many(pairs)
    assert rewards == [score(r, ref) for r, ref in pairs]
    assert rewards[:7] == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    stats = pool.stats
    assert (stats.responses, stats.no_answer, stats.fast, stats.verified) == (35, 5, 5, 25)
    assert stats.timeouts == stats.killed == stats.errors == 0


async def test_soft_timeout_scores_zero_and_keeps_the_worker():
    async with RewardPool(RewardConfig(workers=1, timeout=1.0)) as pool:
        pid = next(iter(pool._workers)).process.pid
        assert await pool.score_many([(HANG, "1"), ("\\boxed{\\frac{4}{2}}", "2")]) == [0.0, 1.0]
        assert (pool.stats.timeouts, pool.stats.killed) == (1, 0)
        assert next(iter(pool._workers)).process.pid == pid


async def test_hung_worker_is_killed_and_replaced():
    # Without the in-worker deadline the verification really hangs: only the hard kill ends it.
    cfg = RewardConfig(workers=2, timeout=1.0, soft_timeout=False)
    async with RewardPool(cfg) as pool:
        before = {w.process.pid for w in pool._workers}
        pairs = [(HANG, "1"), ("\\boxed{0.25}", "\\frac14"), (HANG, "2"), ("\\boxed{\\sqrt{4}}", "2")]
        assert await pool.score_many(pairs) == [0.0, 1.0, 0.0, 1.0]
        assert (pool.stats.timeouts, pool.stats.killed) == (2, 2)
        # Replacements come up in the background and serve further calls.
        deadline = time.monotonic() + 240  # a fresh worker imports sympy + math-verify: slow when loaded
        while pool._idle.qsize() < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        after = {w.process.pid for w in pool._workers}
        assert len(after) == 2 and not after & before
        assert await pool.score("\\boxed{\\frac{1}{3}}", "1/3") == 1.0


async def test_close_kills_workers():
    pool = RewardPool(RewardConfig(workers=1))
    assert await pool.score("\\boxed{\\frac{1}{2}}", "0.5") == 1.0  # starts lazily
    processes = [w.process for w in pool._workers]
    await pool.close()
    assert all(p.returncode is not None for p in processes)
    with pytest.raises(RuntimeError, match="closed"):
        await pool.equivalent("\\pi", "\\pi")


async def test_truncated_or_failed_trajectories_keep_reward_zero():
    from tirl.agent.trajectory import Trajectory
    from tirl.runtime import score_trajectory

    text = "<answer>\\boxed{\\frac{1}{2}}</answer>"
    async with RewardPool(RewardConfig(workers=1)) as pool:
        for finish, reward in [("answered", 1.0), ("max_turns", 1.0), ("length", 0.0), ("error", 0.0)]:
            traj = Trajectory(problem_id="p", prompt_ids=[1], model_turns=[text], finish_reason=finish)
            assert await score_trajectory(pool, traj, "0.5") == reward
