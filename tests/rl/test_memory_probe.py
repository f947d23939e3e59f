"""The training measurement (tirl.rl.memory_probe) on a model small enough to measure in a fraction of a
second: what it must hold between steps, counted by hand from the parameters (one process and two FSDP2
ranks, LoRA on and off), how its peak moves with the micro-batch, checkpointing and the padding mask,
and its guards. test_plan.py and test_plan_shapes.py check the same measurement on real architectures."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from tirl.rl import memory_probe
from tirl.rl.memory_probe import measure_training, measured
from tirl.rl.plan import Workload, meta_model
from tirl.rl.planner import default_lora
from tirl.tiny_model import PRESETS

# tirl's tiny model at 2 layers, its head untied (the tied case: test_a_fake_model_keeps_tied_parameters_one_object)
CONFIG = Qwen3Config(**PRESETS["tiny"] | {"num_hidden_layers": 2, "tie_word_embeddings": False})
FP32 = 4


def _parameters(lora: bool = False) -> tuple[int, int, int]:
    """(all parameters, trained ones, trained tensors) of CONFIG's model built for real, with the demo's
    LoRA or not."""
    model = AutoModelForCausalLM.from_config(CONFIG)
    if lora:
        from tirl.rl.config import LoraConfig
        from tirl.rl.lora import apply_lora

        apply_lora(model, LoraConfig(**default_lora()))
    trained = [p for p in model.parameters() if p.requires_grad]
    return sum(p.numel() for p in model.parameters()), sum(p.numel() for p in trained), len(trained)


@pytest.mark.parametrize("world", [1, 2])
def test_what_a_rank_holds_between_steps_is_its_shard_of_the_weights_and_two_moments(world):
    """fp32 weights and AdamW's two fp32 moments, the rank's 1/world of each; the optimizer's count is the
    whole model's; the categories are FSDP's names on both paths, the optimizer state two moments (and
    a step count per tensor, not sharded)."""
    total, trained, tensors = _parameters()
    assert total == trained
    m = measure_training(CONFIG, world, Workload((2, 64)))
    assert m.resident == 3 * total * FP32 // world and m.trainable == total
    assert m.by_category["OptState"] == 2 * total * FP32 // world + tensors * FP32
    assert m.parameter_bytes == total * FP32 // world
    assert {"Sharded Param", "Sharded Grad", "OptState"} <= set(
        m.by_category
    ) and "Total" not in m.by_category
    assert m.peak >= m.resident + m.by_category["Sharded Grad"]


@pytest.mark.parametrize("world", [2, 3])
def test_rank_0_holds_the_larger_shard_when_rows_do_not_divide(world):
    """FSDP2 gives rank 0 ceil(rows / world) of each parameter and the last rank the rest (the plan is
    rank 0's): a vocabulary of 1021 rows (a prime) splits unevenly over 2 and 3 ranks."""
    config = Qwen3Config(**(CONFIG.to_dict() | {"vocab_size": 1021}))
    model = AutoModelForCausalLM.from_config(config)
    rows = sum(
        math.ceil(p.shape[0] / world) * (p[0].numel() if p.dim() > 1 else 1) for p in model.parameters()
    )
    assert rows * world > sum(p.numel() for p in model.parameters())  # rank 0 holds more than its share
    m = measure_training(config, world, Workload((1, 64)))
    assert m.parameter_bytes == rows * FP32 and m.resident == 3 * rows * FP32


@pytest.mark.parametrize("world", [1, 2])
def test_with_lora_the_frozen_base_is_bf16_and_only_the_adapters_train(world):
    """The base in bf16 (it never trains: no fp32 master copy, no moments), the adapters in fp32 with
    their two moments; the optimizer counts the adapters alone."""
    total, trained, tensors = _parameters(lora=True)
    base = total - trained
    m = measure_training(CONFIG, world, Workload((2, 64), lora=default_lora()))
    assert 0 < trained < base and m.trainable == trained
    assert m.resident == (base * 2 + trained * FP32 * 3) // world
    assert m.by_category["OptState"] == 2 * trained * FP32 // world + tensors * FP32


def test_the_peak_grows_with_the_micro_batch_and_falls_with_checkpointing():
    one = measure_training(CONFIG, 1, Workload((1, 256)))
    two = measure_training(CONFIG, 1, Workload((2, 256)))
    longer = measure_training(CONFIG, 1, Workload((1, 512)))
    unchecked = measure_training(CONFIG, 1, Workload((2, 256), gradient_checkpointing=False))
    assert one.peak < two.peak < unchecked.peak and one.peak < longer.peak
    assert one.resident == two.resident == longer.resident == unchecked.resident
    # bf16 autocast's activations are half fp32's: compared where they set the peak (all kept, 2 x 1024);
    # at 2 x 256 the head's fp32 weight-gradient buffer sets it, the same in both
    kept = Workload((2, 1024), gradient_checkpointing=False)
    fp32_kept = Workload((2, 1024), bf16=False, gradient_checkpointing=False)
    bf16, fp32 = (measure_training(CONFIG, 1, w) for w in (kept, fp32_kept))
    assert bf16.peak < fp32.peak and bf16.resident == fp32.resident == one.resident


def test_kv_heads_are_repeated_before_the_kernel(monkeypatch):
    """As transformers does before SDPA on the GPU (GQA: 4 query heads, 2 KV heads), the repeated K and V
    are kept for backward: without the repeat the peak falls by exactly the two extra heads of K and V
    in both layers (no checkpointing, fp32)."""
    import transformers.integrations.sdpa_attention as sdpa

    workload = Workload((1, 1024), bf16=False, gradient_checkpointing=False)
    repeated = measure_training(CONFIG, 1, workload)
    monkeypatch.setattr(sdpa, "repeat_kv", lambda x, groups: x)
    unrepeated = measure_training(CONFIG, 1, workload)
    extra = CONFIG.num_attention_heads - CONFIG.num_key_value_heads
    assert repeated.peak - unrepeated.peak == 2 * 2 * extra * 1024 * CONFIG.head_dim * FP32


@pytest.mark.parametrize(
    ("world", "bf16", "element_bytes"),
    # one process computes under autocast with fp32 weights: Qwen3's query norm returns fp32; FSDP's
    # bf16 mixed precision gives a bf16 query, so a bf16 bias
    [(1, False, 4), (1, True, 4), (2, False, 4), (2, True, 2)],
)
def test_the_padding_masks_bias_is_kept_for_backward(monkeypatch, world, bf16, element_bytes):
    """The planned attention keeps a [B, 1, T, T] bias in the query's dtype until backward (the GPU's
    memory-efficient kernel does): without it (and without checkpointing, which frees it) the peak falls
    by exactly the two layers' biases."""
    workload = Workload((1, 1024), bf16=bf16, gradient_checkpointing=False)
    kept = measure_training(CONFIG, world, workload)

    class Dropped(torch.autograd.Function):
        @staticmethod
        def forward(ctx, out, bias):
            return out.view_as(out)

        @staticmethod
        def backward(ctx, grad):
            return grad, None

    monkeypatch.setattr(memory_probe, "_KeepForBackward", Dropped)
    dropped = measure_training(CONFIG, world, workload)
    assert kept.peak - dropped.peak == 2 * 1024 * 1024 * element_bytes


def test_fsdp_gathers_bf16_parameters_under_mixed_precision():
    """On two ranks the gathered (unsharded) parameters are the compute dtype's: bf16 halves them."""
    bf16 = measure_training(CONFIG, 2, Workload((2, 256)))
    fp32 = measure_training(CONFIG, 2, Workload((2, 256), bf16=False))
    assert 2 * bf16.by_category["Unsharded Param"] == fp32.by_category["Unsharded Param"] > 0
    assert bf16.resident == fp32.resident and bf16.peak < fp32.peak


def test_fp32_ranks_compute_in_fp32_as_one_process_does():
    """FSDP's ranks run without autocast (bf16 comes from mixed precision): in fp32, two ranks hold the
    activations one fp32 process holds for the same micro-batch (no checkpointing)."""
    workload = Workload((2, 256), bf16=False, gradient_checkpointing=False)
    one, two = measure_training(CONFIG, 1, workload), measure_training(CONFIG, 2, workload)
    assert one.by_category["Activation"] == two.by_category["Activation"] > 0


def test_two_ranks_track_the_token_ids_and_keep_fsdps_view_warning_quiet():
    """The token head's outputs are views FSDP2 warns about (nothing modifies them in place): a plan
    prints none of those warnings. The micro-batch's int64 token ids are tracked as the inputs."""
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        m = measure_training(CONFIG, 2, Workload((2, 256)))
    assert not [w for w in seen if "returned a view tensor" in str(w.message)]
    assert m.by_category["Inputs"] == 2 * 256 * 8


def test_one_process_tracks_the_frozen_base_and_the_token_ids():
    """One process's tracker is told what the optimizer does not hold: a LoRA model's frozen bf16 base
    (among the parameters, beside the fp32 adapters) and the micro-batch's int64 token ids (MemTracker
    files them under "Other": it has no inputs category)."""
    total, trained, _ = _parameters(lora=True)
    m = measure_training(CONFIG, 1, Workload((2, 64), lora=default_lora()))
    assert m.by_category["Sharded Param"] == (total - trained) * 2 + trained * FP32
    assert m.by_category["Other"] == 2 * 64 * 8


def test_measured_measures_each_setting_once():
    first = measured(CONFIG, 1, Workload((1, 64)))
    assert measured(CONFIG, 1, Workload((1, 64))) is first
    assert measured(CONFIG, 2, Workload((1, 64))) is not first
    assert measured(CONFIG, 1, Workload((1, 128))) is not first
    wider = Qwen3Config(**(CONFIG.to_dict() | {"intermediate_size": 2 * CONFIG.intermediate_size}))
    assert measured(wider, 1, Workload((1, 64))).resident > first.resident


def test_a_world_without_gpus_or_inside_a_process_group_is_refused():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    with pytest.raises(ValueError, match="a plan needs at least one GPU, got 0"):
        measure_training(CONFIG, 0, Workload((1, 64)))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(RuntimeError, match=r"^measure_training needs a process without a process group"):
            measure_training(CONFIG, 2, Workload((1, 64)))
    finally:
        dist.destroy_process_group()
    assert measure_training(CONFIG, 2, Workload((1, 64))).trainable  # and the group is gone after


def test_categories_and_local_bytes():
    from enum import Enum

    from torch.distributed.device_mesh import init_device_mesh  # noqa: F401 (DTensor needs it loaded)

    class Key(Enum):
        PARAM = "Parameter"
        GRAD = "Gradient"
        OPT = "Optstate"
        ACT = "Activation"

    assert [memory_probe._category(k) for k in Key] == [
        "Sharded Param",
        "Sharded Grad",
        "OptState",
        "Activation",
    ]
    assert memory_probe._category("Sharded Param") == "Sharded Param"
    assert memory_probe._local_bytes(torch.zeros(3, 5, dtype=torch.bfloat16)) == 30

    class Sharded:  # a DTensor's shape: its local shard is what the rank holds
        def to_local(self):
            return torch.zeros(2, 5)

    assert memory_probe._local_bytes(Sharded()) == 40


def test_the_steady_state_step_runs_with_the_moments_already_there():
    """The measured step is a later one: AdamW's moments exist before it, the gradients are gone after."""
    model = torch.nn.Linear(4, 3)
    optimizer, trainable = memory_probe._optimizer(model)
    assert trainable == list(model.parameters())
    assert all(set(optimizer.state[p]) >= {"exp_avg", "exp_avg_sq"} for p in trainable)
    assert all(p.grad is None for p in trainable) and optimizer.defaults["foreach"] is True
    model.weight.requires_grad_(False)
    assert memory_probe._optimizer(model)[1] == [model.bias]


def test_a_fake_model_keeps_tied_parameters_one_object():
    tied = Qwen3Config(**(CONFIG.to_dict() | {"tie_word_embeddings": True}))
    meta = meta_model(tied)
    with torch._subclasses.fake_tensor.FakeTensorMode():
        model = memory_probe._fake_model(meta)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == sum(
        p.numel() for p in AutoModelForCausalLM.from_config(tied).parameters()
    )
