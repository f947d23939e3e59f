"""tirl.distributed: torch.distributed process groups (FSDP2 sharding, collectives, full state dicts) and
the bucketed weight transfer from trainer ranks to engines. A leaf layer: it imports no RL, engine or
runtime code, so the learners (tirl.rl) and the Ray runtime (tirl.runtime.ray) both build on it."""
