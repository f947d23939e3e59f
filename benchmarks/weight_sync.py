"""Weight sync trainer -> engine across processes: bucketed streaming vs the full state dict.

Two processes on this machine, one gloo group between them (what the `ray` runtime forms between
trainer rank 0 and each engine actor): the sender holds the policy, the receiver an HFEngine
serving the same model. Per model preset, side by side:
  - full-state: the sender materialises the whole state dict, ships it as one object, the
    receiver loads it (what handing `full_model_state` to a remote engine amounts to);
  - bucketed: tirl.distributed.weight_sync streams named parameters in size-bounded buckets.
and, for reference, today's in-process path of the `local` runtime (state dict -> load_weights in
the same process, no transport). Prints seconds per sync (median), MB/s, and the bytes the sender
stages beyond its own parameters (full state + its pickle vs one bucket).

    python benchmarks/weight_sync.py [--presets tiny small] [--repeats 5] [--bucket-mb 1 16]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tirl.distributed.weight_sync import SyncGroup, broadcast_pickled, free_port, receive_into, send_weights


def _engine(model_dir: str):
    from tirl.engines.config import EngineConfig
    from tirl.engines.hf import HFEngine

    return HFEngine(EngineConfig(model=model_dir, device="cpu", max_model_len=256, max_batch_size=1))


def _receiver(model_dir: str, conn) -> None:
    torch.set_num_threads(1)
    engine = _engine(model_dir)
    cpu = torch.device("cpu")
    conn.send("ready")
    while (job := conn.recv()) is not None:
        method, group = job
        start = time.perf_counter()
        if method == "full":
            pg = group.join(1)
            state = broadcast_pickled(pg, None, cpu)
            engine.load_weights(state.items())
        else:
            receive_into(group, 1, engine.load_weights, cpu)
        conn.send(time.perf_counter() - start)
    conn.send(_checksum(engine.model))


def _checksum(model: torch.nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def _sync(model: torch.nn.Module, method: str, bucket_bytes: int, conn) -> float:
    group = SyncGroup("127.0.0.1", free_port(), 2)
    conn.send((method, group))
    start = time.perf_counter()
    pg = group.join(0)
    if method == "full":
        state = {n: p.detach().clone() for n, p in model.named_parameters()}  # the materialised copy
        broadcast_pickled(pg, state, torch.device("cpu"))
    else:
        send_weights(model, pg, bucket_bytes, torch.device("cpu"))
    conn.recv()  # the receiver has loaded everything
    return time.perf_counter() - start


def bench_preset(preset: str, repeats: int, bucket_mbs: list[float]) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from tirl.tiny_model import create_tiny_model

    model_dir = create_tiny_model(Path(tempfile.mkdtemp()) / preset, preset=preset, seed=0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():  # different weights from the receiver's, so a sync really changes them
        for p in model.parameters():
            p.add_(0.01)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())

    # today's local path: the engine in the same process
    local = _engine(str(model_dir))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        local.load_weights((n, state[n]) for n, _ in model.named_parameters())
        times.append(time.perf_counter() - start)
    rows = [{"preset": preset, "method": "in-process (local runtime)", "s": statistics.median(times),
             "bytes": nbytes, "staged": nbytes}]  # fmt: skip

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(str(model_dir), child))
    proc.start()
    assert parent.recv() == "ready"
    methods = [("full", 0, "full state, one object")]
    methods += [("bucketed", int(mb * 2**20), f"bucketed {mb:g} MB") for mb in bucket_mbs]
    for method, bucket, label in methods:
        times = [_sync(model, method, bucket, parent) for _ in range(repeats)]
        staged = 2 * nbytes if method == "full" else min(bucket, nbytes)  # copy + pickle vs one bucket
        rows.append({"preset": preset, "method": label, "s": statistics.median(times), "bytes": nbytes,
                     "staged": staged})  # fmt: skip
    parent.send(None)
    remote = parent.recv()
    proc.join()
    if abs(remote - _checksum(model)) > 1e-3 * max(1.0, abs(remote)):
        raise SystemExit(f"{preset}: the engine's weights differ from the trainer's after the syncs")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["tiny", "small"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bucket-mb", nargs="+", type=float, default=[1.0, 16.0])
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"weight sync, CPU (gloo over loopback), median of {args.repeats}")
    print("| preset | method | params MB | s / sync | MB/s | sender staging MB | speed vs full state |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for preset in args.presets:
        rows = bench_preset(preset, args.repeats, args.bucket_mb)
        full = next(r["s"] for r in rows if r["method"].startswith("full"))
        for r in rows:
            mb = r["bytes"] / 2**20
            print(f"| {r['preset']} | {r['method']} | {mb:.1f} | {r['s']:.4f} | {mb / r['s']:.0f} | "
                  f"{r['staged'] / 2**20:.1f} | {full / r['s']:.2f}x |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
