"""fastcifar.parallel.distributed, proven without a GPU: which device each local rank gets (CUDA
mocked, a machine of 1 or 2 GPUs; --share-gpu, the test harness's several ranks on one GPU, which
--help leaves out), NCCL's failure settings (asserted where ``setup`` hands them to
``init_process_group``, faked: the real NCCL group needs GPUs), and the bounded teardown (a
subprocess whose process group cannot be destroyed). Two real gloo ranks: tests/distributed/."""

from __future__ import annotations

import datetime
import os
import threading

import pytest
import torch
import torch.distributed as dist
from cli import run_script
from conftest import one_line_error
from gpus import fake_gpus

from fastcifar.core.config import Config, ConfigError
from fastcifar.core.options import parse_args
from fastcifar.parallel import distributed
from fastcifar.parallel.distributed import pick_device

SHARED = Config(share_gpu=True)


@pytest.fixture
def gpus(monkeypatch):
    """gpus(n): CUDA with n devices (H100s); returns the list of indices ``set_device`` was called with."""
    return lambda n: fake_gpus(monkeypatch, n)


@pytest.mark.parametrize("settings", [None, Config()])
def test_each_local_rank_gets_its_own_gpu_and_one_without_is_refused(gpus, monkeypatch, settings):
    monkeypatch.setenv("FASTCIFAR_SHARE_GPU", "1")  # the former switch: no environment variable shares a GPU
    chosen = gpus(2)
    assert [pick_device("auto", r, settings) for r in (0, 1)] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert chosen == [0, 1]
    with pytest.raises(ConfigError) as err:
        pick_device("cuda", 2, settings)
    assert str(err.value) == "local rank 2 has no GPU: this machine has 2"
    assert chosen == [0, 1], "a refused rank selects no device"


def test_shared_gpus_take_the_local_ranks_in_turn(gpus):
    chosen = gpus(1)
    assert [pick_device("cuda", r, SHARED) for r in range(3)] == [torch.device("cuda", 0)] * 3 and chosen == [0, 0, 0]
    chosen = gpus(2)
    assert [pick_device("auto", r, SHARED).index for r in range(4)] == [0, 1, 0, 1] and chosen == [0, 1, 0, 1]


def test_sharing_changes_nothing_on_the_cpu_or_without_a_gpu(gpus):
    chosen = gpus(0)
    assert pick_device("auto", 3, SHARED) == torch.device("cpu") and pick_device("cpu", 3, SHARED) == torch.device(
        "cpu"
    )
    with pytest.raises(ConfigError, match="PyTorch sees no CUDA GPU"):
        pick_device("cuda", 0, SHARED)
    assert chosen == []


def test_the_switch_is_a_flag_that_help_leaves_out(capsys):
    assert parse_args(["--share-gpu"]).share_gpu and not parse_args([]).share_gpu
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    assert "--share-gpu" not in capsys.readouterr().out


NCCL_VARS = (
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCH_NCCL_BLOCKING_WAIT",
    "TORCH_NCCL_DUMP_ON_TIMEOUT",
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC",
    "TORCH_NCCL_TRACE_BUFFER_SIZE",
)


def fake_group(monkeypatch, device: str) -> list[dict]:
    """``setup`` on a 2-rank launch with ``device``, ``init_process_group`` replaced by a recorder of
    the environment and timeout it is called with."""
    seen = []

    def init_process_group(backend, timeout, **kwargs):
        seen.append({"backend": backend, "timeout": timeout, "env": {k: os.environ.get(k) for k in NCCL_VARS}})

    monkeypatch.setattr(
        distributed,
        "pick_device",
        lambda requested, local_rank, *_, **__: torch.device(device, 0) if device == "cuda" else torch.device("cpu"),
    )
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    for k, v in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    return seen


def test_nccl_gets_its_failure_handling_before_the_group_exists_and_a_later_timeout(monkeypatch):
    """What torchrun sets (async error handling 1: NCCL's watchdog kills the process) is overridden
    before ``init_process_group``, and NCCL's timeout comes after the progress watchdog's."""
    for k in NCCL_VARS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # torchrun's
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")
    seen = fake_group(monkeypatch, "cuda")
    ctx = distributed.setup("cuda", timeout_s=30.0)
    assert ctx.backend == "nccl" and len(seen) == 1
    assert seen[0]["env"] == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
        "TORCH_NCCL_BLOCKING_WAIT": "0",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
        "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "1000",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": None,
    }
    assert seen[0]["timeout"] == datetime.timedelta(seconds=30.0 + distributed.NCCL_TIMEOUT_MARGIN_S)
    # later than the watchdog by more than its poll and its record bound
    assert distributed.NCCL_TIMEOUT_MARGIN_S > 1.0 + distributed.RECORD_TIMEOUT_S


