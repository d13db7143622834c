"""Two CPU ranks under torchrun (gloo) through the stock DistributedDataParallel path."""

from __future__ import annotations

import sys

import forkserver
import pytest
from cli import SHORT, run_dirs, run_train, summary_of, torchrun

pytestmark = pytest.mark.slow


def test_two_ranks_ddp_learns_and_only_rank0_reports(learnable_data, tmp_path):
    out = tmp_path / "runs"
    proc = run_train(
        ["--data", learnable_data, "--out-dir", out, *SHORT, "--comm", "ddp"], launcher=torchrun(), timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(run_dirs(out)) == 1, "only rank 0 writes files"
    s = summary_of(out)
    assert s["device"]["world_size"] == 2 and s["per_rank_batch"] == 50
    assert s["summary"]["acc_mean"] > 60.0
    assert proc.stdout.count("run 1: test_acc") == 1, "only rank 0 prints"
    assert "Warning" not in proc.stderr, proc.stderr[-2000:]  # was: broadcast_buffers deprecated, every rank


def test_batch_that_does_not_divide_fails_on_every_rank(learnable_data, tmp_path):
    proc = run_train(
        ["--data", learnable_data, "--out-dir", tmp_path / "runs", *SHORT, "--batch-size", "101"],
        launcher=torchrun(),
        timeout=300,
    )
    assert proc.returncode != 0
    assert proc.stderr.count("does not divide over 2 ranks") == 2, proc.stderr[-2000:]


def test_progress_watchdog_ends_a_stuck_rank_in_one_line():
    """A rank whose loop stops making progress (blocked in a graph replay waiting for a stalled
    peer, say) is ended by the watchdog with exit 3; one that keeps beating is left alone."""

    from cli import ROOT, env

    code = (
        "import time, torch; from fastcifar.parallel.distributed import DistContext, ProgressWatchdog\n"
        "ctx = DistContext(1, 2, 1, torch.device('cpu'), 'gloo')\n"
        "dog = ProgressWatchdog(1.0, ctx, enabled=True)\n"
        "for _ in range(6): time.sleep(0.5); dog.beat()\n"  # alive for 3 s: no exit
        "print('beating ok', flush=True)\n"
        "time.sleep(60)\n"
    )  # stuck: the watchdog must end it long before this
    proc = forkserver.run([sys.executable, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 3
    assert proc.stdout.strip() == "beating ok"
    line = proc.stderr.strip()
    assert "\n" not in line and "[rank 1] lost contact with the other ranks" in line


def test_a_stall_seen_by_both_threads_is_reported_once():
    """gloo's timeout (main thread) and the watchdog share --dist-timeout-s: whichever reports
    first speaks; the watchdog, second, leaves the ending to the main thread (CI once saw two
    lines)."""

    from cli import ROOT, env

    code = (
        "import time, torch; from fastcifar.parallel.distributed import DistContext, ProgressWatchdog, report_failure\n"
        "ctx = DistContext(1, 2, 1, torch.device('cpu'), 'gloo')\n"
        "dog = ProgressWatchdog(1.0, ctx, enabled=True)\n"
        "assert report_failure('fastcifar: error: [rank 1] lost contact (main thread)')\n"
        "time.sleep(3.5)\n"  # the watchdog fires meanwhile: it must neither print nor exit
        "assert not report_failure('a second line')\n"
    )
    proc = forkserver.run([sys.executable, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == "fastcifar: error: [rank 1] lost contact (main thread)"
