"""The colocated hand-over of one RL step under torchrun (gloo): rank 0 holds the engines (engine i
shares rank i's device), every rank its learner; rank 1 moves its memory slowly. Writes each rank's
events (who, what, start, end) to OUT.RANK.

torchrun --nproc_per_node=2 tests/runtime/lending_worker.py OUT
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).parent))

from lending import Device, Events, RecordingEngine, RecordingLearner, engine_weights


def main(out: str) -> None:
    from tirl.distributed.groups import init_distributed, shutdown_distributed
    from tirl.engines.base import SingleEnginePool
    from tirl.rl.trainer import Run, TrainerState, rl_step
    from tirl.runtime.base import Runtime
    from tirl.runtime.config import ClusterConfig

    info = init_distributed("cpu")
    events = Events()
    learner = RecordingLearner(
        f"rank{info.rank}", Device(f"cuda:{info.rank}", 100), events, delay=0.4 * info.rank
    )
    runtime = None
    if info.is_main:
        engines = [
            RecordingEngine(f"engine{i}", Device(f"cuda:{i}", 100), engine_weights(), events)
            for i in range(info.world_size)
        ]
        runtime = Runtime(engines, SingleEnginePool(engines[0]), executor=None, scorer=None, tokenizer=None)
    cfg = SimpleNamespace(
        algorithm=SimpleNamespace(async_=False),
        cluster=ClusterConfig(),
    )
    # the update half of the step on every rank (the rollout half is rank 0's alone)
    half = SimpleNamespace(is_main=False, enabled=True, rank=info.rank, world_size=info.world_size)
    run = Run(cfg, half, learner, runtime, TrainerState(), logger=None, alerts=None)
    asyncio.run(rl_step(run, None))
    Path(f"{out}.{info.rank}").write_text(json.dumps(events.rows))
    shutdown_distributed(synchronize=True)


if __name__ == "__main__":
    main(sys.argv[1])
