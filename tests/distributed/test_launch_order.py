"""Start-up order: a real group of one rank on request (--dist-group always), the data fetched and
decoded once per node while the node's other ranks wait (with a bounded, named wait), and two
torchrun launchers (--nnodes 2, c10d rendezvous on 127.0.0.1) equal to one launcher of 2 processes."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from cli import ROOT, SHORT, env, epochs_of, free_port, run_dirs, summary_of
from conftest import tar_folder, write_image_folder, write_official
from safetensors.torch import load_file

from fastcifar.core.errors import DataError
from fastcifar.data import load_dataset
from fastcifar.parallel import distributed
from fastcifar.parallel.distributed import DistContext
from fastcifar.train import main as train_main

CPU = torch.device("cpu")


# ---------------------------------------------------------------------------------------------
# --dist-group always: one rank, a real (gloo) group, gradient buckets and their collectives.


@pytest.mark.slow
def test_one_rank_group_builds_buckets_and_equals_the_run_without_a_group(learnable_data, tmp_path, monkeypatch):
    sizes: list[int] = []
    all_reduce = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        sizes.append(tensor.numel())
        return all_reduce(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", counting)
    monkeypatch.delenv("MASTER_ADDR", raising=False)  # alone: the group gets an in-process store
    args = ["--data", learnable_data, *SHORT, "--epochs", "1", "--subset", "400", "--loader", "torch", "--quiet"]
    runs = {}
    for group in ("auto", "always"):
        out = tmp_path / group
        sizes.clear()
        assert train_main([str(a) for a in (*args, "--out-dir", out, "--dist-group", group)]) == 0
        assert not dist.is_initialized(), "the group is torn down at the end"
        (run_dir,) = run_dirs(out)
        log = (run_dir / "log.txt").read_text()
        runs[group] = (load_file(run_dir / "model.safetensors"), summary_of(out), log, list(sizes))
    weights, summary, log, reduced = runs["always"]
    assert "gradient buckets" in log and "gradient buckets" not in runs["auto"][2]
    assert summary["engine"]["comm"] == "bucketed" and "comm" not in runs["auto"][1]["engine"]
    assert summary["device"]["world_size"] == 1
    steps = 400 // 100 + 1  # the epoch's steps and the warm-up step
    assert len([n for n in reduced if n > 2]) >= steps, f"no bucket all-reduce each step: {reduced}"
    assert not [n for n in runs["auto"][3] if n > 2], "without a group nothing is all-reduced"
    # A sum over one rank divided by 1: the same bits as the run that never communicated.
    assert weights.keys() == runs["auto"][0].keys()
    for name, w in weights.items():
        assert torch.equal(w, runs["auto"][0][name]), f"{name} differs with a group of one"
    assert [e["train_loss"] for e in summary["results"][0]["epochs"]] == [
        e["train_loss"] for e in runs["auto"][1]["results"][0]["epochs"]
    ]


# ---------------------------------------------------------------------------------------------
# load_once_per_node, on one store, each "rank" a thread.


@pytest.fixture
def shared_store(monkeypatch):
    """One in-process store for the threads; each thread numbers its waits as a process would."""
    store = dist.HashStore()
    counters = threading.local()

    def key(name: str) -> str:
        counters.n = getattr(counters, "n", -1) + 1
        return f"test/{counters.n}/{name}"

    monkeypatch.setattr(distributed, "_store", lambda: store)
    monkeypatch.setattr(distributed, "_store_key", key)
    # a fresh process's state: an earlier in-process run may have left this thread's data step done
    monkeypatch.setattr(distributed._data_step, "done", False)
    return store


def ranks(nodes: int, per_node: int) -> list[DistContext]:
    world = nodes * per_node
    return [DistContext(r, world, r % per_node, CPU, "gloo") for r in range(world)]


def in_threads(fn, contexts, timeout=20.0) -> list:
    """fn(ctx) in one thread per context; each result, or the exception it raised. The timeout
    guards against a hang (a wait that should have ended at once), it measures nothing."""
    results: list = [None] * len(contexts)

    def run(i, ctx):
        try:
            results[i] = fn(ctx)
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i, c), daemon=True) for i, c in enumerate(contexts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a rank hung"
    return results


def loading(read, doing="downloading the data", timeout_s=60.0):
    return lambda ctx: distributed.load_once_per_node(lambda first: read(ctx, first), ctx, doing, timeout_s)


def test_local_rank_0_of_each_node_loads_first_and_alone_writes(shared_store):
    events: list = []
    lock = threading.Lock()

    def read(ctx, first: bool):
        if first:
            time.sleep(0.2)  # the others must wait for this, not race it
        with lock:
            events.append((ctx.rank, first))
        return f"data of rank {ctx.rank}"

    assert in_threads(loading(read), ranks(nodes=2, per_node=3)) == [f"data of rank {r}" for r in range(6)]
    assert sorted(r for r, first in events if first) == [0, 3], "one first load per node: its local rank 0"
    for node in (0, 3):
        order = [r for r, _ in events if node <= r < node + 3]
        assert order[0] == node, f"node of rank {node}: {order}, its local rank 0 must finish first"


def test_a_failure_to_load_reaches_every_rank_in_one_line(shared_store):
    def read(ctx, first: bool):
        if ctx.rank == 2:
            raise DataError("data/cifar-10-python.tar.gz: checksum mismatch\nsecond line")
        return "read"

    results = in_threads(loading(read), ranks(nodes=2, per_node=2))  # each waits at most the guard, not 60 s
    assert isinstance(results[2], DataError) and "checksum mismatch" in str(results[2])
    assert all(isinstance(e, DataError) for e in results), results
    detail = "could not load the data: data/cifar-10-python.tar.gz: checksum mismatch"
    assert str(results[3]) == f"local rank 0 of this node (rank 2) {detail}"
    assert str(results[0]) == str(results[1]) == f"rank 2 (local rank 0 of its node) {detail}"


def test_a_rank_that_stops_before_its_data_ends_every_wait_at_once(shared_store):
    """Rank 0 stops before the data (rank 0 alone checks --out-dir): the trainer announces it
    (distributed.announce_stop), and every rank waiting on the store ends within a second with a
    comm failure naming rank 0 and its cause, not after the 60 s data timeout here (600 s in a
    run): its own node's rank waiting for its data, the other node's local rank 0 at the barrier
    after loading, and that node's other rank behind it."""
    contexts = ranks(nodes=2, per_node=2)
    distributed.announce_stop(contexts[0], "--out-dir runs is a file, not a folder\nsecond line")
    results = in_threads(loading(lambda ctx, first: "read"), contexts[1:])
    line = "rank 0 stopped while the ranks were loading their data: --out-dir runs is a file, not a folder"
    for r in results:
        assert isinstance(r, distributed.PeerStopped) and distributed.is_comm_failure(r), results
        assert str(r) == line and distributed.failure_message(r, 300) == line


