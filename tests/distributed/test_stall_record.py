"""A stalled peer under two gloo ranks: the surviving rank records the cause (issue 48, item 9), also
when a SIGTERM reaches it while it is blocked on that peer (issue 46, item 5)."""

from __future__ import annotations

import json
import signal
import time

import pytest
import test_comm as comm_tests
from cli import run_dirs
from conftest import one_line_error


@pytest.mark.slow  # two ranks, one stalled: rank 0 waits out its timeout
def test_two_ranks_a_stalled_peer_leaves_the_cause_in_rank_0s_log_and_summary(learnable_data, tmp_path):
    """Two gloo ranks on the CPU (tests/distributed/test_comm.py's launch); rank 1 stops (SIGSTOP) mid-training.
    Rank 0 ends with exit 3 and one line, by gloo's timeout or by the watchdog, whichever sees it
    first; either way log.txt and summary.json say why."""
    procs = comm_tests.start_long_training(learnable_data, tmp_path)
    procs[1].send_signal(signal.SIGSTOP)
    try:
        code = procs[0].wait(timeout=comm_tests.DIST_TIMEOUT_S + comm_tests.SLACK_S)
    finally:
        procs[1].kill()
        comm_tests.wait_all(procs, timeout=30)
    assert code == 3, comm_tests.read(tmp_path, "stderr0")[-2000:]
    one_line_error(comm_tests.read(tmp_path, "stderr0"))
    (run_dir,) = run_dirs(tmp_path / "runs")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "lost contact with the other ranks" in summary["stopped"], summary
    assert summary["unfinished_run_epochs"], "the epochs finished before the stall are kept"
    last = (run_dir / "log.txt").read_text().splitlines()[-1]
    assert last.startswith("stopped (failed): lost contact with the other ranks"), last


@pytest.mark.slow
def test_a_sigterm_while_blocked_on_a_stopped_peer_is_recorded_and_ends_the_rank(learnable_data, tmp_path):
    """Rank 1 stops (SIGSTOP), so rank 0 blocks in its next gloo collective, where Python cannot run
    a signal handler; torchrun sends the SIGTERM it sends when it stops the ranks. Rank 0 must end
    as an unblocked rank does (one line, exit 143, log.txt and summary.json say "interrupted"),
    within the promised bound (signals.HANDLER_WAIT_S + RECORD_TIMEOUT_S, 15 s; 45 s allowed), long
    before its --dist-timeout-s of 120 s would have freed it."""
    procs = comm_tests.start_long_training(learnable_data, tmp_path, extra=("--dist-timeout-s", "120"))
    procs[1].send_signal(signal.SIGSTOP)
    time.sleep(2)  # rank 0 reaches its next collective: one step takes milliseconds
    procs[0].send_signal(signal.SIGTERM)
    try:
        code = procs[0].wait(timeout=45)
    finally:
        procs[1].kill()
        comm_tests.wait_all(procs, timeout=30)
    assert code == 143, comm_tests.read(tmp_path, "stderr0")[-2000:]
    assert one_line_error(comm_tests.read(tmp_path, "stderr0")) == "fastcifar: interrupted by SIGTERM"
    (run_dir,) = run_dirs(tmp_path / "runs")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["stopped"] == "interrupted by SIGTERM", summary
    assert summary["unfinished_run_epochs"], "the epochs finished before the stop are kept"
    assert (run_dir / "log.txt").read_text().splitlines()[-1] == "stopped (interrupted): interrupted by SIGTERM"
