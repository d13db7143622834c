"""What a run records of where its figures came from (run.report.provenance)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch

from fastcifar.core.config import from_preset
from fastcifar.run import report

ROOT = Path(__file__).resolve().parents[2]


def test_commit_and_config_hash():
    prov = report.provenance(from_preset("fast", out_dir="a", data="x"), torch.device("cpu"))
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert prov["commit"] == (head or None)
    assert isinstance(prov["dirty"], bool) or prov["commit"] is None
    # paths and logging leave the hash alone; a recipe setting changes it
    assert (
        report.provenance(from_preset("fast", out_dir="b", data="y", quiet=True), torch.device("cpu"))["config_hash"]
        == prov["config_hash"]
    )
    assert report.provenance(from_preset("fast", lr=0.5), torch.device("cpu"))["config_hash"] != prov["config_hash"]
    assert prov["gpu"] is None and prov["driver"] is None


def test_gpu_name_from_torch_and_driver_from_nvidia_smi_by_uuid(monkeypatch):
    """nvidia-smi is asked by the device's UUID (its own index order is the bus's and ignores
    CUDA_VISIBLE_DEVICES); the name is torch's, the device the run uses."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: f"torch's name of {device}")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(uuid="abcd-1234"))
    calls = []

    def smi(args, **kw):
        calls.append(args)
        return subprocess.CompletedProcess(args, 0, stdout="580.159.04\n", stderr="")

    monkeypatch.setattr(report.subprocess, "run", smi)
    assert report.gpu_identity(torch.device("cuda", 3)) == ("torch's name of 3", "580.159.04")
    assert "--id=GPU-abcd-1234" in calls[0]

    def missing(args, **kw):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(report.subprocess, "run", missing)
    assert report.gpu_identity(torch.device("cuda", 0)) == ("torch's name of 0", None)


# --- what the run's lines say --------------------------------------------------------------------


def test_emulated_ranks_say_so_and_what_is_the_same():
    """--emulate-ranks N: one line naming the emulation, each rank's batchnorm batch, and that the
    recipe (not the exact numbers) is the one N real ranks train; none without it."""
    assert report.emulated_note(from_preset("fast")) == ""
    line = report.emulated_note(from_preset("fast", batch_size=2000, emulate_ranks=8))
    assert line.startswith("emulated ranks: 8 ranks in this one process") and "over 250 images" in line
    assert "the recipe of 8 real ranks, up to the order of floating-point sums" in line and "\n" not in line


def test_the_estimate_counts_every_evaluation_and_says_what_it_leaves_out():
    """The estimate holds the set-up, every step, each epoch's evaluation and (--val-split) the test
    set's once at the end; its line names the total's span and the line that gives the time taken."""
    assert report.estimate(2.0, [10, 10, 5], 0.1, 3 * 2 + 4, 0.5) == pytest.approx(2.0 + 2.5 + 5.0)
    line = report.estimate_line(1, 9.5, [10, 10, 5], 0.1, 2, 0.5, final_batches=4)
    assert line.startswith("run 1: about 9.5 s in all (set-up to model file): ")
    assert "25 steps at 0.1 s, 2 evaluation batches an epoch and 4 for the test set at the end at 0.5 s" in line
    assert "not counted: " in line and len(line) < 200
    assert "for the test set" not in report.estimate_line(1, 9.5, [10, 10], 0.1, 1, 0.5)


def test_the_omp_advice_points_at_a_readme_section_that_exists(monkeypatch):
    """The busy-CPU note names a README section; that heading must be in README.md."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setattr(report.os, "getloadavg", lambda: (50.0, 50.0, 50.0))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    note = report.cpu_threads_note(torch.device("cpu"))
    section = re.search(r"\(README, ([^)]+)\)", note).group(1)
    assert f"## {section}\n" in (ROOT / "README.md").read_text(), section
