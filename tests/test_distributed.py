"""Two CPU ranks under torchrun (gloo) through the stock DistributedDataParallel path."""

from __future__ import annotations

import sys

import pytest

from cli import SHORT, run_dirs, run_train, summary_of

pytestmark = pytest.mark.slow

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            "-m", "fastcifar.train"]


def test_two_ranks_ddp_learns_and_only_rank0_reports(learnable_data, tmp_path):
    out = tmp_path / "runs"
    proc = run_train(["--data", learnable_data, "--out-dir", out, *SHORT, "--comm", "ddp"],
                     launcher=TORCHRUN, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(run_dirs(out)) == 1, "only rank 0 writes files"
    s = summary_of(out)
    assert s["device"]["world_size"] == 2 and s["per_rank_batch"] == 50
    assert s["summary"]["acc_mean"] > 60.0
    assert proc.stdout.count("run 1: test_acc") == 1, "only rank 0 prints"


def test_batch_that_does_not_divide_fails_on_every_rank(learnable_data, tmp_path):
    proc = run_train(["--data", learnable_data, "--out-dir", tmp_path / "runs", *SHORT, "--batch-size", "101"],
                     launcher=TORCHRUN, timeout=300)
    assert proc.returncode != 0
    assert proc.stderr.count("does not divide over 2 ranks") == 2, proc.stderr[-2000:]
