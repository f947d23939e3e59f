"""Bucket planning of the trainer -> engine weight sync (the transfer itself runs in test_ray.py)."""

from __future__ import annotations

from tirl.distributed.weight_sync import Entry, plan_buckets


def test_buckets_keep_order_stay_within_the_bound_and_give_big_tensors_their_own():
    entries = [
        Entry("a", (100,), "torch.float32"),  # 400 B
        Entry("b", (50,), "torch.bfloat16"),  # 100 B
        Entry("c", (1000,), "torch.float32"),  # 4000 B: larger than a bucket
        Entry("d", (25,), "torch.float32"),  # 100 B
        Entry("e", (), "torch.float32"),  # a scalar: 4 B
    ]
    buckets = plan_buckets(entries, bucket_bytes=512)
    assert [[e.name for e in b] for b in buckets] == [["a", "b"], ["c"], ["d", "e"]]
    assert [sum(e.nbytes for e in b) for b in buckets] == [500, 4000, 104]
