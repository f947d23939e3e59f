"""The flat buffer an in-process vLLM engine's worker maps (tirl.engines.vllm): one copy in, views out,
every view aligned whatever the mix of dtypes and sizes; and the space check before writing it."""

from __future__ import annotations

import shutil

import pytest
import torch

from tirl.engines.handoff import ALIGN, check_space, pack_flat, unpack_flat
from tirl.engines.vllm import flat_plan


def test_pack_casts_to_the_engine_dtype_and_unpack_gives_aligned_views():
    torch.manual_seed(0)
    tensors = [
        ("a", torch.randn(3, 5)),  # odd sizes: the next view must still start aligned
        ("b", torch.randn(7)),
        ("scalar", torch.tensor(2.5)),
        ("ids", torch.arange(5, dtype=torch.int64)),  # not floating: travels as is
    ]
    plan, nbytes = flat_plan(tensors, torch.bfloat16)
    assert all(offset % ALIGN == 0 for *_, offset in plan) and nbytes % ALIGN == 0
    buf = torch.empty(nbytes, dtype=torch.uint8)
    pack_flat(tensors, plan, buf)
    out = dict(unpack_flat(buf, plan))
    for name, t in tensors:
        want = t.to(torch.bfloat16) if t.dtype.is_floating_point else t
        assert out[name].dtype == want.dtype and out[name].shape == t.shape
        torch.testing.assert_close(out[name], want, rtol=0, atol=0)
        assert out[name].untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()  # a view


def test_a_transfer_that_cannot_fit_is_refused_before_writing(tmp_path, monkeypatch):
    usage = shutil.disk_usage(tmp_path)
    check_space(str(tmp_path), 1)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=2**30))
    with pytest.raises(OSError, match=r"needs 2\.00 GiB .* only 1\.00 GiB are free.*--shm-size"):
        check_space(str(tmp_path), 2 * 2**30)
