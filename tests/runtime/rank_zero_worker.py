"""Rank 0's slow start under torchrun (gloo) with a 2 s collective timeout: `model` is a LoRA adapter,
merged (slowly) on rank 0 only while rank 1 waits at rank 0's gate, then rank 0 reads the merged model
(slowly, as from slow storage) while rank 1 waits again before the broadcast of the weights. Writes
each rank's merges and the sum of its parameter shards to OUT.RANK.

torchrun --nproc_per_node=2 tests/runtime/rank_zero_worker.py ADAPTER OUT
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

SLOW_S = 5.0  # rank 0's merge and its read of the model each take this long: past the timeout


def main(adapter: str, out: str) -> None:
    os.environ["TIRL_COLLECTIVE_TIMEOUT_S"] = "2"
    import torch

    import tirl.rl.lora as lora
    import tirl.rl.policy as policy_module
    from tirl.distributed.groups import all_reduce, init_distributed, shutdown_distributed
    from tirl.rl.config import OptimConfig
    from tirl.rl.trainer import model_paths

    info = init_distributed("cpu")
    merges: list[int] = []
    merge, load = lora.merge_adapter, policy_module._load_full_model

    def slow_merge(*args, **kwargs):
        merges.append(info.rank)
        time.sleep(SLOW_S)
        return merge(*args, **kwargs)

    def slow_load(path: str):
        time.sleep(SLOW_S)
        return load(path)

    lora.merge_adapter, policy_module._load_full_model = slow_merge, slow_load
    cfg = SimpleNamespace(model=adapter, optim=SimpleNamespace(lora=SimpleNamespace(enabled=False)))
    policy_path, _ = model_paths(cfg, None, info)
    policy = policy_module.Policy(policy_path, OptimConfig(device="cpu"), info, total_steps=1)
    local = sum(float(p.to_local().double().sum()) for p in policy.model.parameters())
    [total] = all_reduce([local], info)
    Path(f"{out}.{info.rank}").write_text(json.dumps({"merges": merges, "sum": total, "path": policy_path}))
    del torch
    shutdown_distributed(synchronize=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
