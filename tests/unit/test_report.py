"""What a run records of where its figures came from (run.report.provenance)."""

from __future__ import annotations

import subprocess
from pathlib import Path

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
