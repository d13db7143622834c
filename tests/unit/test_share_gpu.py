"""Several ranks on one GPU, for the test harness only (the trainer's --share-gpu, which --help leaves
out; gpu_visit.sh nccl2: two NCCL ranks on the visit's one GPU): which device each local rank gets,
with CUDA mocked (a machine of 1 or 2 GPUs)."""

from __future__ import annotations

import pytest
import torch
from gpus import fake_gpus

from fastcifar.core.config import Config, ConfigError
from fastcifar.core.options import parse_args
from fastcifar.parallel.distributed import pick_device

SHARED = Config(share_gpu=True)


@pytest.fixture
def gpus(monkeypatch):
    """gpus(n): CUDA with n devices (H100s); returns the list of indices ``set_device`` was called with."""
    return lambda n: fake_gpus(monkeypatch, n)


@pytest.mark.parametrize("settings", [None, Config()])
def test_each_local_rank_gets_its_own_gpu_and_one_without_is_refused(gpus, monkeypatch, settings):
    monkeypatch.setenv("FASTCIFAR_SHARE_GPU", "1")  # the former switch: no environment variable shares a GPU
    chosen = gpus(2)
    assert [pick_device("auto", r, settings) for r in (0, 1)] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert chosen == [0, 1]
    with pytest.raises(ConfigError) as err:
        pick_device("cuda", 2, settings)
    assert str(err.value) == "local rank 2 has no GPU: this machine has 2"
    assert chosen == [0, 1], "a refused rank selects no device"


def test_shared_gpus_take_the_local_ranks_in_turn(gpus):
    chosen = gpus(1)
    assert [pick_device("cuda", r, SHARED) for r in range(3)] == [torch.device("cuda", 0)] * 3 and chosen == [0, 0, 0]
    chosen = gpus(2)
    assert [pick_device("auto", r, SHARED).index for r in range(4)] == [0, 1, 0, 1] and chosen == [0, 1, 0, 1]


def test_sharing_changes_nothing_on_the_cpu_or_without_a_gpu(gpus):
    chosen = gpus(0)
    assert pick_device("auto", 3, SHARED) == torch.device("cpu") and pick_device("cpu", 3, SHARED) == torch.device(
        "cpu"
    )
    with pytest.raises(ConfigError, match="PyTorch sees no CUDA GPU"):
        pick_device("cuda", 0, SHARED)
    assert chosen == []


def test_the_switch_is_a_flag_that_help_leaves_out(capsys):
    assert parse_args(["--share-gpu"]).share_gpu and not parse_args([]).share_gpu
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    assert "--share-gpu" not in capsys.readouterr().out
