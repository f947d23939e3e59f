"""Weight sync trainer -> engine worker on CPU: today's path side by side with the previous one.

Two processes (the trainer rank 0, the engine's worker) and a model of a realistic size (a Qwen3
config of ~0.75 B parameters by default, untied, fp32 on the trainer as FSDP keeps it; the engine
holds bf16, as vLLM does on a GPU). Per path: seconds per sync, bytes moved, copies made, seconds per
GB of parameters, and the 14B projection at NVLink / InfiniBand bandwidths from the same byte counts.

  previous (group):  fp32 buckets over gloo -> the actor process -> per bucket a safetensors file in
                     /dev/shm -> the worker reads it -> reload (cast to bf16) into the parameters
  now (group):       bf16 buckets (cast while packing) over the sync group joined inside the worker
                     -> one reload into the parameters
  previous (local):  fp32 safetensors file in /dev/shm -> read by the worker -> reload
  now (local):       one flat bf16 buffer mapped by the worker (no read copy) -> reload

The group rows use gloo over loopback (what NCCL replaces on GPUs); the reload is a copy_ into
preallocated bf16 tensors of the same shapes (vLLM's in-place reload is that copy per tensor).

    python benchmarks/weight_sync.py [--layers 28 --hidden 1024 --intermediate 3072] [--repeats 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tirl.distributed.weight_sync import SyncChannel, SyncGroup, receive_stream, send_weights
from tirl.engines.handoff import flat_handoff, pack_flat, unpack_flat
from tirl.engines.vllm import flat_plan
from tirl.ports import free_port

BUCKET = 512 * 2**20  # the recipe's bucket size
QWEN3_14B_PARAMS = 14_768_307_200  # the meta-device count (tests/runtime/test_weight_sync.py)
LINKS = {  # achievable one-way bandwidth, GB/s (1e9 bytes)
    "NVLink 4 (H100, NCCL broadcast)": 360.0,
    "InfiniBand NDR 400 Gb/s (one NIC)": 45.0,
    "TCP over 100 GbE (gloo, previous path)": 10.0,
}


def _model(layers: int, hidden: int, intermediate: int, materialise: bool = True) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=intermediate,
        vocab_size=151936,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if not materialise:
        return model  # shapes only
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.05, 0.05)
    return model


def _engine_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The engine's weights: same shapes, bf16."""
    return {n: torch.empty(p.shape, dtype=torch.bfloat16) for n, p in model.named_parameters()}


def _reload(params: dict[str, torch.Tensor], pairs) -> None:
    for name, t in pairs:
        params[name].copy_(t)


