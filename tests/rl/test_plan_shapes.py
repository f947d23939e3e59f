"""`tirl plan` over the cluster shapes users run: 1, 8 and 64 GPUs, LoRA on and off, colocated (the
trainer offloaded or not) and separate engines, tensor parallel engines, and advice that names the
keys, never contradicts itself and, applied, gives a plan that fits.

The model is Qwen3-14B's width (hidden 5120, the full vocabulary) with two layers: fake tensors make
its size free, the layers' count is what costs time. Measurements are shared across the module
(tirl.rl.memory_probe.measured caches them per process)."""

from __future__ import annotations

import copy
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import tirl
from tirl.rl.memory_probe import measured
from tirl.rl.plan import (
    ENGINE_ASLEEP,
    QWEN3_14B,
    TRAINER_CONTEXT,
    ClusterShape,
    GiB,
    Plan,
    TrainingMemory,
    Workload,
    _advice,
    architecture_config,
    engine_memory,
    max_model_len_fix,
    parameter_count,
    plan_from,
    tensor_parallel_fix,
    utilization_range,
)
from tirl.rl.planner import default_lora, fixes_for

RECIPE = Path(tirl.__file__).parent / "configs" / "rstar2" / "train.yaml"
ENGINE = dict(
    max_model_len=4096,
    gpu_memory_utilization=0.5,
    tensor_parallel_size=1,
    dtype="bfloat16",
    max_batch_size=256,
)
SHAPE = (2, 4096)


@pytest.fixture(scope="module")
def wide():
    from transformers import Qwen3Config

    return Qwen3Config(**QWEN3_14B | {"num_hidden_layers": 2})


@pytest.fixture(scope="module")
def wide_dir(wide, tmp_path_factory) -> Path:
    """The two-layer model as a directory `--arch` reads (its config.json only)."""
    path = tmp_path_factory.mktemp("wide")
    wide.save_pretrained(path)
    return path


def _stand_in(peak: int = GiB) -> TrainingMemory:
    """A training measurement for tests of what a plan adds around it (no fake-tensor run)."""
    return TrainingMemory(peak=peak, by_category={}, resident=GiB)


def _workload(lora: bool = False, engine: dict | None = ENGINE, shape=SHAPE) -> Workload:
    return Workload(shape, True, True, engine, lora=default_lora() if lora else None)


@pytest.mark.parametrize("world,lora", [(1, False), (1, True), (8, False), (8, True), (64, False)])
def test_each_rank_holds_its_share_of_the_state(wide, world, lora):
    """Parameters, accumulated gradients and AdamW moments per GPU: the whole model in fp32 on one GPU
    (the single-process trainer), 1/world of it under FSDP2; with LoRA the base in bf16 and gradients
    and moments of the adapters only."""
    memory = measured(wide, world, _workload(lora))
    params = parameter_count(wide)
    trained = memory.trainable
    base = (params - trained) * 2 + trained * 4 if lora else params * 4
    assert trained == params if not lora else 0 < trained < params / 50
    assert memory.by_category["Sharded Param"] == pytest.approx(base / world, rel=0.01)
    assert memory.by_category["Sharded Grad"] == pytest.approx(trained * 4 / world, rel=0.01)
    assert memory.by_category["OptState"] == pytest.approx(trained * 8 / world, rel=0.01)
    assert memory.resident == pytest.approx((base + trained * 8) / world, rel=0.01)
    state = base / world + trained * 12 / world
    assert state < memory.peak < state + 12 * GiB  # plus activations, gathered layers, the head's chunk


def test_more_gpus_need_less_memory_each(wide):
    peaks = [measured(wide, world, _workload()).peak for world in (1, 8, 64)]
    assert peaks[0] > peaks[1] > peaks[2]
    assert measured(wide, 1, _workload(lora=True)).peak < peaks[0] / 2


def _terms(line: str) -> tuple[list[float], float, float]:
    """'phase: a 1.0 + b 2.0 = 3.0 GiB of 80.0' -> ([1.0, 2.0], 3.0, 80.0)"""
    body, total = line.split(" = ")
    values = [float(term.split()[-1]) for term in body.split(": ", 1)[1].split(" + ")]
    total_gib, memory = re.match(r"([\d.]+) GiB of ([\d.]+)", total).groups()
    return values, float(total_gib), float(memory)