def test_a_stop_after_the_data_step_ends_no_wait_and_is_not_announced(shared_store):
    """Every rank set its ready key, then one stopped (a setting checked after the data, Ctrl-C):
    a rank still in its last poll returns, it does not report a stop "while loading"; and a rank
    past its data step announces nothing (no one waits for it on the store)."""
    contexts = ranks(nodes=1, per_node=2)

    def load_then_stop(ctx):
        data = distributed.load_once_per_node(lambda first: f"read {ctx.rank}", ctx, "reading the data", 60.0)
        distributed.announce_stop(ctx, "after the data")  # this rank's data step is done: nothing set
        return data

    assert in_threads(load_then_stop, contexts) == ["read 0", "read 1"]
    assert not shared_store.check([distributed._stopped_key()])
    shared_store.set(distributed._stopped_key(), '[0, "late"]')
    keys = ["k/0", "k/1"]
    for k in keys:
        shared_store.set(k, "1")
    assert distributed._wait(shared_store, keys, 5.0, "k/failed", contexts[1]) == []


def test_main_announces_a_ranks_own_error_only(monkeypatch, tmp_path):
    """train.main tells the waiting ranks on a bad setting or data of its own (exit 2) and on a bug
    (the traceback still propagates); not on a peer's failure it only relays (a peer's data error,
    a lost peer: exit 3), nor on an interrupt (torchrun signals every rank)."""
    import fastcifar.train as train_mod
    from fastcifar.core.config import ConfigError
    from fastcifar.core.signals import Interrupted

    announced = []
    ctx = DistContext(0, 2, 0, CPU, "gloo")
    monkeypatch.setattr(distributed, "setup", lambda *a, **kw: ctx)
    monkeypatch.setattr(distributed, "check_same", lambda *a: None)
    monkeypatch.setattr(distributed, "teardown", lambda c: True)
    monkeypatch.setattr(distributed, "announce_stop", lambda c, detail: announced.append((c.rank, detail)))
    argv = ["--data", str(tmp_path), "--out-dir", str(tmp_path / "runs"), *SHORT]
    for raised, code, told in (
        (ConfigError("--out-dir is a file"), 2, True),
        (DataError("no such file"), 2, True),
        (distributed.PeerDataError("rank 1 could not load the data"), 2, False),
        (Interrupted(15), 143, False),
        (distributed.PeerStopped("rank 1 stopped"), 3, False),
        (KeyError("bug"), None, True),
    ):
        announced.clear()

        def run(cfg, c, raised=raised):
            raise raised

        monkeypatch.setattr(train_mod, "run", run)
        if code is None:
            with pytest.raises(KeyError):
                train_main(argv)
            assert announced == [(0, "KeyError: 'bug'")]
            continue
        assert train_main(argv) == code
        assert announced == ([(0, str(raised))] if told else []), (raised, announced)


