"""The planner's searches (tirl.rl.planner) over a training measurement with a known shape: the fixes,
the fewest measurements to the largest micro-batch, the largest context. What is measured is a
stand-in (a peak that grows with the micro-batch and shrinks with checkpointing and LoRA), so each
answer can be checked against every candidate planned one by one; the real fake-tensor measurement's
searches are test_plan_shapes.py's."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest
from transformers import Qwen3Config

import tirl
from tirl.config import load_config
from tirl.rl import planner
from tirl.rl.config import LoraConfig, SFTConfig
from tirl.rl.plan import (
    QWEN3_14B,
    ClusterShape,
    GiB,
    TrainingMemory,
    Workload,
    architecture_config,
    plan_from,
    training_fits,
    utilization_range,
)
from tirl.rl.planner import default_lora, largest, largest_for_config, make_plan, plan_for_config

CONFIG = Qwen3Config(**QWEN3_14B | {"num_hidden_layers": 2, "max_position_embeddings": 16384})
ENGINE = dict(max_model_len=4096, gpu_memory_utilization=0.5, tensor_parallel_size=1, dtype="bfloat16")
STATE = 6 * GiB  # the sharded state of one rank of 8


def stand_in(config, world: int, workload: Workload) -> TrainingMemory:
    """A peak convex in the sequences (b^1.5: a straight line through two measurements misses it, so the
    search must narrow its bracket), 4x the activations without checkpointing, a quarter of the state
    with LoRA."""
    assert config.hidden_size, "the planner measures the model's config"
    b, n = workload.micro_batch
    activations = int(b**1.5 * n * 64 * 1024) * (1 if workload.gradient_checkpointing else 4)
    state = STATE * 8 // world // (4 if workload.lora else 1)  # sharded over the world's ranks
    return TrainingMemory(state + activations, {"Sharded Param": state // 4, "OptState": state // 2}, state)


@pytest.fixture(autouse=True)
def measured(monkeypatch) -> list[Workload]:
    """The stand-in in the planner's place; the workloads it measured, in order. A search that measures
    hundreds of candidates does not end (a broken bisection): it fails here instead of hanging."""
    calls: list[Workload] = []

    def measure(config, world, workload):
        calls.append(workload)
        assert len(calls) <= 300, f"a search measured {len(calls)} candidates: it does not end"
        return stand_in(config, world, workload)

    monkeypatch.setattr(planner, "measured", measure)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    return calls


def _plan(cluster: ClusterShape, workload: Workload):
    return plan_from(CONFIG, cluster, workload, "wide", stand_in(CONFIG, cluster.gpus, workload))


def _most_that_fit(cluster: ClusterShape, workload: Workload, up_to: int) -> int:
    """The most sequences per micro-batch that fit, planning every count (0: not even one)."""
    fits = [
        b
        for b in range(1, up_to + 1)
        if training_fits(_plan(cluster, replace(workload, micro_batch=(b, 4096))))
    ]
    return max(fits, default=0)


@pytest.mark.parametrize("card_gib", [8.5, 9, 12, 20, 33, 60, 100])
def test_too_many_sequences_are_fixed_with_the_most_that_fit_in_few_measurements(card_gib, measured):
    """A micro-batch of 64 sequences over the card: the fix is the most sequences that fit (every count
    planned to check), as optim.micro_batch_tokens, and applying it fits; the search measures a handful
    of micro-batches, not every count."""
    cluster = ClusterShape(8, int(card_gib * GiB), colocated=False)
    workload = Workload((64, 4096))
    answer = _most_that_fit(cluster, workload, 64)
    assert 1 <= answer < 64
    plan = make_plan(CONFIG, cluster, workload, "wide")
    searched = [w.micro_batch[0] for w in measured]
    assert not plan.fits and plan.fixes == {"optim.micro_batch_tokens": str(answer * 4096)}
    assert searched[:2] == [64, 1] and len(searched) <= 8, searched
    assert _plan(cluster, replace(workload, micro_batch=(answer, 4096))).fits


def test_one_sequence_over_the_card_turns_on_checkpointing_then_lora(measured):
    """No count of sequences fits: gradient checkpointing, at the configured micro-batch when it fits so
    (at one sequence, with its token budget, when not), then LoRA as well; nothing when even that does
    not fit. What is on already is not offered again, and LoRA is tried with checkpointing, never alone.
    Training totals (peak + 5% + 1.5 GiB context): 2 sequences without checkpointing 17.3 GiB, 1: 8.85;
    with it 8.54 and 8.06; with LoRA too 3.82 and 3.34."""
    off = Workload((2, 4096), gradient_checkpointing=False)

    def fixes(card_gib: float, workload: Workload = off) -> dict[str, str]:
        plan = make_plan(CONFIG, ClusterShape(8, int(card_gib * GiB), colocated=False), workload, "wide")
        assert not plan.fits
        return plan.fixes

    both = {"optim.gradient_checkpointing": "true", "optim.lora.enabled": "true"}
    assert fixes(8.7) == {"optim.gradient_checkpointing": "true"}
    assert fixes(8.3) == {"optim.gradient_checkpointing": "true", "optim.micro_batch_tokens": "4096"}
    assert fixes(5) == both
    assert fixes(3.5) == both | {"optim.micro_batch_tokens": "4096"}
    assert fixes(2) == {}
    assert default_lora()["enabled"] is True
    on = replace(off, gradient_checkpointing=True, micro_batch=(1, 4096))
    measured.clear()
    assert fixes(5, on) == {"optim.lora.enabled": "true"}
    # at one sequence: the plan's own measurement, then LoRA's, nothing measured twice
    assert [(w.micro_batch, w.gradient_checkpointing, bool(w.lora)) for w in measured] == [
        ((1, 4096), True, False),
        ((1, 4096), True, True),
    ]
    assert fixes(3, replace(on, lora=default_lora())) == {}
    assert not [w for w in measured if w.lora and not w.gradient_checkpointing]


def test_the_engine_is_fixed_first_tensor_parallel_before_a_shorter_context(measured):
    """Qwen3-14B's engine with one trajectory of 524288 tokens has no room on an 80 GiB card at any
    utilization: tensor parallelism is the fix (with the utilization moved into the range that works
    when it is outside); with a head count no size divides, the longest context with room, and the
    micro-batch keeps its token budget at that length, measured again before training is judged."""
    config = architecture_config("qwen3-14b")
    cluster = ClusterShape(8, 80 * GiB, colocated=True, trainer_offload=True)

    def fixes(config, utilization: float, shape: tuple[int, int] = (1, 524288)) -> dict[str, str]:
        engine = ENGINE | {"max_model_len": 524288, "gpu_memory_utilization": utilization}
        plan = make_plan(config, cluster, Workload(shape, engine=engine), "14b")
        assert not plan.fits
        return plan.fixes

    tp2 = {"engine.tensor_parallel_size": "2"}
    assert fixes(config, 0.9) == fixes(config, 0.71) == fixes(config, 0.98) == tp2  # in TP 2's (0.71, 0.98)
    assert fixes(config, 0.5) == tp2 | {"engine.gpu_memory_utilization": "0.71"}
    assert fixes(config, 0.99) == tp2 | {"engine.gpu_memory_utilization": "0.98"}
    config.num_attention_heads = 5
    measured.clear()
    assert fixes(config, 0.9, (6, 131072)) == {
        "engine.max_model_len": "336896",
        "engine.gpu_memory_utilization": "0.98",
    }
    assert [w.micro_batch for w in measured] == [(6, 131072), (2, 336896)]
    assert measured[-1].engine["max_model_len"] == 336896  # training judged beside the shorter engine
    # a 24 GiB card: the 14B's weights alone overflow it, no size divides 5 heads: no fixes at all
    small = replace(cluster, gpu_memory=24 * GiB)
    starved = make_plan(config, small, Workload((1, 4096), engine=ENGINE | {"max_model_len": 4096}), "14b")
    assert not starved.fits and starved.fixes == {}


@pytest.mark.parametrize(
    "utilization,engine_fix",
    [(0.1, "0.9"), (0.26, None), (0.5, None), (0.96, None), (0.97, "0.96")],  # the range: (0.26, 0.96)
)
def test_engine_and_training_are_fixed_together(utilization, engine_fix):
    """Qwen3-8B with TP 2, colocated on 40 GiB, 64 sequences per micro-batch: training's fix (the most
    sequences that fit) comes with the engine's when its utilization is outside its range, both edges
    of the range included, and alone when it is inside."""
    cluster = ClusterShape(8, 40 * GiB, colocated=True, trainer_offload=True)
    engine = ENGINE | {"gpu_memory_utilization": utilization, "tensor_parallel_size": 2}
    plan = make_plan(architecture_config("qwen3-8b"), cluster, Workload((64, 4096), engine=engine), "8b")
    assert utilization_range(architecture_config("qwen3-8b"), plan) == (0.26, 0.96)
    training = {"optim.micro_batch_tokens": str(23 * 4096)}
    assert plan.fixes == ({"engine.gpu_memory_utilization": engine_fix} if engine_fix else {}) | training


def test_no_fix_is_offered_when_the_weight_sync_still_does_not_fit():
    """Training's fix found, but the packed weight sync (29.7 GiB on rank 0's GPU) overflows a 24 GiB
    card: nothing the planner sets makes the plan fit, so it offers nothing (the advice names the sync)."""
    config = architecture_config("qwen3-8b")
    cluster = ClusterShape(8, 24 * GiB, colocated=True, trainer_offload=True)
    engine = ENGINE | {"gpu_memory_utilization": 0.9, "tensor_parallel_size": 2}
    plan = make_plan(config, cluster, Workload((16, 4096), engine=engine), "8b")
    assert not training_fits(plan) and planner._training_fix(config, plan) is not None
    assert plan.fixes == {} and plan.advice[-1].startswith("the weight sync needs 29.7 GiB on rank 0's GPU")


@pytest.mark.parametrize(
    "card_gib,offload,utilization,fixed",
    [
        (80, True, 0.5, None),  # in the range (0.24, 0.98): nothing to fix
        (40, False, 0.95, "0.81"),  # above it: its top, the trainer's resident state beside the engine
        (40, False, 0.05, "0.81"),  # below: 0.9 at most, and never above the top
        (40, True, 0.05, "0.9"),  # below, the trainer offloaded (0.47, 0.96): 0.9
        (29.25, True, 0.05, "0.92"),  # below a range (0.92, 0.94) above 0.9: its bottom
        (80, True, 0.99, "0.98"),  # above a range (0.24, 0.98) whose top is above 0.9: its top
    ],
)
def test_a_utilization_outside_its_range_is_moved_into_it(card_gib, offload, utilization, fixed):
    """gpu_memory_utilization alone fixes an engine that has room at some utilization: the top of the
    range when it is above it, 0.9 (or the range's edge) when below. Qwen3-8B at 4096 tokens; the 29.25
    GiB row Qwen3-4B at 122880, whose range starts above 0.9. Ray's group sync: no packed buffer."""
    arch, length = ("qwen3-4b", 122880) if card_gib < 30 else ("qwen3-8b", 4096)
    engine = ENGINE | {"gpu_memory_utilization": utilization, "max_model_len": length}
    cluster = ClusterShape(8, int(card_gib * GiB), True, offload, transport="group")
    plan = make_plan(architecture_config(arch), cluster, Workload((1, 4096), engine=engine), arch)
    assert plan.fits == (fixed is None)
    assert plan.fixes == ({"engine.gpu_memory_utilization": fixed} if fixed else {})


@pytest.mark.parametrize("card_gib", [7, 8.1, 8.6, 10, 20, 60, 100])
def test_the_largest_micro_batch_is_the_most_sequences_that_fit(card_gib, measured):
    """--largest micro-batch: none when one sequence does not fit, one sequence's tokens when two do not,
    else the most sequences that fit (every count up to 255 planned to check), with its plan, in a
    handful of measurements (one and two sequences, then guesses from the peak's growth); the plans
    are judged, not advised (no fixes searched: each would measure more)."""
    cluster = ClusterShape(8, int(card_gib * GiB), colocated=False)
    workload = Workload((4, 4096))
    answer = _most_that_fit(cluster, workload, 255)
    key, tokens, plan = largest(CONFIG, cluster, workload, "micro-batch", "wide")
    assert key == "optim.micro_batch_tokens" and plan.architecture == "wide"
    assert tokens == (answer * 4096 if answer else None)
    assert plan.workload.micro_batch == (max(answer, 1), 4096) and plan.fits == bool(answer)
    searched = [w.micro_batch[0] for w in measured]
    if answer <= 1:  # one sequence does not fit, or two do not: nothing else is measured
        assert searched == [1, 2][: answer + 1], searched
    assert searched[:2] == [1, 2][: answer + 1] and len(searched) <= 9, searched
    assert plan.fixes == {}


def test_the_largest_micro_batch_stops_at_255_sequences():
    """Short sequences on a large card: 256 sequences would fit, but the search stops below 256."""
    cluster = ClusterShape(8, 80 * GiB, colocated=False)
    assert _plan(cluster, Workload((256, 64))).fits
    _, tokens, plan = largest(CONFIG, cluster, Workload((4, 64)), "micro-batch")
    assert tokens == 255 * 64 and plan.fits and plan.architecture == "qwen3"  # no name: the model type


@pytest.mark.parametrize("card_gib", [7, 7.9, 8.0, 8.35, 8.4, 8.55, 8.6, 8.7, 20])
def test_the_largest_context_is_the_longest_multiple_of_1024_that_fits(card_gib, measured):
    """--largest context for SFT (max_length) at one sequence per micro-batch, up to the model's 16384:
    the binary search's answer is the longest length that fits, every multiple of 1024 planned to check
    (the cards put it at 1, 3, 8, 12 and 16 x 1024, where an off-by-one search goes wrong); none when
    1024 does not fit. 1024 and then at most 4 lengths are measured, judged without advice."""
    cluster = ClusterShape(8, int(card_gib * GiB), colocated=False)
    fitting = [n for n in range(1024, 16385, 1024) if _plan(cluster, Workload((1, n))).fits]
    measured.clear()
    key, length, plan = largest(CONFIG, cluster, Workload((1, 1024)), "context", "wide")
    assert key == "max_length" and length == max(fitting, default=None)
    assert plan.workload.micro_batch == (1, length or 1024) and plan.fits == bool(fitting)
    assert plan.architecture == "wide" and plan.fixes == {}
    assert len(measured) <= (5 if fitting else 1)


@pytest.mark.parametrize("card_gib", [4, 10, 16, 24, 40, 80])
def test_the_largest_model_is_the_largest_qwen3_that_fits(card_gib, measured):
    """--largest model: down the Qwen3 family (largest first), the first whose whole plan fits (every
    model planned to check: separate engines at 4096 tokens, utilization 0.9, on the card); the smallest
    one's plan when none does. Each model is measured once and judged without advice."""
    from tirl.rl.plan import QWEN3, parameter_count

    cluster = ClusterShape(8, card_gib * GiB, colocated=False)
    workload = Workload((1, 4096), engine=ENGINE | {"gpu_memory_utilization": 0.9})
    by_size = sorted(QWEN3, key=lambda a: parameter_count(architecture_config(a)))
    fitting = [a for a in by_size if _plan_of(a, cluster, workload).fits]
    measured.clear()
    key, arch, plan = largest(CONFIG, cluster, workload, "model")
    assert key == "model" and arch == (fitting[-1] if fitting else None)
    assert plan.architecture == (arch or by_size[0]) and plan.fits == bool(fitting) and plan.fixes == {}
    assert len(measured) == len(by_size) - len(fitting) + bool(fitting)


def _plan_of(arch: str, cluster: ClusterShape, workload: Workload):
    config = architecture_config(arch)
    return plan_from(config, cluster, workload, arch, stand_in(config, cluster.gpus, workload))


def test_the_largest_context_of_an_engine_moves_its_max_model_len():
    """With an engine, --largest context searches engine.max_model_len: the engine in the answer's plan
    has that length, as its micro-batch does."""
    cluster = ClusterShape(8, int(8.55 * GiB), colocated=False)
    workload = Workload((1, 1024), engine=ENGINE | {"max_model_len": 1024, "gpu_memory_utilization": 0.9})
    key, length, plan = largest(CONFIG, cluster, workload, "context", "wide")
    assert (key, length) == ("engine.max_model_len", 11264)  # (6 + 11264/16384) x 1.05 + 1.5 <= 8.55 GiB
    assert plan.workload.engine["max_model_len"] == 11264 and plan.workload.micro_batch == (1, 11264)


def test_the_plan_commands_answer_in_one_line():
    """`tirl plan` (and --largest) on a config: its workload planned on the architecture asked for (or
    the config's model), the answer's line naming the key and value, or that nothing fits; an unknown
    --largest is refused with the choices."""
    cfg = load_config(SFTConfig, Path(tirl.__file__).parent / "configs" / "rstar2" / "sft.yaml")
    roomy, tiny = ClusterShape(8, 80 * GiB, colocated=False), ClusterShape(8, GiB, colocated=False)
    assert make_plan(CONFIG, roomy, Workload((1, 1024))).architecture == "qwen3"  # no name: the model type
    plan = plan_for_config(cfg, roomy, "qwen3-0.6b")
    assert plan.architecture == "qwen3-0.6b" and plan.workload.engine is None and plan.fits
    answer, plan = largest_for_config(cfg, roomy, "context", "qwen3-0.6b")
    assert answer == "largest max_length that fits: 40960" and plan.workload.micro_batch[1] == 40960
    assert plan.architecture == "qwen3-0.6b" and cfg.model != "qwen3-0.6b"
    answer, plan = largest_for_config(cfg, tiny, "micro-batch", "qwen3-0.6b")
    assert answer == "nothing fits: not even the smallest optim.micro_batch_tokens (its plan below)"
    assert not plan.fits
    with pytest.raises(ValueError, match=r"--largest width: expected one of micro-batch, context, model"):
        largest(CONFIG, roomy, Workload((1, 1024)), "width")


def test_the_advice_names_the_utilization_the_fix_sets():
    """A KV cache too small where the range that works starts above 0.9 (Qwen3-4B at 122880 tokens on
    29.25 GiB: 0.92-0.94): the advice's utilization is the fix's, inside the range; a utilization at
    either end of the range fits."""
    config = architecture_config("qwen3-4b")
    cluster = ClusterShape(8, int(29.25 * GiB), True, True, transport="group")

    def plan_at(utilization: float):
        engine = ENGINE | {"gpu_memory_utilization": utilization, "max_model_len": 122880}
        return make_plan(config, cluster, Workload((1, 4096), engine=engine), "4b")

    starved = plan_at(0.05)
    assert starved.fixes == {"engine.gpu_memory_utilization": "0.92"}
    assert starved.advice[0].endswith(": set engine.gpu_memory_utilization=0.92")
    assert utilization_range(config, starved) == (0.92, 0.94)
    assert plan_at(0.92).fits and plan_at(0.94).fits and not plan_at(0.95).fits


def test_the_planner_says_what_it_measures_how_long_it_takes_and_what_slows_it(monkeypatch):
    """`tirl plan`'s words before and while it measures (the CLI test checks one real run's first lines)."""
    lora = {"rank": 8}
    assert planner.describe(Workload((2, 16384), lora=lora), 8) == (
        "a training step of 2 x 16384 tokens per micro-batch on rank 0 of 8, gradient checkpointing + LoRA"
    )
    bare = Workload((1, 512), gradient_checkpointing=False)
    assert planner.describe(bare, 1) == "a training step of 1 x 512 tokens per micro-batch on one GPU"
    assert planner.measurement_seconds(CONFIG) == pytest.approx(2.0 + 0.6 * 2)
    assert planner.measurement_seconds(object()) == pytest.approx(2.6)  # no layer count: one layer
    durations = [planner._duration(s) for s in (89.4, 90.0, 150.0, 600.0)]
    assert durations == ["89 s", "1.5 minutes", "2.5 minutes", "10.0 minutes"]
    cfg = load_config(SFTConfig, Path(tirl.__file__).parent / "configs" / "rstar2" / "sft.yaml")
    one, eight = ClusterShape(1, 80 * GiB), ClusterShape(8, 80 * GiB)
    assert planner._slower(eight, cfg) == "" and not cfg.optim.lora.enabled
    slower = "it slower, by far for a large model (docs/memory-plan.md)"
    assert planner._slower(one, cfg) == f"; one GPU makes {slower}"
    lora_on = cfg.optim.model_copy(update={"lora": LoraConfig(enabled=True)})
    with_lora = cfg.model_copy(update={"optim": lora_on})
    assert planner._slower(one, with_lora) == f"; one GPU and LoRA make {slower}"
    assert planner._slower(eight, with_lora) == f"; LoRA makes {slower}"
    said = planner.announce(cfg, one, "qwen3-0.6b", None)
    assert said == (
        "planning qwen3-0.6b (28 layers) on 1 GPU(s) x 80.0 GiB: each measurement runs a training step on "
        "fake tensors (no GPU, no weights), about 19 s on an idle core"
        f"; one GPU makes {slower}; one measurement (and one per fix it tries when it does not fit)"
    )
    said = planner.announce(cfg, eight, "qwen3-0.6b", "context")
    assert said.endswith("on an idle core; one measurement per context it tries (about 6)"), said
    monkeypatch.setattr(planner, "architecture_config", lambda spec: object())  # no layer count known
    assert planner.announce(cfg, eight, "mystery", None).startswith("planning mystery (? layers) on 8 GPU(s)")


def test_a_running_measurement_reports_its_progress_and_a_cached_one_nothing(monkeypatch):
    """Inside `reporting`: 'measuring ...' after a second and every HEARTBEAT_S while it runs, then
    what it found; a measurement back at once (cached) and one outside `reporting` say nothing."""

    def slow(config, world, workload):
        time.sleep(1.35)
        return stand_in(config, world, workload)

    monkeypatch.setattr(planner, "measured", slow)
    monkeypatch.setattr(planner, "HEARTBEAT_S", 0.2)
    workload = Workload((2, 1024))
    lines: list[str] = []
    with planner.reporting(lines.append):
        found = planner._measured(CONFIG, 8, workload)
    assert found == stand_in(CONFIG, 8, workload)
    what = planner.describe(workload, 8)
    assert lines[0] == f"  measuring {what} ... 1 s" and 2 <= len(lines) - 1 <= 3, lines
    assert all(line.startswith(f"  measuring {what} ... ") for line in lines[:-1])
    assert lines[-1] == f"  measured {what}: peak {found.peak / GiB:.1f} GiB (1 s)"

    def quick(config, world, workload):
        time.sleep(0.3)  # under a second: no heartbeat yet, but measured
        return stand_in(config, world, workload)

    monkeypatch.setattr(planner, "measured", quick)
    with planner.reporting(lines.append):
        planner._measured(CONFIG, 8, workload)
    assert lines[-2:] == [lines[-2], f"  measured {what}: peak {found.peak / GiB:.1f} GiB (0 s)"], lines
    assert lines[-2].startswith("  measured"), "no heartbeat within the first second"
    monkeypatch.setattr(planner, "measured", stand_in)
    said = list(lines)
    with planner.reporting(lines.append):
        planner._measured(CONFIG, 8, workload)
    assert lines == said, "a measurement back at once (cached) says nothing"
    assert planner._measured(CONFIG, 8, workload) == found  # no reporting: measured, nothing said