def test_a_users_flight_recorder_dump_is_kept(monkeypatch):
    for k in NCCL_VARS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    seen = fake_group(monkeypatch, "cuda")
    distributed.setup("cuda", timeout_s=30.0)
    assert seen[0]["env"]["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert seen[0]["env"]["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    assert seen[0]["env"]["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"] is None  # the dump's own wait, as torch sets it


def test_gloo_keeps_its_timeout_and_sets_no_nccl_variable(monkeypatch):
    for k in NCCL_VARS:
        monkeypatch.delenv(k, raising=False)
    seen = fake_group(monkeypatch, "cpu")
    distributed.setup("cpu", timeout_s=30.0)
    assert seen[0]["backend"] == "gloo" and seen[0]["timeout"] == datetime.timedelta(seconds=30.0)
    assert seen[0]["env"] == dict.fromkeys(NCCL_VARS)


def test_an_nccl_abort_is_a_lost_peer_not_a_crash():
    """With async error handling 2, a timed-out collective's communicators are aborted and the main
    thread's next collective raises this: it must take the one-line, exit-3 path."""
    exc = dist.DistBackendError(
        "NCCL communicator was aborted on rank 1. Original reason for failure was: "
        "Watchdog caught collective operation timeout"
    )
    assert distributed.is_comm_failure(exc)
    assert distributed.failure_message(exc, 30).startswith("lost contact with the other ranks")


@pytest.fixture
def group(monkeypatch):
    """A distributed context whose ``destroy_process_group`` is replaced by ``group.destroy``."""

    class Group:
        ctx = distributed.DistContext(0, 2, 0, torch.device("cpu"), "gloo")
        destroy = None

    g = Group()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: g.destroy())
    monkeypatch.setattr(distributed, "TEARDOWN_TIMEOUT_S", 0.5)
    return g


def test_teardown_returns_when_the_destroy_hangs(group):
    release = threading.Event()
    group.destroy = release.wait  # blocked, as on a collective in flight
    try:
        assert distributed.teardown(group.ctx) is False
    finally:
        release.set()


def test_teardown_of_a_healthy_group_destroys_it_and_passes_its_errors_on(group):
    calls = []
    group.destroy = lambda: calls.append("destroyed")
    assert distributed.teardown(group.ctx) is True and calls == ["destroyed"]

    def fails():
        raise RuntimeError("destroy failed")

    group.destroy = fails
    with pytest.raises(RuntimeError, match="destroy failed"):
        distributed.teardown(group.ctx)


def test_main_ends_with_the_runs_status_when_the_teardown_hangs(tmp_path):
    """A stopped run (SIGTERM, 143) whose process group cannot be destroyed: ``main`` gives the
    destroy its bound, then ends the process with the run's status; it does not wait on an
    interpreter exit that the stuck group would block (emulated: an exit hook that never returns)."""
    code = (
        "import atexit, signal, sys, threading, time, torch\n"
        "import torch.distributed as dist\n"
        "from fastcifar import train\n"
        "from fastcifar.core import signals\n"
        "from fastcifar.parallel import distributed\n"
        "distributed.TEARDOWN_TIMEOUT_S = 0.5\n"
        "ctx = distributed.DistContext(0, 2, 0, torch.device('cpu'), 'gloo')\n"
        "train.distributed.setup = lambda device, timeout, group, settings=None: ctx\n"
        "train.distributed.check_same = lambda *args, **kwargs: None\n"
        "def run(cfg, ctx):\n"
        "    raise signals.Interrupted(signal.SIGTERM)\n"
        "train.run = run\n"
        "dist.is_initialized = lambda: True\n"
        "dist.destroy_process_group = threading.Event().wait\n"
        "atexit.register(time.sleep, 600)\n"
        "sys.exit(train.main(['--data', sys.argv[1], '--device', 'cpu']))\n"
    )
    proc, _ = run_script(code, tmp_path, timeout=60)  # the timeout only guards against the hang itself
    assert proc.returncode == 143, proc.stderr
    assert one_line_error(proc.stderr) == "fastcifar: interrupted by SIGTERM"
