"""The harness's --rank0-data N (gpu_visit.sh nccl2's sharp check; --help leaves it out): every rank
fed rank 0's data, so the average over ranks is each rank's gradient bit for bit, and 2 gloo ranks
train exactly what one process given the same flag trains (fp32 on the CPU: no rounding in
(g + g) / 2)."""

from __future__ import annotations

import os
import sys

import forkserver
import pytest
import torch
from cli import ROOT, env, epochs_of, run_dirs, summary_of, torchrun
from conftest import write_official
from safetensors.torch import load_file

from fastcifar.core.config import Config, ConfigError, validate
from fastcifar.core.options import parse_args
from fastcifar.parallel import distributed
from fastcifar.parallel.distributed import DistContext

# the default preset made small; the whitening bias freezes after epoch 1, so the bucket plan
# switches mid-run too
ARGS = [
    *("--preset", "fast-jitter", "--device", "cpu", "--widths", "16,32,32", "--batch-size", "100"),
    *("--epochs", "2", "--whiten-bias-epochs", "1", "--warmup-steps", "1", "--eval-batch-size", "200"),
    *("--subset", "800", "--loader", "torch", "--quiet"),
]


def test_rank0_data_names_rank_0_of_n_for_every_rank(monkeypatch):
    ctx = DistContext(rank=1, world_size=2, local_rank=1, device=None, backend="gloo")
    monkeypatch.setenv("FASTCIFAR_TEST_RANK0_DATA", "2")  # the former switch: a user's environment changes nothing
    assert distributed.data_ranks(Config(), ctx) == (1, 2)
    assert distributed.data_ranks(parse_args(["--rank0-data", "2"]), ctx) == (0, 2)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--rank0-data", "0"], None),
        (["--rank0-data", "2048"], "--rank0-data must lie in 0..1024, not 2048"),
        (["--rank0-data", "3", "--batch-size", "100"], "--rank0-data 3 takes rank 0's batch of 100 / 3 images"),
        (["--rank0-data", "2", "--emulate-ranks", "2"], "without --emulate-ranks"),
    ],
)
def test_a_rank0_data_the_batch_cannot_take_is_refused_in_one_line(args, message):
    cfg = parse_args([*args, "--device", "cpu"])
    if message is None:
        assert validate(cfg) is cfg
        return
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        validate(cfg)


@pytest.mark.slow
def test_two_ranks_fed_rank_0s_data_equal_one_process_bit_for_bit(tmp_path, monkeypatch):
    # fresh interpreters, each rank with its own string-hash seed as in a real launch: ranks forked
    # from one server would share one, and agree on any set's order by that alone
    monkeypatch.setenv("FASTCIFAR_TEST_FORK", "0")
    data, _ = write_official(tmp_path / "data", per_batch=200, n_test=400)
    e = env()
    common = [*ARGS, "--data", str(data), "--rank0-data", "2"]
    runs = {
        "two": [*torchrun(), *common, "--whiten-images", "200", "--out-dir", str(tmp_path / "two")],
        # rank 0's 100 whitening images, as the 2 ranks' all-reduced sums over 2 x the same 100
        "one": [sys.executable, "-m", "fastcifar.train", *common, "--whiten-images", "100"]
        + ["--out-dir", str(tmp_path / "one")],
    }
    for name, cmd in runs.items():
        proc = forkserver.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
    two, one = summary_of(tmp_path / "two"), summary_of(tmp_path / "one")
    assert two["device"]["world_size"] == 2 and one["device"]["world_size"] == 1
    assert two["per_rank_batch"] == one["per_rank_batch"] == 50
    exact = [epochs_of(s, ("train_loss", "train_acc", "test_acc")) for s in (two, one)]
    assert exact[0] == exact[1], exact
    two_w, one_w = (load_file(run_dirs(tmp_path / n)[0] / "model.safetensors") for n in ("two", "one"))
    assert two_w.keys() == one_w.keys()
    for name in two_w:  # the metadata differ (--whiten-images), the tensors may not
        assert torch.equal(two_w[name], one_w[name]), f"{name}: the trained weights differ"


def test_deterministic_takes_torchs_deterministic_algorithms_and_nothing_without_it(monkeypatch):
    monkeypatch.setenv("FASTCIFAR_TEST_DETERMINISTIC", "1")  # the former switch: no variable changes a run
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic)
    torch.backends.cudnn.benchmark = True
    try:
        assert distributed.apply_determinism(Config(), torch.device("cuda")) == ""
        assert torch.backends.cudnn.benchmark and not torch.are_deterministic_algorithms_enabled()
        assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
        # the CPU: torch's kernels, cuDNN left alone; the line names the thread count it holds for
        line = distributed.apply_determinism(parse_args(["--deterministic"]), torch.device("cpu"))
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.benchmark
        assert f"thread count ({torch.get_num_threads()} here" in line and "\n" not in line
        # a GPU (the settings only; nothing runs on it): cuDNN's deterministic algorithms, no search,
        # cuBLAS's workspace set before the run's first matmul when the user has not set it
        line = distributed.apply_determinism(parse_args(["--deterministic"]), torch.device("cuda"))
        assert not torch.backends.cudnn.benchmark and torch.backends.cudnn.deterministic
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and "=:4096:8 (set for this run)" in line
        assert "not covered: " in line and "NCCL" in line and "\n" not in line
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the user's own is kept, and named
        line = distributed.apply_determinism(parse_args(["--deterministic"]), torch.device("cuda"))
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8" and "=:16:8 (as given)" in line
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = before


def test_no_triton_kernel_sums_with_atomics():
    """--deterministic gives the Triton kernels no variant of their own: every reduction in kernels/
    runs in a fixed order (two-stage sums, no atomics). A kernel that adds an atomic needs an
    order-fixed variant chosen under --deterministic (and a line in apply_determinism) first."""
    found = [
        f"{path.name}:{n}"
        for path in sorted((ROOT / "kernels").glob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "atomic_" in line and not line.lstrip().startswith("#")
    ]
    assert found == [], found
