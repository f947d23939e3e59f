"""The trainer -> engine weight sync: bucket planning (whole layer groups, the engine's dtype; the
plan of a meta-device Qwen3-14B), and the transfer over a persistent gloo group (the NCCL code path
with gloo standing in) reused across syncs and shut down at the end. On real vLLM-CPU engines:
tests/engines/test_vllm.py; across Ray nodes: tests/runtime/test_ray.py."""

from __future__ import annotations

import threading

import pytest
import torch

from tirl.distributed.weight_sync import (
    ALIGN,
    Entry,
    SyncChannel,
    SyncGroup,
    free_port,
    layer_group,
    plan_buckets,
    plan_entries,
    receive_into,
    send_weights,
)
from tirl.rl.plan import architecture_config


def test_buckets_keep_order_stay_within_the_bound_and_give_big_tensors_their_own():
    entries = [
        Entry("a", (96,), "torch.float32"),  # 384 B
        Entry("b", (64,), "torch.bfloat16"),  # 128 B
        Entry("c", (1000,), "torch.float32"),  # 4000 B: larger than a bucket
        Entry("d", (16,), "torch.float32"),  # 64 B
        Entry("e", (), "torch.float32"),  # a scalar: 4 B, one aligned slot
    ]
    buckets = plan_buckets(entries, bucket_bytes=512)
    assert [[e.name for e in b] for b in buckets] == [["a", "b"], ["c"], ["d", "e"]]
    assert [sum(e.slot for e in b) for b in buckets] == [512, 4032, 128]
    assert all(e.slot % ALIGN == 0 for e in entries)


def test_a_layer_is_never_split_even_when_it_exceeds_a_bucket():
    layer = [
        Entry(f"model.layers.0.mlp.{p}_proj.weight", (64, 64), "torch.bfloat16")
        for p in "gate up down".split()
    ]
    rest = [
        Entry("model.norm.weight", (64,), "torch.bfloat16"),
        Entry("lm_head.weight", (8, 64), "torch.bfloat16"),
    ]
    buckets = plan_buckets(layer + rest, bucket_bytes=8192)  # one projection (8 KiB) fills a bucket
    assert [len(b) for b in buckets] == [3, 2]  # the layer whole; norm + head share the next
    assert layer_group("model.layers.12.self_attn.q_proj.weight") == "model.layers.12"
    assert layer_group("model.embed_tokens.weight") == "model.embed_tokens"


def _qwen3_14b_on_meta() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(architecture_config("qwen3-14b"), dtype=torch.bfloat16)


def test_qwen3_14b_plan_keeps_merged_groups_whole_and_moves_two_bytes_per_parameter():
    model = _qwen3_14b_on_meta()
    n_params = sum(p.numel() for p in model.parameters())
    assert 14.0e9 < n_params < 15.5e9  # Qwen3-14B: 14.8 B parameters
    entries = plan_entries(model, torch.bfloat16)
    bucket_bytes = 512 * 2**20
    buckets = plan_buckets(entries, bucket_bytes)
    assert sum(e.nbytes for b in buckets for e in b) == 2 * n_params  # bf16: 2 bytes per parameter
    # Every layer group (a decoder layer: q/k/v, gate/up, ...) lies in exactly one bucket.
    where: dict[str, set[int]] = {}
    for i, bucket in enumerate(buckets):
        for e in bucket:
            where.setdefault(layer_group(e.name), set()).add(i)
    assert all(len(ids) == 1 for ids in where.values())
    assert sum(g.startswith("model.layers.") for g in where) == 40
    # A 14B decoder layer (~0.62 GiB in bf16) exceeds 512 MiB and gets a bucket of its own; no bucket
    # holds more than one group unless the groups fit the bound together.
    for bucket in buckets:
        groups = {layer_group(e.name) for e in bucket}
        assert len(groups) == 1 or sum(e.slot for e in bucket) <= bucket_bytes
    assert len(buckets) <= 43  # 40 layers + embedding + norm/head


class _Toy(torch.nn.Module):
    """Two 'decoder layers' with merged-style projections, an embedding and a head (fp32, as trained)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(32, 16)
        self.layers = torch.nn.ModuleList(
            torch.nn.ModuleDict({"gate_proj": torch.nn.Linear(16, 24), "up_proj": torch.nn.Linear(16, 24)})
            for _ in range(2)
        )
        self.lm_head = torch.nn.Linear(16, 32, bias=False)


def _sync_pair(group: SyncGroup) -> tuple[SyncChannel, SyncChannel]:
    """Both ends of a 2-member group, joined at once (the rendezvous waits for all members)."""
    out: dict[int, SyncChannel] = {}
    threads = [threading.Thread(target=lambda r=r: out.__setitem__(r, SyncChannel(group, r))) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out[0], out[1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_group_carries_several_syncs_in_the_engine_dtype_and_shuts_down(dtype):
    torch.manual_seed(0)
    model = _Toy()
    group = SyncGroup("127.0.0.1", free_port(), 2, "gloo", timeout_s=60)
    source, sink = _sync_pair(group)
    loads: list[list[tuple[str, torch.Tensor]]] = []
    try:
        for _ in range(2):  # the same group, two syncs
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p))
            got: dict[str, int] = {}

            def receive(got: dict[str, int] = got) -> None:
                got["bytes"] = receive_into(sink.pg, loads.append, torch.device("cpu"))

            receiver = threading.Thread(target=receive)
            receiver.start()
            stats = send_weights(model, source.pg, bucket_bytes=1024, device=torch.device("cpu"), dtype=dtype)
            receiver.join()
            params = dict(model.named_parameters())
            [pairs] = loads[-1:]  # all buckets of one sync arrive as ONE load
            assert [n for n, _ in pairs] == list(params)
            for name, tensor in pairs:
                assert tensor.dtype == dtype
                torch.testing.assert_close(tensor, params[name].detach().to(dtype), rtol=0, atol=0)
            n = sum(p.numel() for p in model.parameters())
            assert got["bytes"] == n * dtype.itemsize and stats["sync/buckets"] > 1
            assert stats["sync/bytes"] >= n * dtype.itemsize  # plus alignment padding per tensor
    finally:
        source.close()
        sink.close()
    assert len(loads) == 2 and source.pg is None and sink.pg is None
    source.close()  # closing twice is harmless
