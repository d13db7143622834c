"""The benchmark scripts run end to end in their CPU forms (figures meaningless, nothing written),
so a change to the trainer's API cannot silently break them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cli import ROOT, env

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("script, args, expect", [
    ("bench_step.py", ["--smoke"], "| batch | kernels | graphs | step_ms"),
    ("bench_augment.py", ["--smoke"], "smoke run"),
    ("bench_loader.py", ["--images", "256", "--epochs", "1", "--batches", "64", "--no-record"], "images/s"),
])
def test_bench_script_runs(script, args, expect):
    before = sorted((ROOT / "bench" / "results").iterdir())
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert expect in proc.stdout
    assert sorted((ROOT / "bench" / "results").iterdir()) == before, "a CPU form must not write results"
    cells = [c.strip().lower() for line in proc.stdout.splitlines() if line.startswith("|")
             for c in line.split("|")]
    assert "nan" not in cells and "inf" not in cells


def test_gpu_bench_without_gpu_refuses_in_one_line():
    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_step.py")], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "no CUDA device here" in proc.stderr and proc.stderr.count("\n") == 1