def _worker(layers: int, hidden: int, intermediate: int, conn) -> None:
    """The engine's worker: receives by the path the parent names, loads into bf16 parameters."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    params = _engine_params(_model(layers, hidden, intermediate, materialise=False))
    conn.send("ready")
    channel: SyncChannel | None = None
    while (job := conn.recv()) is not None:
        path, arg = job
        if path in ("join", "leave"):  # the persistent group: joined once, reused by every sync
            if channel is not None:
                channel.close()
            channel = SyncChannel(arg, 1) if path == "join" else None
            continue
        start = time.perf_counter()
        if path == "group-now":
            _reload(params, receive_stream(channel.pg, torch.device("cpu")))
        elif path == "group-previous":
            from tirl.distributed.weight_sync import receive_weights

            for pairs in receive_weights(channel.pg, torch.device("cpu")):  # per bucket: file, read, reload
                with tempfile.TemporaryDirectory(dir="/dev/shm") as tmp:
                    file = os.path.join(tmp, "w.safetensors")
                    save_file({n: t.contiguous() for n, t in pairs}, file)
                    with safe_open(file, framework="pt") as f:
                        _reload(params, ((n, f.get_tensor(n)) for n in f.keys()))  # noqa: SIM118
        elif path == "local-previous":
            with safe_open(arg, framework="pt") as f:
                _reload(params, ((n, f.get_tensor(n)) for n in f.keys()))  # noqa: SIM118
        elif path == "local-now":
            file, nbytes, plan = arg
            _reload(
                params, unpack_flat(torch.from_file(file, shared=False, size=nbytes, dtype=torch.uint8), plan)
            )
        conn.send(time.perf_counter() - start)
    conn.send(float(sum(p.double().sum() for p in params.values())))


def _run(parent, path: str, model: torch.nn.Module, channel: SyncChannel | None) -> float:
    """Seconds for one sync, from the sender starting until the worker loaded everything."""
    from safetensors.torch import save_file

    start = time.perf_counter()
    if path.startswith("group"):
        parent.send((path, None))
        dtype = torch.bfloat16 if path == "group-now" else None  # previous: fp32 as trained
        send_weights(model, channel.pg, BUCKET, torch.device("cpu"), dtype)
        parent.recv()
    elif path == "local-previous":
        with tempfile.TemporaryDirectory(dir="/dev/shm") as tmp:
            file = os.path.join(tmp, "weights.safetensors")
            save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, file)
            parent.send((path, file))
            parent.recv()
    else:  # local-now: the runtime's own packing (tirl.engines.handoff.flat_handoff, on the host)
        tensors = list(model.named_parameters())
        plan, nbytes = flat_plan(tensors, torch.bfloat16)
        with flat_handoff(plan, nbytes, torch.device("cpu")) as handoff:
            pack_flat(tensors, plan, handoff.buf)
            parent.send((path, (handoff.path, nbytes, plan)))
            parent.recv()
    return time.perf_counter() - start


# (path, bytes per parameter moved, copies of the whole model made: sender pack/serialise, transport,
# file write, file read, reload into the parameters)
PATHS = {
    "group-previous": ("previous: fp32 group -> actor -> shm file per bucket -> worker", 4,
                       "pack, gloo, file write, file read, reload = 5"),
    "group-now": ("now: bf16 group inside the worker, one reload", 2, "pack+cast, gloo, reload = 3"),
    "local-previous": ("previous local: fp32 safetensors in /dev/shm", 4, "file write, file read, reload = 3"),
    "local-now": ("now local: flat bf16 buffer mapped by the worker", 2, "pack+cast into the mapping, reload = 2"),
}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=3072)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    shape = (args.layers, args.hidden, args.intermediate)
    model = _model(*shape)
    n = sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)  # different weights from the worker's, so a sync really changes them

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_worker, args=(*shape, child))
    proc.start()
    assert parent.recv() == "ready"
    rows = []
    for path in PATHS:
        channel = None
        if path.startswith("group"):  # one persistent group per path, joined by both ends at once
            group = SyncGroup("127.0.0.1", free_port(), 2, "gloo")
            parent.send(("join", group))
            channel = SyncChannel(group, 0)
        times = [_run(parent, path, model, channel) for _ in range(args.repeats)]
        if channel is not None:
            parent.send(("leave", None))
            channel.close()
        rows.append((path, statistics.median(times)))
    parent.send(None)
    remote = parent.recv()
    proc.join()
    want = float(sum(p.detach().to(torch.bfloat16).double().sum() for p in model.parameters()))
    if abs(remote - want) > 1e-3 * max(1.0, abs(want)):
        raise SystemExit(
            f"the worker's weights differ from the trainer's after the syncs ({remote} vs {want})"
        )
    _report(rows, n, args.repeats)


def _report(rows: list[tuple[str, float]], n: int, repeats: int) -> None:
    gb = 2 * n / 1e9  # the engine's bf16 bytes: "GB of model" below
    print(
        f"weight sync on CPU, {n / 1e9:.2f} B parameters ({gb:.2f} GB in bf16), median of {repeats}, "
        f"buckets {BUCKET >> 20} MiB"
    )
    print("| path | bytes moved (GB) | whole-model copies | s / sync | s / GB of model | vs previous |")
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    base = dict(rows)
    for path, s in rows:
        label, per_param, copies = PATHS[path]
        previous = base["group-previous" if path.startswith("group") else "local-previous"]
        print(
            f"| {label} | {per_param * n / 1e9:.2f} | {copies} | {s:.2f} | {s / gb:.2f} | "
            f"{previous / s:.2f}x |"
        )
    print(
        f"\nQwen3-14B ({QWEN3_14B_PARAMS / 1e9:.2f} B parameters): bytes on the wire per sync and link time"
    )
    for per_param, what in ((2, "bf16 (now)"), (4, "fp32 (previous)")):
        size = per_param * QWEN3_14B_PARAMS / 1e9
        times = ", ".join(f"{name}: {size / bw:.2f} s" for name, bw in LINKS.items())
        print(f"- {what}: {size:.1f} GB; {times}")


if __name__ == "__main__":
    from tirl.lifetime import children_die_with_me

    children_die_with_me()  # its engines, sandboxes and workers die with it, even on kill -9
    main()
