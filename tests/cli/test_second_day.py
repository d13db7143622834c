"""A newcomer's second day (issue 71): a library that cannot be imported ends no command in a
traceback; a run you can watch (its console lines); runs you can reuse (--config, TensorBoard)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from cli import ROOT, env, free_port, run_dirs
from conftest import one_line_error, write_official

# a tiny ResNet-9 on 200 training images: a few seconds on one thread
TINY = [
    "--preset",
    "resnet9",
    "--device",
    "cpu",
    "--widths",
    "8,16,32,64",
    "--batch-size",
    "50",
    "--epochs",
    "3",
    "--warmup-epochs",
    "1",
    "--warmup-steps",
    "1",
    "--eval-batch-size",
    "200",
    "--loader",
    "torch",
]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder, _ = write_official(tmp_path_factory.mktemp("data"), per_batch=40, n_test=50)
    return folder


def run(args, environment=None, timeout=300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "fastcifar", *[str(a) for a in args]]
    return subprocess.run(cmd, cwd=ROOT, env=environment or env(), capture_output=True, text=True, timeout=timeout)


# --- a library that cannot be imported ---------------------------------------------------------


@pytest.fixture
def broken_torchvision(tmp_path):
    """The environment of a torchvision built for another torch: its import raises what that one
    raises (issue 71: a CPU install beside a torchvision of the wrong build)."""
    fake = tmp_path / "fake" / "torchvision"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise RuntimeError("operator torchvision::nms does not exist")\n')
    e = env()
    e["PYTHONPATH"] = os.pathsep.join([str(fake.parent), str(ROOT)])
    return e


@pytest.mark.slow
def test_a_torchvision_that_cannot_be_imported_ends_no_command(broken_torchvision, data, tmp_path):
    e = broken_torchvision
    proc = subprocess.run([sys.executable, "-c", "import torchvision"], env=e, capture_output=True, text=True)
    assert "operator torchvision::nms does not exist" in proc.stderr, "the fake breaks the import"
    # --download with the network refused (a proxy on a closed port): the download's own one line, exit 2
    closed = f"http://127.0.0.1:{free_port()}"
    offline = dict(e, https_proxy=closed, HTTPS_PROXY=closed, no_proxy="", NO_PROXY="")
    proc = run(["train", "--data", tmp_path / "dl", "--download", "--out-dir", tmp_path / "runs", *TINY], offline)
    assert proc.returncode == 2, proc.stderr
    line = one_line_error(proc.stderr)
    assert line.startswith("fastcifar: error: download of https://") and "by hand" in line
    # no module of the package imports torchvision, and a run trains and evaluates without it
    proc = run(["train", "--data", data, "--out-dir", tmp_path / "runs", *TINY, "--epochs", "1"], e)
    assert proc.returncode == 0, proc.stderr
    (run_dir,) = run_dirs(tmp_path / "runs")
    proc = run(["evaluate", run_dir / "model.safetensors", "--data", data], e)
    assert proc.returncode == 0, proc.stderr