def test_a_wait_for_local_rank_0_runs_out_with_its_cause(shared_store):
    release = threading.Event()

    def load(ctx):
        def read(first: bool):
            if first:
                release.wait(30)
            return "read"

        try:
            return distributed.load_once_per_node(read, ctx, "downloading or reading the data", timeout_s=0.5)
        finally:
            release.set()  # the waiting rank gave up: let local rank 0 finish

    leader, other = in_threads(load, ranks(nodes=1, per_node=2))
    assert isinstance(other, DataError)
    assert str(other).startswith(
        "local rank 0 of this node (rank 0) is still downloading or reading the data "
        "after 0.5 s; a slower link or disk needs a larger --dist-timeout-s"
    ), other
    assert isinstance(leader, DataError) and str(leader).startswith("rank 1 could not load the data"), leader


def test_the_wait_for_every_rank_names_those_still_loading(shared_store):
    late = in_threads(loading(lambda ctx, first: "read", timeout_s=0.5), ranks(nodes=2, per_node=2)[:2])
    assert all(
        isinstance(e, DataError) and str(e).startswith("rank(s) 2, 3 still without their data after 0.5 s")
        for e in late
    ), late  # ranks 2 and 3, the other node, never came


def test_a_rank_that_does_not_write_reads_the_cache_and_never_makes_one(tmp_path, monkeypatch):
    archive = tar_folder(write_image_folder(tmp_path / "imgs")[0], tmp_path / "imgs.tar.gz", "imgs")
    cache = tmp_path / "cache"
    read_only = load_dataset(archive, cache_dir=cache, log=lambda m: None, write=False)
    assert not cache.exists(), "a rank that is not its node's local rank 0 wrote the cache"
    first = load_dataset(archive, cache_dir=cache, log=lambda m: None, write=True)
    (made,) = cache.iterdir()
    import fastcifar.data.folder as folder

    monkeypatch.setattr(folder, "_decode_tree", lambda *a: pytest.fail("decoded again instead of reading the cache"))
    again = load_dataset(archive, cache_dir=cache, log=lambda m: None, write=False)
    assert list(cache.iterdir()) == [made]
    for ds in (first, again):
        assert (ds.train_images == read_only.train_images).all() and (ds.test_labels == read_only.test_labels).all()
    with pytest.raises(DataError, match="still no data after local rank 0 of this node fetched it"):
        load_dataset(tmp_path / "missing", download_missing=True, write=False)


# ---------------------------------------------------------------------------------------------
# Two nodes on this machine: two torchrun launchers with c10d rendezvous, against one launcher.

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "fetch_worker.py"


def launch(torchrun: list[str], data: Path, out: Path, fetch_log: Path, archive: Path) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *torchrun,
        str(WORKER),
        "--data",
        str(data),
        "--download",
        "--out-dir",
        str(out),
        *SHORT,
        "--epochs",
        "1",
        "--subset",
        "800",
        "--loader",
        "torch",
        "--quiet",
    ]
    e = dict(env(), FAKE_ARCHIVE=str(archive), FETCH_LOG=str(fetch_log))
    return subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(procs: list[subprocess.Popen], timeout: float = 240) -> list[tuple[int, str]]:
    deadline, done = time.monotonic() + timeout, []
    try:
        for p in procs:
            _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            done.append((p.returncode, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return done


@pytest.mark.slow  # two launchers of two ranks, then one of two, each training
def test_two_nodes_equal_one_node_of_two_and_fetch_once_per_node(tmp_path):
    folder, _ = write_official(tmp_path / "src", per_batch=200, n_test=400)
    archive = tar_folder(folder, tmp_path / "official.tar.gz", "cifar-10-batches-py")

    one_log = tmp_path / "one-node-fetches.txt"
    one = launch(
        ["--standalone", "--nproc_per_node", "2"],
        tmp_path / "one" / "data",
        tmp_path / "one" / "runs",
        one_log,
        archive,
    )
    ((code, err),) = finish([one])
    assert code == 0, err[-3000:]

    # Each launcher its own --data (as separate machines would have), one shared --out-dir: only
    # rank 0, on whichever node the rendezvous made first, writes.
    two_log, port = tmp_path / "two-node-fetches.txt", free_port()
    rdzv = [
        "--nnodes",
        "2",
        "--nproc_per_node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "fastcifar-test",
    ]
    nodes = [
        launch(rdzv, tmp_path / f"node{n}" / "data", tmp_path / "two" / "runs", two_log, archive) for n in range(2)
    ]
    for code, err in finish(nodes):
        assert code == 0, err[-3000:]

    epochs = []
    for out in (tmp_path / "two" / "runs", tmp_path / "one" / "runs"):
        s = summary_of(out)
        assert s["device"]["world_size"] == 2 and s["per_rank_batch"] == 50
        epochs.append(epochs_of(s))
    assert epochs[0] == epochs[1]
    one_fetches = one_log.read_text().splitlines()
    assert len(one_fetches) == 1 and one_fetches[0].startswith("rank 0 local 0"), one_fetches
    two_fetches = sorted(two_log.read_text().splitlines())
    assert [f.split(" node ")[0] for f in two_fetches] == ["rank 0 local 0", "rank 1 local 0"], two_fetches
    assert {f.split(" node ")[1] for f in two_fetches} == {"0", "1"}, "one fetch on each node"
    assert all((tmp_path / f"node{n}" / "data" / "cifar-10-python.tar.gz").is_file() for n in range(2))
