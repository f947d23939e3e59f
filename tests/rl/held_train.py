"""`tirl train` with one rollout group of the first stage held back until it is stale, for the killed-run
resume tests of test_async_trainer.py: the second member of draw DRAW's first attempt waits forever (its
first member runs, so the group's turns start at that policy version), until the trainer is more than
k versions ahead and drops the group, re-queueing its prompt. The drop is made by construction, never by
timing; its retry is not held.

python tests/rl/held_train.py DRAW TIRL_ARGS...
"""

from __future__ import annotations

import asyncio
import sys

from tirl.cli import main
from tirl.rl.async_rollout import Draw, GroupProducer

HELD = int(sys.argv.pop(1))
_one = GroupProducer._one


async def _held_one(self: GroupProducer, pool, problem, draw: Draw, j: int, seed: int):
    if self.first_step == 0 and draw.index == HELD and not draw.retry and j == 1:
        await asyncio.Future()  # cancelled when the stale group is dropped
    return await _one(self, pool, problem, draw, j, seed)


GroupProducer._one = _held_one

if __name__ == "__main__":
    main()
