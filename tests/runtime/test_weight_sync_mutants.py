"""The weight sync's plan, exactly (tirl.distributed.weight_sync: entries, slots, layer groups,
buckets): what travels in which dtype, each entry's aligned room, which names form one unsplittable
group, and how buckets fill up to exactly their bound; see docs/mutation.md."""

from __future__ import annotations

import pytest
import torch

from tirl.distributed.weight_sync import (
    ALIGN,
    Entry,
    Lazy,
    SyncGroup,
    _full,
    _pack,
    layer_group,
    plan_buckets,
    plan_entries,
)


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


def test_full_makes_a_lazy_tensor_gathers_a_shard_and_passes_a_plain_tensor():
    t = torch.arange(3.0)

    class Shard:  # a DTensor's stand-in: full_tensor() is the all-gather
        def full_tensor(self):
            return t + 1

    assert _full(t) is t
    assert torch.equal(_full(Lazy((3,), torch.float32, lambda: t * 2)), t * 2)
    assert torch.equal(_full(Shard()), t + 1)


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
