"""How a rank ends when something outside it fails (issue 46, item 5), proven without a GPU.

NCCL's settings: asserted where ``setup`` hands them to ``init_process_group`` (faked here: the
real NCCL group needs GPUs). The signal watcher and the bounded teardown: small subprocesses whose
main thread is made to block, as a collective waiting for a dead peer blocks it. The same
behaviour with two real gloo ranks is in tests/distributed/test_stall_record.py.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist
from cli import ROOT, env
from conftest import one_line_error

from fastcifar.parallel import distributed

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


def run_script(code: str, *args, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc, time.monotonic() - t0


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


# The watcher's waits, shortened so that each case takes a second or two.
SHORT_WAITS = "signals.HANDLER_WAIT_S = 0.5; signals.STOP_TIMEOUT_S = 1.5\n"


def test_a_sigterm_the_main_thread_cannot_take_is_recorded_and_ends_the_process(tmp_path):
    """The main thread cannot run Python's handler (SIGTERM blocked in it, and asleep for 60 s,
    as a thread in a C++ collective cannot): the watcher records the stop through ``on_blocked``
    and ends the process with 143, as the main thread would have."""
    code = (
        "import os, signal, sys, time\n"
        "from fastcifar.core import signals\n" + SHORT_WAITS + "def record(exc):\n"
        "    open(sys.argv[1], 'w').write(f'{exc} {exc.exit_code}')\n"
        "    print(f'fastcifar: {exc}', file=sys.stderr, flush=True)\n"
        "signals.install(on_blocked=record)\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(60)\n"
    )
    record = tmp_path / "record"
    proc, took = run_script(code, record, timeout=60)
    assert proc.returncode == 143, proc.stderr
    assert record.read_text() == "interrupted by SIGTERM 143"
    assert one_line_error(proc.stderr) == "fastcifar: interrupted by SIGTERM"
    assert took < 30, "ended by the watcher, not by the end of the 60 s sleep"


def test_a_sigterm_whose_clean_up_hangs_still_ends_the_process(tmp_path):
    """The main thread takes the signal but its clean-up never ends (a finally block stuck on the
    GPU): the watcher ends the process after STOP_TIMEOUT_S, with the record and 143."""
    code = (
        "import os, signal, sys, time\n"
        "from fastcifar.core import signals\n"
        + SHORT_WAITS
        + "signals.install(on_blocked=lambda exc: open(sys.argv[1], 'w').write(str(exc)))\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(5)\n"
        "except signals.Interrupted:\n"
        "    time.sleep(60)\n"
    )
    record = tmp_path / "record"
    proc, took = run_script(code, record, timeout=60)
    assert proc.returncode == 143, proc.stderr
    assert record.read_text() == "interrupted by SIGTERM"
    assert took < 30


@pytest.mark.slow  # over 2 s on 2 cores
def test_a_sigterm_the_main_thread_handles_in_time_is_left_to_it(tmp_path):
    """The usual case: the handler runs, the main thread records and finishes, ``restore`` stops
    the watcher, which must neither record nor end the process."""
    code = (
        "import os, signal, sys, time\n"
        "from fastcifar.core import signals\n"
        + SHORT_WAITS
        + "previous = signals.install(on_blocked=lambda exc: open(sys.argv[1], 'w').write('watcher'))\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(5)\n"
        "except signals.Interrupted:\n"
        "    assert signals.claim_ending()\n"
        "signals.restore(previous)\n"
        "time.sleep(2.5)\n"  # past the watcher's waits: it would have ended the process by now
        "print('still here')\n"
    )
    record = tmp_path / "record"
    proc, _ = run_script(code, record, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "still here", proc.stderr
    assert not record.exists()


def test_the_end_stays_claimed_after_restore_and_a_new_api_run_unclaims_it(monkeypatch):
    """After ``main`` claimed the end and restored the handlers, the progress watchdog (still alive
    until the process exits) must stay silent: one line, not two. ``fastcifar.api.train`` installs
    no handlers, so it unclaims the end itself, or a stalled peer would leave its watchdog unable
    to end the rank."""
    from fastcifar import api
    from fastcifar.core import signals
    from fastcifar.core.config import Config

    previous = signals.install()
    assert signals.claim_ending()
    signals.restore(previous)
    assert not signals.claim_ending()  # restore leaves it claimed
    monkeypatch.setattr(distributed, "setup", lambda *args, **kw: (_ for _ in ()).throw(RuntimeError("stop here")))
    with pytest.raises(RuntimeError, match="stop here"):
        api.train(Config())
    assert signals.claim_ending()  # api.train began a new run: unclaimed
    signals.new_run()


@pytest.mark.slow  # over 2 s on 2 cores
def test_a_forked_child_does_not_signal_through_the_parents_wakeup_pipe(tmp_path):
    """A child forked without exec (a worker) inherits the wakeup fd; stopping it with SIGTERM must
    not reach the parent's watcher, which would end a healthy parent with 143."""
    code = (
        "import os, signal, sys, time\n"
        "from fastcifar.core import signals\n"
        + SHORT_WAITS
        + "previous = signals.install(on_blocked=lambda exc: open(sys.argv[1], 'w').write('watcher'))\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    signal.signal(signal.SIGTERM, lambda *a: os._exit(0))\n"
        "    time.sleep(30)\n"
        "    os._exit(1)\n"
        "time.sleep(0.5)\n"
        "os.kill(pid, signal.SIGTERM)\n"
        "os.waitpid(pid, 0)\n"
        "time.sleep(2.5)\n"  # past the watcher's waits
        "signals.restore(previous)\n"
        "print('still here')\n"
    )
    record = tmp_path / "record"
    proc, _ = run_script(code, record, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "still here", proc.stderr
    assert not record.exists()
