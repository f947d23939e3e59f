"""One policy update (`grpo_update`): old log-probs, then one optimizer step per mini-batch on the
configured objective (tirl.rl.losses.Objective: policy loss, aggregation, dual clip, KL, entropy), with
its diagnostics reduced over the ranks. Every learner (local, torchrun, Ray trainer workers) runs it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tirl.distributed.groups import DistInfo, all_reduce
from tirl.rl.config import AlgorithmConfig
from tirl.rl.losses import BatchCounts, Diagnostics, Objective
from tirl.rl.policy import Policy, TrainSample


def shard_samples(samples: list[TrainSample], info: DistInfo) -> list[TrainSample]:
    """This rank's share: round-robin over samples sorted by length (balanced token counts)."""
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i].input_ids))
    return [samples[i] for i in order[info.rank :: info.world_size]]


@dataclass(frozen=True)
class Shard:
    """One rank's share of a step's batch: its part of every mini-batch (`shard_samples`), and the
    number of sequences in the whole batch (a metric). What a Ray trainer worker is sent."""

    minis: list[list[TrainSample]]
    sequences: int


def shard_update(samples: list[TrainSample], alg: AlgorithmConfig, info: DistInfo) -> Shard:
    """Rank `info.rank`'s share of the whole step's batch `samples`: the same split on every rank."""
    n_mini = alg.mini_batches
    return Shard([shard_samples(samples[m::n_mini], info) for m in range(n_mini)], len(samples))


def engine_gap(sample: TrainSample) -> float:
    """Sum over trained tokens of |engine log-prob - trainer log-prob| (needs old_logprobs)."""
    if sample.engine_logprobs is None or sample.old_logprobs is None:
        return 0.0
    gap = (sample.old_logprobs - torch.tensor(sample.engine_logprobs)).abs()
    return float(gap[torch.tensor(sample.loss_mask, dtype=torch.bool)].sum())


def grpo_update(policy: Policy, samples: list[TrainSample] | Shard, alg: AlgorithmConfig) -> dict:
    """Recompute old log-probs, then one optimizer update per mini-batch on the configured objective
    (tirl.rl.losses.Objective: policy loss, aggregation, KL, entropy), with its diagnostics.

    `samples` is the whole step's batch (the same on every rank), or this rank's `Shard` of it (split
    where the batch is, as a Ray driver does); each rank trains on its share of every mini-batch, so
    the split into mini-batches does not depend on the number of ranks.
    """
    info = policy.info
    objective = Objective.from_config(alg)
    shard = samples if isinstance(samples, Shard) else shard_update(samples, alg, info)
    minis, n_mini = shard.minis, len(shard.minis)
    mine = [s for part in minis for s in part]
    policy.compute_logprobs(mine, "old_logprobs")
    if objective.needs_reference:
        policy.compute_logprobs(mine, "ref_logprobs", reference=True)
    diag = Diagnostics()
    loss_sum, grad_norms = 0.0, []
    for part in minis:
        tokens, seqs = all_reduce([sum(s.num_trained for s in part), len(part)], info)
        counts = BatchCounts(max(tokens, 1.0), max(seqs, 1.0), alg.loss_constant)

        def loss_fn(mb, counts=counts):
            ref = mb.stack("ref_logprobs") if objective.needs_reference else None
            loss, d = objective(mb.policy_inputs(), counts, entropy=mb.entropy, ref_logprobs=ref)
            diag.add(d)
            return loss

        loss_sum += policy.accumulate(part, loss_fn, with_entropy=True)
        grad_norms.append(policy.step())
    keys = sorted(diag.sums)
    trained = sum(s.num_trained for s in mine)
    gap = sum(engine_gap(s) for s in mine)
    reduced = all_reduce([loss_sum, trained, gap, *(diag.sums[k] for k in keys)], info)
    loss_sum, trained, gap = reduced[:3]
    diag.sums = dict(zip(keys, reduced[3:], strict=True))
    max_keys = sorted(diag.maxes)
    diag.maxes = dict(
        zip(max_keys, all_reduce([diag.maxes[k] for k in max_keys], info, op="max"), strict=True)
    )
    per_token = max(trained, 1.0)  # mini-batches partition the samples: each token is trained once
    return diag.per_token(trained) | {
        "train/loss": loss_sum / n_mini,
        "train/grad_norm": float(np.mean(grad_norms)),
        "train/trained_tokens": int(trained),
        "train/sequences": shard.sequences,
        # Mean |engine - trainer| log-prob of the sampled tokens: ~0 when weight sync works (numeric noise
        # only); a gap that grows over steps means the engines sample from stale weights. The engine
        # reports log-probs at the sampling temperature, so the gap is only ~0 at temperature 1.
        "train/engine_logprob_gap": gap / per_token,
    }
