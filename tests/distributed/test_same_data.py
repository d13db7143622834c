"""The test-only FASTCIFAR_TEST_RANK0_DATA (gpu_visit.sh nccl2's sharp check, issue 73 item 5): every
rank fed rank 0's data, so the average over ranks is each rank's gradient bit for bit, and 2 gloo
ranks train exactly what one process given the same variable trains (fp32 on the CPU: no rounding
in (g + g) / 2)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from cli import ROOT, env, epochs_of, run_dirs, summary_of, torchrun
from conftest import write_official
from safetensors.torch import load_file

from fastcifar.core.config import ConfigError
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
    monkeypatch.delenv(distributed.RANK0_DATA, raising=False)
    assert distributed.data_ranks(ctx) == (1, 2)
    monkeypatch.setenv(distributed.RANK0_DATA, "2")
    assert distributed.data_ranks(ctx) == (0, 2)
    monkeypatch.setenv(distributed.RANK0_DATA, "two")
    with pytest.raises(ConfigError, match="test only"):
        distributed.data_ranks(ctx)


@pytest.mark.slow
def test_two_ranks_fed_rank_0s_data_equal_one_process_bit_for_bit(tmp_path):
    data, _ = write_official(tmp_path / "data", per_batch=200, n_test=400)
    e = dict(env(), **{distributed.RANK0_DATA: "2"})
    common = [*ARGS, "--data", str(data)]
    runs = {
        "two": [*torchrun(), *common, "--whiten-images", "200", "--out-dir", str(tmp_path / "two")],
        # rank 0's 100 whitening images, as the 2 ranks' all-reduced sums over 2 x the same 100
        "one": [sys.executable, "-m", "fastcifar.train", *common, "--whiten-images", "100"]
        + ["--out-dir", str(tmp_path / "one")],
    }
    for name, cmd in runs.items():
        proc = subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=300)
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
