"""Two torchrun ranks (gloo) with a 4 s collective timeout: rank 0 waits 6 s before broadcasting (a
rollout: the others must wait it out), then rank 0 syncs weights while rank 1 never joins (a rank that
died or hangs). Rank 0 writes what happened to OUT.

torchrun --nproc_per_node=2 tests/runtime/stuck_sync_worker.py MODEL_DIR OUT
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

TIMEOUT_S = 4


def main(model_dir: str, out: str) -> None:
    os.environ["TIRL_COLLECTIVE_TIMEOUT_S"] = str(TIMEOUT_S)
    from tirl.distributed.groups import broadcast_object, init_distributed
    from tirl.rl.config import OptimConfig
    from tirl.rl.local_learner import LocalLearner
    from tirl.rl.policy import Policy
    from tirl.runtime.handoff import InProcess

    info = init_distributed("cpu")
    learner = LocalLearner(Policy(model_dir, OptimConfig(device="cpu"), info, total_steps=1))
    if info.is_main:
        time.sleep(TIMEOUT_S + 2)  # a rollout longer than the collective timeout
    waited = broadcast_object("samples", info)
    result: dict[str, object] = {"waited": waited}
    if info.is_main:
        start = time.monotonic()
        try:
            InProcess(None, learner, info).send()  # rank 0 without engines: its gathers alone
            result["error"] = None
        except Exception as e:
            result["error"] = f"{type(e).__name__}: {e}"
        result["seconds"] = time.monotonic() - start
        Path(out).write_text(json.dumps(result))
    else:  # never joins the sync; leaves once rank 0 has its answer (or after a minute)
        deadline = time.monotonic() + 60
        while not Path(out).exists() and time.monotonic() < deadline:
            time.sleep(0.2)
    os._exit(0)  # rank 0's group is broken: no clean shutdown to wait for


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
