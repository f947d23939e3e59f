"""Weight-transfer files and directories under races, checked by what a reader (an engine worker, an
inference server) finds inside them: the tensors of its own sync, whole, and nothing left behind after.
The races are made by construction (a barrier the writers meet at while their files exist, a held lock
the syncing threads queue on), never by sleeping."""

from __future__ import annotations

import multiprocessing
import threading
from pathlib import Path

import torch
from safetensors.torch import load_file
from tests.forking import one_thread_after_fork

from tirl.engines.config import EngineConfig, RemoteServers
from tirl.engines.handoff import flat_handoff, flat_layout, pack_flat, unpack_flat
from tirl.engines.remote import ServerFleet


def _tensors(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [("a.weight", torch.randn(64, 32, generator=g)), ("b.bias", torch.randn(7, generator=g))]


def _sync_through_shm(seed: int, barrier, paths, done) -> None:
    """One trainer's sync: its transfer file held open until both trainers' files exist and the reader
    has read them (as an engine worker maps it by path while the sync waits)."""
    one_thread_after_fork()
    weights = _tensors(seed)
    plan, nbytes = flat_layout(((n, tuple(t.shape), t.dtype) for n, t in weights), torch.float32)
    with flat_handoff(plan, nbytes, torch.device("cpu")) as handoff:
        pack_flat(weights, plan, handoff.buf)
        paths.put((seed, handoff.path, nbytes, plan))
        barrier.wait(timeout=120)  # both files exist at once
        done.wait(timeout=120)  # the reader has read both


def test_two_syncs_at_once_each_reader_maps_its_own_whole_file_and_none_is_left(tmp_path, monkeypatch):
    """Two trainers on one host syncing into one transfer directory at the same moment: a reader in a
    third process maps each by its path and finds exactly that trainer's tensors; after both syncs the
    directory is empty. The processes are spawned, not forked: a fork from the suite's process, which by
    then holds other tests' threads, could copy a lock some thread held and hang the child at exit."""
    monkeypatch.setenv("TIRL_WEIGHTS_DIR", str(tmp_path))
    # a spawned child imports this module by name, on the parent's sys.path: put the repository there
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))
    ctx = multiprocessing.get_context("spawn")
    barrier, paths, done = ctx.Barrier(2), ctx.Queue(), ctx.Event()
    writers = [ctx.Process(target=_sync_through_shm, args=(seed, barrier, paths, done)) for seed in (1, 2)]
    for w in writers:
        w.start()
    syncs = [paths.get(timeout=120) for _ in writers]
    assert len({path for _, path, _, _ in syncs}) == 2 and all(
        Path(p).parent == tmp_path for _, p, _, _ in syncs
    )
    reader = ctx.Pool(1, initializer=one_thread_after_fork)
    try:
        for seed, path, nbytes, plan in syncs:
            got = dict(reader.apply(_read_flat, (path, nbytes, plan)))
            assert got.keys() == {"a.weight", "b.bias"}
            assert all(torch.equal(got[name], t) for name, t in _tensors(seed))
    finally:
        reader.close()
        done.set()
        reader.join()
    for w in writers:
        w.join(timeout=300)
        assert w.exitcode == 0
    assert list(tmp_path.iterdir()) == []


def _read_flat(path: str, nbytes: int, plan) -> list[tuple[str, torch.Tensor]]:
    """What an engine worker does with a host handoff: map the file by its path, read the tensors."""
    buf = torch.from_file(path, shared=False, size=nbytes, dtype=torch.uint8)
    return [(name, t.clone()) for name, t in unpack_flat(buf, plan)]


def test_servers_syncing_at_once_share_one_whole_weights_dir_and_the_old_one_goes(
    tiny_model_dir, tmp_path, monkeypatch
):
    """Every server's load_weights runs in its own thread (Runtime.load_weights): four of them start
    together for each of two syncs, and a writer waits for a second writer to join it mid-write (which
    only the fleet's lock keeps out). Each sync leaves one directory whose safetensors a server reloads
    with that sync's tensors; the previous sync's is gone, and no .partial is left."""
    import tirl.engines.remote as remote

    cfg = EngineConfig(
        backend="remote",
        model=str(tiny_model_dir),
        remote=RemoteServers(urls=["http://x"], weights_dir=str(tmp_path)),
    )
    fleet = ServerFleet()
    writing, joined = [], threading.Event()
    real_save = remote.save_checkpoint

    def save_waiting_for_company(weights, target, tied) -> None:
        writing.append(target)
        if len(writing) > 1:
            joined.set()
        joined.wait(timeout=1)  # a second writer, if the lock lets one in, arrives here at once
        real_save(weights, target, tied)

    monkeypatch.setattr(remote, "save_checkpoint", save_waiting_for_company)
    for seed in (1, 2):
        weights = _tensors(seed)
        got: list[str] = []
        writing.clear()
        started = threading.Barrier(4)

        def load(weights=weights, started=started, got=got) -> None:
            started.wait(timeout=60)
            got.append(fleet.write_weights(cfg, weights))

        threads = [threading.Thread(target=load) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert len(got) == 4 and len(set(got)) == 1 and len(writing) == 1, (got, writing)
        assert [p.name for p in tmp_path.iterdir()] == [Path(got[0]).name]  # the last sync's only
        assert [p.name for p in Path(got[0]).iterdir()] == ["model.safetensors"]  # one file, no .partial
        read = load_file(str(Path(got[0]) / "model.safetensors"))
        assert read.keys() == dict(weights).keys() and all(torch.equal(read[n], t) for n, t in weights)
    assert fleet.syncs == 2