@pytest.mark.parametrize("colocated,offload", [(True, True), (True, False), (False, False)])
def test_each_phase_per_gpu_by_layout(wide, colocated, offload):
    """Training, rollout and weight sync per GPU for colocated engines (the trainer offloaded during
    rollouts, as the synchronous trainer does, or not) and separate ones; every printed sum adds up."""
    training = measured(wide, 8, _workload())
    plan = plan_from(wide, ClusterShape(8, 40 * GiB, colocated, offload), _workload(), "wide", training)
    peak, engine = training.peak, plan.engine
    asleep = ENGINE_ASLEEP if colocated else 0
    assert plan.training_total == peak + int(peak * plan.slack) + int(TRAINER_CONTEXT) + int(asleep)
    beside = (0 if offload else training.resident) + int(TRAINER_CONTEXT) if colocated else 0
    assert plan.rollout_total == engine.budget + beside
    if colocated:  # the woken engine's weights next to the trainer's parameters, one gathered tensor
        largest = wide.vocab_size * wide.hidden_size * 4  # and the sync packed whole (torchrun)
        expected = engine.weights + int(ENGINE_ASLEEP) + training.by_category["Sharded Param"] + largest
        assert plan.sync_total == expected + _handoff_bytes(wide) + int(TRAINER_CONTEXT)
    else:
        assert plan.sync_total is None
    summed = [line for line in plan.lines() if " GiB of " in line]
    assert len(summed) == (3 if colocated else 2)
    for line in summed:
        values, total, memory = _terms(line.split("; resident")[0])
        assert sum(values) == pytest.approx(total, abs=0.05 * len(values)) and memory == 40.0


@pytest.mark.parametrize("tp,weights_gib,kv_per_token,trajectories", [
    (1, 27.51, 160 * 1024, 8), (2, 13.75, 80 * 1024, 28), (8, 3.44, 20 * 1024, 148),
    (16, 1.72, 20 * 1024, 154),  # more GPUs than KV heads: vLLM replicates them
])  # fmt: skip
def test_tensor_parallel_engines_split_weights_and_kv_heads(tp, weights_gib, kv_per_token, trajectories):
    """One GPU of a Qwen3-14B engine at 0.65 of 80 GiB, 16K-token trajectories."""
    config = architecture_config("qwen3-14b")
    engine = ENGINE | {"max_model_len": 16384, "gpu_memory_utilization": 0.65, "tensor_parallel_size": tp}
    memory = engine_memory(config, parameter_count(config), 80 * GiB, engine)
    assert memory.weights / GiB == pytest.approx(weights_gib, abs=0.01)
    assert memory.kv_per_token == kv_per_token and memory.trajectories == trajectories
    assert memory.weights + memory.reserve + memory.kv_cache == memory.budget


def _applied(workload: Workload, fixes: dict[str, str]) -> Workload:
    engine = dict(workload.engine)
    for key, value in fixes.items():
        assert key.startswith("engine."), key
        engine[key.removeprefix("engine.")] = float(value) if "." in value else int(value)
    return replace(workload, engine=engine)


@pytest.mark.parametrize("utilization,offload,direction", [(0.95, False, "lower"), (0.05, True, "raise")])
def test_engine_advice_moves_one_knob_one_way_and_converges(wide, utilization, offload, direction):
    training = measured(wide, 8, _workload())
    cluster = ClusterShape(8, 40 * GiB, True, offload)
    workload = _workload(engine=ENGINE | {"gpu_memory_utilization": utilization})
    plan = plan_from(wide, cluster, workload, "wide", training)
    assert not plan.fits
    fixes = fixes_for(wide, plan)
    assert list(fixes) == ["engine.gpu_memory_utilization"]
    new = float(fixes["engine.gpu_memory_utilization"])
    assert (new < utilization) if direction == "lower" else (new > utilization)
    assert sum("gpu_memory_utilization" in item for item in plan.advice) == 1
    assert plan_from(wide, cluster, _applied(workload, fixes), "wide", training).fits


@pytest.mark.parametrize("card_gib,tp", [(24, 2), (12, 4), (8, 8)])
def test_an_engine_no_utilization_can_hold_gets_tensor_parallel_or_a_shorter_context(wide, card_gib, tp):
    """The 14B's bf16 weights (27.5 GiB) leave a 24 GiB card no room at any utilization: the advice
    names tensor parallelism (no max_model_len helps: the weights alone overflow), not the utilization;
    the smallest size with room (its 40 heads also split 5 ways: 4 is the answer on 12 GiB, not 5), and
    only a size that divides the heads."""
    config = architecture_config("qwen3-14b")
    training = measured(wide, 8, _workload(lora=True))  # a stand-in that fits: the engine is judged here
    engine = ENGINE | {"max_model_len": 16384, "gpu_memory_utilization": 0.9}
    card = card_gib * GiB
    plan = plan_from(config, ClusterShape(8, card, True, True), _workload(True, engine), "14b", training)
    advice = next(item for item in plan.advice if "no engine.gpu_memory_utilization" in item)
    assert (
        f"set engine.tensor_parallel_size={tp}" in advice
        and "set engine.gpu_memory_utilization" not in advice
    )
    assert "raise" not in advice and "lower" not in advice
    fixed = _applied(plan.workload, {"engine.tensor_parallel_size": str(tp)}).engine
    assert engine_memory(config, plan.parameters, card, fixed).trajectories >= 1
    smaller = _applied(plan.workload, {"engine.tensor_parallel_size": str(tp // 2)}).engine
    assert engine_memory(config, plan.parameters, card, smaller).trajectories < 1
    if tp > 2:  # an engine already at the next smaller size that has no room: the advice is tp again
        at = _workload(True, engine | {"tensor_parallel_size": tp // 2})
        assert tensor_parallel_fix(config, plan_from(config, plan.cluster, at, "14b", training)) == tp
    odd = copy.deepcopy(config)
    odd.num_attention_heads = 5 * tp // 2  # divided by the smaller sizes only: no size to advise
    assert tensor_parallel_fix(odd, plan) is None


@pytest.mark.parametrize("card_gib", [32, 32.25, 40])
def test_the_context_fix_is_the_longest_multiple_of_1024_with_room(wide, card_gib):
    """The 14B's weights fit these cards but a 131072-token trajectory does not: the advised
    max_model_len is a multiple of 1024 with room for one trajectory whose next multiple has none; 1024
    itself on a card with room for no more, none on one without room for even that."""
    config = architecture_config("qwen3-14b")
    training = measured(wide, 8, _workload(lora=True))  # a stand-in that fits: the engine is judged here
    engine = ENGINE | {"max_model_len": 131072, "gpu_memory_utilization": 0.9}
    cluster = ClusterShape(8, int(card_gib * GiB), True, True)
    plan = plan_from(config, cluster, _workload(True, engine), "14b", training)

    def room(length: int) -> bool:
        low, high = utilization_range(config, plan, engine | {"max_model_len": length})
        return low <= high

    length = max_model_len_fix(config, plan)
    assert not room(131072) and length == {32: None, 32.25: 1024}.get(card_gib, length)
    if length is not None:
        assert length % 1024 == 0 and 1024 <= length < 131072 and room(length) and not room(length + 1024)


def test_the_context_fix_of_an_engine_one_token_too_long_is_the_multiple_below():
    """A separate engine of 52225 tokens on a GPU with room for exactly 52224 (its weights, reserve and
    52224 tokens of KV cache, to the byte): the advised max_model_len is 52224, the first multiple of
    1024 below the engine's own, not a step further down."""
    config = architecture_config("qwen3-14b")
    engine = ENGINE | {"max_model_len": 52225, "gpu_memory_utilization": 0.9}
    e = engine_memory(config, QWEN3_14B_PARAMETERS, GiB, engine | {"gpu_memory_utilization": 1.0})
    exact = e.weights + e.reserve + e.kv_per_token * 52224
    plan, _ = _judged((exact + 0.5) / GiB, engine, {"colocated": False})
    assert plan.cluster.gpu_memory == exact
    assert utilization_range(config, plan, engine | {"max_model_len": 52224}) == (1.0, 1.0)
    assert utilization_range(config, plan) == (1.01, 1.0)  # one token more than the GPU holds
    assert max_model_len_fix(config, plan) == 52224
    assert plan.advice[-1].endswith("or set engine.max_model_len=52224")


def _plan_cli(args: list[str]):
    from typer.testing import CliRunner

    from tirl.cli import app

    return CliRunner().invoke(app, ["plan", "--config", str(RECIPE), *args])


def test_a_24gb_card_gets_advice_that_fits_when_applied(wide_dir):
    """One 24 GiB consumer GPU, full fine-tuning: the plan does not fit and prints the overrides that
    do (LoRA here: the fp32 state alone is 33 GiB), never a micro_batch_tokens below max_model_len;
    applied as printed, the plan fits."""
    base = ["--arch", str(wide_dir), "--gpus", "1", "--gpu-memory", "24"]
    small = ["engine.max_model_len=4096", "optim.micro_batch_tokens=8192"]
    result = _plan_cli([*base, *small])
    assert result.exit_code == 1, result.output
    fix_line = next(line for line in result.output.splitlines() if line.startswith("fits with: "))
    fixes = fix_line.removeprefix("fits with: ").split()
    assert "optim.lora.enabled=true" in fixes
    tokens = [int(f.split("=")[1]) for f in fixes if f.startswith("optim.micro_batch_tokens=")]
    assert all(t >= 4096 for t in tokens)
    again = _plan_cli([*base, *small, *fixes])
    assert again.exit_code == 0 and "FITS" in again.output, again.output


def test_the_largest_micro_batch_that_fits(wide_dir):
    """--largest micro-batch: one line naming the key and its value, then the plan of that value, which
    fits; one sequence more does not."""
    base = ["--arch", str(wide_dir), "--gpus", "8", "--gpu-memory", "24", "engine.max_model_len=4096"]
    result = _plan_cli([*base, "--largest", "micro-batch"])
    assert result.exit_code == 0, result.output
    # after the progress lines (what is measured, how long), the answer's line, then its plan
    lines = result.output.splitlines()
    first = next(line for line in lines if line.startswith("largest "))
    assert first.startswith("largest optim.micro_batch_tokens that fits: ")
    tokens = int(first.rsplit(" ", 1)[1])
    assert tokens >= 4096 and tokens % 4096 == 0 and "FITS" in result.output
    over = _plan_cli([*base, f"optim.micro_batch_tokens={tokens + 4096}"])
    assert over.exit_code == 1, over.output


def test_the_largest_context_that_fits():
    """--largest context: the longest engine.max_model_len (a multiple of 1024, up to the model's
    max_position_embeddings) whose whole plan fits, the micro-batch keeping its token budget; 1024
    tokens more does not fit. The GPU is sized between the plans at 4096 and 8192 tokens."""
    from transformers import Qwen3Config

    from tirl.rl.plan import micro_batch_shape
    from tirl.rl.planner import largest, make_plan

    config = Qwen3Config(**QWEN3_14B | {"num_hidden_layers": 2, "max_position_embeddings": 8192})

    def at(length: int) -> Workload:
        return _workload(engine=ENGINE | {"max_model_len": length}, shape=micro_batch_shape(4096, length))

    def total(length: int) -> int:
        return make_plan(config, ClusterShape(8, 80 * GiB, True, True), at(length), "wide").training_total

    cluster = ClusterShape(8, (total(4096) + total(8192)) // 2, True, True)
    key, length, plan = largest(config, cluster, at(1024), "context", "wide")
    assert key == "engine.max_model_len" and 4096 <= length < 8192 and length % 1024 == 0, length
    assert plan.fits and plan.workload.engine["max_model_len"] == length
    assert plan.workload.micro_batch == micro_batch_shape(4096, length)
    assert not make_plan(config, cluster, at(length + 1024), "wide", advise=False).fits


def test_the_largest_context_at_its_edges_and_for_sft():
    """--largest context at its edges: a GPU that holds every length gives the model's own limit
    (max_position_embeddings, not a default); one that holds 1024 tokens and no more gives 1024 with
    its plan; one that holds nothing gives no value and the 1024-token plan. SFT (no engine) searches
    max_length the same way. The plan returned names the model it was asked about."""
    from transformers import Qwen3Config

    from tirl.rl.plan import micro_batch_shape
    from tirl.rl.planner import largest, make_plan

    config = Qwen3Config(**QWEN3_14B | {"num_hidden_layers": 2, "max_position_embeddings": 8192})

    def at(length: int, engine: bool = True) -> Workload:
        return _workload(engine=ENGINE | {"max_model_len": length} if engine else None, shape=(1, length))

    def total(length: int, engine: bool = True) -> int:
        return make_plan(
            config, ClusterShape(8, 80 * GiB, True, True), at(length, engine), "wide"
        ).training_total

    roomy = ClusterShape(8, 4 * total(8192), True, True)
    key, length, plan = largest(config, roomy, at(1024), "context", "wide")
    assert (key, length, plan.workload.engine["max_model_len"]) == ("engine.max_model_len", 8192, 8192)
    assert plan.architecture == "wide" and plan.fits and not plan.fixes

    tight = ClusterShape(8, (total(1024) + total(2048)) // 2, True, True)
    key, length, plan = largest(config, tight, at(1024), "context", "wide")
    assert (length, plan.workload.engine["max_model_len"], plan.fits) == (1024, 1024, True)
    assert plan.workload.micro_batch == micro_batch_shape(1024, 1024)

    none = ClusterShape(8, total(1024) // 2, True, True)
    key, length, plan = largest(config, none, at(1024), "context", "wide")
    assert (key, length, plan.fits) == ("engine.max_model_len", None, False)
    assert plan.workload.engine["max_model_len"] == 1024

    sft_tight = ClusterShape(8, (total(1024, False) + total(2048, False)) // 2, True, True)
    key, length, plan = largest(config, sft_tight, at(1024, engine=False), "context", "wide")
    assert (key, length, plan.workload.engine, plan.fits) == ("max_length", 1024, None, True)


def _handoff_bytes(config, dtype: torch.dtype = torch.bfloat16) -> int:
    """What the in-process sync allocates for this model (tirl.runtime.base.load_sources: every parameter,
    a tied one once, laid out by the handoff in the engines' dtype), about 2 bytes a parameter in bf16."""
    from tirl.engines.handoff import ALIGN, flat_layout
    from tirl.rl.plan import meta_model

    params = dict(meta_model(config).named_parameters())
    _, nbytes = flat_layout(((n, tuple(p.shape), p.dtype) for n, p in params.items()), dtype)
    assert 0 <= nbytes - dtype.itemsize * parameter_count(config) < ALIGN * len(params)
    return nbytes


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_sync_is_sized_in_the_engines_dtype(wide, dtype):
    """An engine in float32 takes 4 bytes a parameter at every sync, twice a bf16 engine's: the sync's
    size and its packed buffer follow engine.dtype (the training memory does not enter them)."""
    training = _stand_in()
    workload = _workload(engine=ENGINE | {"dtype": dtype})
    plan = plan_from(wide, ClusterShape(8, 80 * GiB, True, True), workload, "wide", training)
    width = torch.float32 if dtype == "float32" else torch.bfloat16
    assert plan.sync_buffer == _handoff_bytes(wide, width)
    assert plan.sync_bytes == pytest.approx(width.itemsize * parameter_count(wide), rel=0.01)


def _sync_line(plan) -> str:
    return next(line for line in plan.lines() if line.startswith("weight sync on rank 0's GPU: "))


def test_a_plan_names_its_model_and_takes_the_allocators_slack(wide, monkeypatch):
    """Unnamed, a plan is named by the architecture's model_type; its training total carries the slack
    of the allocator the trainer will run: 15% with fixed segments (PYTORCH_CUDA_ALLOC_CONF set without
    expandable segments), 5% without the variable (the trainer turns them on)."""
    training = _stand_in(10 * GiB)
    cluster, workload = ClusterShape(8, 80 * GiB, True, True), _workload()
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    default = plan_from(wide, cluster, workload, "", training)
    assert default.architecture == "qwen3" and default.slack == 0.05
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    fixed = plan_from(wide, cluster, workload, "wide", training)
    assert fixed.architecture == "wide" and fixed.slack == 0.15
    assert fixed.training_total - default.training_total == int(training.peak * 0.15) - int(
        training.peak * 0.05
    )


@pytest.mark.parametrize("tp,gpus,in_file", [(2, 2, False), (2, 4, True), (None, 1, False), (None, 2, True)])
def test_a_tensor_parallel_engine_on_all_gpus_needs_no_shm_file(wide, tp, gpus, in_file):
    """Colocated TP-2 engines: on 2 GPUs the one engine spans rank 0's GPU and reads the packed sync
    there (CUDA IPC); on 4 the second engine is on GPUs without the buffer and reads /dev/shm. An engine
    dict without tensor_parallel_size is one GPU: on 2 GPUs the second engine reads the file."""
    training = _stand_in()
    engine = {k: v for k, v in ENGINE.items() if k != "tensor_parallel_size"}
    workload = _workload(engine=engine if tp is None else engine | {"tensor_parallel_size": tp})
    plan = plan_from(wide, ClusterShape(gpus, 80 * GiB, True, True), workload, "wide", training)
    assert plan.buffer_on_gpu and plan.buffer_in_file == in_file


def test_only_in_process_vllm_engines_take_the_sync_packed_whole(wide):
    """The HF engine takes (name, tensor) pairs: no packed buffer on a GPU or in /dev/shm, colocated or
    not; vLLM's does (an engine without a backend is vLLM, the config's default)."""
    training = _stand_in()
    for colocated in (True, False):
        cluster = ClusterShape(8, 80 * GiB, colocated, colocated)
        hf = plan_from(wide, cluster, _workload(engine=ENGINE | {"backend": "hf"}), "wide", training)
        assert (hf.sync_buffer, hf.buffer_on_gpu, hf.buffer_in_file) == (0, False, False)
        vllm = plan_from(wide, cluster, _workload(engine=ENGINE | {"backend": "vllm"}), "wide", training)
        assert vllm.sync_buffer == _handoff_bytes(wide) and vllm.buffer_in_file
        assert vllm.buffer_on_gpu == colocated


def test_training_that_fills_the_gpu_exactly_fits(wide):
    from tirl.rl.plan import training_fits

    training = _stand_in(10 * GiB)
    plan = plan_from(wide, ClusterShape(8, 80 * GiB, True, True), _workload(), "wide", training)
    exact = replace(plan, cluster=replace(plan.cluster, gpu_memory=plan.training_total))
    assert training_fits(exact)
    assert not training_fits(replace(exact, training_total=plan.training_total + 1))


@pytest.mark.parametrize("length", [4096, 32768])
def test_the_lowest_utilization_is_the_first_hundredth_with_room_for_a_trajectory(wide, length):
    """utilization_range's low end: at that gpu_memory_utilization the engine holds one trajectory of
    max_model_len, one hundredth less it holds none."""
    training = _stand_in()
    engine = ENGINE | {"max_model_len": length}
    plan = plan_from(wide, ClusterShape(8, 80 * GiB, True, True), _workload(engine=engine), "wide", training)
    low, high = utilization_range(wide, plan)
    params = parameter_count(wide)

    def trajectories(utilization: float) -> int:
        return engine_memory(
            wide, params, 80 * GiB, engine | {"gpu_memory_utilization": utilization}
        ).trajectories

    assert 0 < low < high <= 1 and round(low * 100) == low * 100
    assert trajectories(low) >= 1 and trajectories(round(low - 0.01, 2)) == 0


@pytest.mark.parametrize("world", [1, 8])
def test_a_torchrun_sync_holds_the_packed_model_on_rank_0s_gpu(wide, world):
    """Colocated in-process engines (torchrun, or one process): rank 0 packs the whole sync in bf16 into
    one buffer on its own GPU, next to engine 0's woken weights (engine 0 opens it by CUDA IPC); with
    engines on other GPUs one /dev/shm file of the same size serves them too. The printed sum adds up."""
    training = measured(wide, world, _workload())
    plan = plan_from(wide, ClusterShape(world, 80 * GiB, True, True), _workload(), "wide", training)
    buffer = _handoff_bytes(wide)
    assert plan.sync_buffer == buffer and plan.buffer_on_gpu and plan.buffer_in_file == (world > 1)
    # the FSDP gather makes the largest parameter whole in fp32; one process's parameters are whole
    assert plan.largest_tensor == (wide.vocab_size * wide.hidden_size * 4 if world > 1 else 0)
    beside = plan.engine.weights + int(ENGINE_ASLEEP) + training.parameter_bytes + plan.largest_tensor
    assert plan.sync_total == beside + buffer + int(TRAINER_CONTEXT)
    values, total, _ = _terms(_sync_line(plan))
    assert values[-2] == pytest.approx(buffer / GiB, abs=0.05) and len(values) == (6 if world > 1 else 5)
    assert sum(values) == pytest.approx(total, abs=0.05 * len(values))
    assert ("/dev/shm" in plan.lines()[-2]) == (world > 1)


def test_rays_group_and_separate_engines_stage_no_whole_model_on_a_gpu(wide):
    """Ray's sync group streams buckets: its sync phase has no packed buffer. Separate in-process engines
    (none on rank 0's GPU) read the packed sync from one /dev/shm file: no GPU holds it either."""
    training = measured(wide, 8, _workload())
    ray = plan_from(wide, ClusterShape(8, 80 * GiB, True, True, "group"), _workload(), "wide", training)
    beside = ray.engine.weights + int(ENGINE_ASLEEP) + training.parameter_bytes + ray.largest_tensor
    assert ray.sync_total == beside + int(TRAINER_CONTEXT)
    assert not ray.buffer_on_gpu and not ray.buffer_in_file and ray.sync_buffer == 0
    assert any(line.startswith("weight sync per GPU: ") for line in ray.lines())
    apart = plan_from(wide, ClusterShape(8, 80 * GiB, False, False), _workload(), "wide", training)
    assert apart.sync_total is None and not apart.buffer_on_gpu and apart.buffer_in_file
    assert apart.sync_buffer == _handoff_bytes(wide)


def test_a_sync_that_overflows_only_by_the_packed_model_is_advised_and_never_fits_with(wide):
    """Qwen3-14B on 8 x 48 GiB (a fitting training stand-in, engines at 0.7): Ray's sync fits, the torchrun
    one does not (27.5 GiB of packed weights beside engine 0's 27.5): the advice names the packed sync
    and no `fits with` line claims a fit that the sync phase breaks."""
    config = architecture_config("qwen3-14b")
    training = measured(wide, 8, _workload())
    workload = _workload(engine=ENGINE | {"gpu_memory_utilization": 0.7})
    ray = plan_from(config, ClusterShape(8, 48 * GiB, True, True, "group"), workload, "14b", training)
    assert ray.fits, ray.advice
    local = plan_from(config, ClusterShape(8, 48 * GiB, True, True), workload, "14b", training)
    assert local.sync_total == ray.sync_total + local.sync_buffer and local.sync_buffer > 27 * GiB
    assert not local.fits and len(local.advice) == 1
    assert "on rank 0's GPU" in local.advice[0] and "packed whole" in local.advice[0]
    assert "cluster.backend=ray" in local.advice[0]
    assert fixes_for(config, local) == {}


def test_a_lora_sync_packs_and_merges_only_the_adapted_layers(wide):
    """LoRA (all linear layers): the packed buffer holds the merged layers and their fused partners in
    bf16, not the embeddings; the largest tensor made whole is one merged MLP weight in fp32."""
    training = measured(wide, 8, _workload(lora=True))
    plan = plan_from(wide, ClusterShape(8, 80 * GiB, True, True), _workload(lora=True), "wide", training)
    assert plan.sync_buffer == pytest.approx(plan.sync_bytes, abs=64 * 7 * wide.num_hidden_layers)
    assert plan.sync_buffer < _handoff_bytes(wide) - 2 * wide.vocab_size * wide.hidden_size * 2
    assert plan.largest_tensor == wide.intermediate_size * wide.hidden_size * 4


def test_the_largest_model_walks_the_family_down_from_the_largest(monkeypatch):
    """--largest model: the family is tried from the most parameters down (whatever order it is listed
    in) and the first that fits is the answer, with its own plan; on a GPU that holds nothing the answer
    is none, with the smallest's plan. A family of Qwen3-14B's width at 1-3 layers stands in for
    Qwen3's sizes (whose fake-tensor measurement takes minutes)."""
    from transformers import Qwen3Config

    from tirl.rl import plan as plan_module
    from tirl.rl import planner
    from tirl.rl.planner import largest, make_plan

    family = {
        name: QWEN3_14B | {"num_hidden_layers": n} for name, n in (("two", 2), ("three", 3), ("one", 1))
    }
    monkeypatch.setattr(planner, "QWEN3", family)
    monkeypatch.setattr(plan_module, "ARCHITECTURES", plan_module.ARCHITECTURES | family)
    workload = _workload()

    def total(name: str) -> int:
        roomy = ClusterShape(8, 80 * GiB, True, True)
        return make_plan(Qwen3Config(**family[name]), roomy, workload, name).training_total

    one, two, three = total("one"), total("two"), total("three")
    assert one < two < three
    asked = Qwen3Config(**family["one"])
    for memory, answer in ((4 * three, "three"), ((two + three) // 2, "two"), ((one + two) // 2, "one")):
        key, arch, plan = largest(asked, ClusterShape(8, memory, True, True), workload, "model", "one")
        assert (key, arch, plan.architecture, plan.fits) == ("model", answer, answer, True)
    key, arch, plan = largest(asked, ClusterShape(8, one // 2, True, True), workload, "model", "one")
    assert (arch, plan.architecture, plan.fits) == (None, "one", False)


QWEN3_14B_PARAMETERS = (
    14_768_307_200  # parameter_count(architecture_config("qwen3-14b")): tested in test_plan.py
)


def _judged(
    card: float, engine: dict | None, cluster: dict | None = None, training_total: float = 10, **plan
) -> tuple[Plan, object]:
    """A hand-built 14B plan on 8 GPUs of `card` GiB (no measurement: the advice reads only the plan's
    totals), its rollout total what plan_from would sum, and the advice for it."""
    config = architecture_config("qwen3-14b")
    shape = ClusterShape(8, int(card * GiB), **(cluster or {}))
    training = TrainingMemory(40 * GiB, {"Sharded Param": 7 * GiB, "OptState": 14 * GiB}, resident=21 * GiB)
    made = Plan(
        "14b", QWEN3_14B_PARAMETERS, shape, plan.pop("workload", Workload(SHAPE, engine=engine)), training,
        engine_memory(config, QWEN3_14B_PARAMETERS, shape.gpu_memory, engine) if engine else None,
        sync_bytes=0, training_total=int(training_total * GiB), rollout_total=None, **plan,
    )  # fmt: skip
    if made.engine is not None:
        made.rollout_total = sum(v for _, v in made._rollout_terms())
    made.advice = _advice(config, made)
    return made, config


def test_each_phase_that_does_not_fit_gets_one_item_naming_its_keys():
    """Training, rollout and the sync over an 80 GiB card, word for word: every training option that
    applies (micro-batch, checkpointing, LoRA, GPUs with the sharded state, the context), the highest
    utilization with room beside the trainer's resident state, and the packed sync's way out (Ray)."""
    engine = ENGINE | {"max_model_len": 16384, "gpu_memory_utilization": 0.9}
    workload = Workload(SHAPE, gradient_checkpointing=False, engine=engine)
    plan, _ = _judged(
        80, engine, training_total=95, workload=workload, sync_total=100 * GiB, buffer_on_gpu=True,
        sync_buffer=int(27.5 * GiB),
    )  # fmt: skip
    # beside the engine: the resident 21 GiB and the trainer's 1.5 GiB context; floor(100 * 57.5 / 80)
    assert plan.rollout_total == int(72 * GiB + 21 * GiB + TRAINER_CONTEXT)
    assert plan.advice == [
        "training needs 95.0 GiB per GPU of 80.0: fewer tokens per micro-batch (optim.micro_batch_tokens, "
        "at least engine.max_model_len=4096), or optim.gradient_checkpointing=true, or "
        "optim.lora.enabled=true, or more GPUs (torchrun --nproc_per_node, or cluster.trainer.ranks on "
        "Ray; the sharded state is 21.0 GiB at 8), or a shorter engine.max_model_len (`tirl plan "
        "--largest context` finds the longest that fits)",
        "rollout needs 94.5 GiB per GPU: set engine.gpu_memory_utilization=0.71",
        "the weight sync needs 100.0 GiB on rank 0's GPU (the woken engine's weights next to the "
        "trainer's parameters and the sync packed whole, 27.5 GiB): use more GPUs (smaller parameter "
        "shards), or a larger engine.tensor_parallel_size (smaller engine weights per GPU), or "
        "cluster.backend=ray (its sync group streams buckets)",
    ]


def test_training_advice_offers_only_what_would_change_it():
    """SFT (no engine) already at one sequence per micro-batch, checkpointing on, LoRA on: more GPUs
    or a shorter max_length, nothing else; a plan exactly the card's size needs no advice."""
    lora = Workload((1, 8192), lora={"rank": 8})
    plan, _ = _judged(80, None, training_total=95, workload=lora)
    assert plan.advice == [
        "training needs 95.0 GiB per GPU of 80.0: more GPUs (torchrun --nproc_per_node, or "
        "cluster.trainer.ranks on Ray; the sharded state is 21.0 GiB at 8), or a shorter max_length "
        "(`tirl plan --largest context` finds the longest that fits)"
    ]
    assert _judged(80, None, training_total=80, workload=lora)[0].advice == []
    # a measurement without optimizer state (nothing trained yet in its category): the parameters alone
    bare = replace(plan, training=TrainingMemory(40 * GiB, {"Sharded Param": 7 * GiB}, resident=7 * GiB))
    assert "the sharded state is 7.0 GiB at 8)" in _advice(architecture_config("qwen3-14b"), bare)[0]


def test_engine_advice_for_each_way_the_engine_misses():
    """A KV cache too small: the utilization to raise to, at most 0.9 on a separate engine's GPU; no
    utilization with room: tensor parallelism and/or a shorter context, or bigger GPUs when neither
    helps; a sync over the card without a packed buffer (per GPU, no Ray to suggest), and one that
    fills the card exactly (no advice)."""
    long = ENGINE | {"max_model_len": 16384}
    starved, _ = _judged(80, long | {"gpu_memory_utilization": 0.05}, {"colocated": False})
    assert starved.engine.kv_cache == 0 and starved.engine.trajectories == 0
    assert starved.advice == [
        "an engine's KV cache (0.0 GiB) holds no trajectory of 16384 tokens: set "
        "engine.gpu_memory_utilization=0.90"
    ]
    # 40 GiB at the highest utilization, 0.96, less the weights and reserve, holds 52,403 tokens' KV cache
    for card, length, options in [
        (24, 16384, "set engine.tensor_parallel_size=2"),
        (40, 131072, "set engine.tensor_parallel_size=2, or set engine.max_model_len=52224"),
    ]:
        engine = ENGINE | {"max_model_len": length, "gpu_memory_utilization": 0.9}
        plan, config = _judged(card, engine, {"trainer_offload": True})
        low, high = utilization_range(config, plan)
        assert low > high and max_model_len_fix(config, plan) == (52224 if card == 40 else None)
        assert plan.advice == [
            f"no engine.gpu_memory_utilization gives an engine room for one trajectory of {length} tokens "
            f"(it needs >= {low:.2f}, the GPU leaves <= {high:.2f}): {options}"
        ]
    hopeless, config = _judged(8, long | {"gpu_memory_utilization": 0.9}, {"trainer_offload": True})
    config.num_attention_heads = 5
    assert _advice(config, hopeless)[-1].endswith(": use GPUs with more memory")
    fitting = long | {"gpu_memory_utilization": 0.5}
    sync, _ = _judged(80, fitting, {"trainer_offload": True}, sync_total=81 * GiB)
    assert sync.advice == [
        "the weight sync needs 81.0 GiB per GPU (the woken engine's weights next to the trainer's "
        "parameters): use more GPUs (smaller parameter shards), or a larger engine.tensor_parallel_size "
        "(smaller engine weights per GPU)"
    ]
    assert _judged(80, fitting, {"trainer_offload": True}, sync_total=80 * GiB)[0].advice == []
