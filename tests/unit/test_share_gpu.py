"""Several ranks on one GPU, for testing only (FASTCIFAR_SHARE_GPU=1, set by scripts/rank_env.sh;
issue 46: two NCCL ranks on the visit's one GPU): which device each local rank gets, with CUDA
mocked (a machine of 1 or 2 GPUs)."""

from __future__ import annotations

import pytest
import torch
from gpus import fake_gpus

from fastcifar.core.config import ConfigError
from fastcifar.parallel.distributed import SHARE_GPU, pick_device


@pytest.fixture
def gpus(monkeypatch):
    """gpus(n): CUDA with n devices (H100s); returns the list of indices ``set_device`` was called with."""
    return lambda n: fake_gpus(monkeypatch, n)


@pytest.mark.parametrize("share", [None, "0"])
def test_each_local_rank_gets_its_own_gpu_and_one_without_is_refused(gpus, monkeypatch, share):
    if share is None:
        monkeypatch.delenv(SHARE_GPU, raising=False)
    else:
        monkeypatch.setenv(SHARE_GPU, share)
    chosen = gpus(2)
    assert [pick_device("auto", r) for r in (0, 1)] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert chosen == [0, 1]
    with pytest.raises(ConfigError) as err:
        pick_device("cuda", 2)
    assert str(err.value) == "local rank 2 has no GPU: this machine has 2"
    assert chosen == [0, 1], "a refused rank selects no device"


def test_shared_gpus_take_the_local_ranks_in_turn(gpus, monkeypatch):
    monkeypatch.setenv(SHARE_GPU, "1")
    chosen = gpus(1)
    assert [pick_device("cuda", r) for r in range(3)] == [torch.device("cuda", 0)] * 3 and chosen == [0, 0, 0]
    chosen = gpus(2)
    assert [pick_device("auto", r).index for r in range(4)] == [0, 1, 0, 1] and chosen == [0, 1, 0, 1]


def test_sharing_changes_nothing_on_the_cpu_or_without_a_gpu(gpus, monkeypatch):
    monkeypatch.setenv(SHARE_GPU, "1")
    chosen = gpus(0)
    assert pick_device("auto", 3) == torch.device("cpu") and pick_device("cpu", 3) == torch.device("cpu")
    with pytest.raises(ConfigError, match="PyTorch sees no CUDA GPU"):
        pick_device("cuda", 0)
    assert chosen == []


def test_a_share_setting_other_than_0_or_1_is_refused_in_one_line(gpus, monkeypatch):
    monkeypatch.setenv(SHARE_GPU, "yes")
    chosen = gpus(1)
    with pytest.raises(ConfigError) as err:
        pick_device("cuda", 0)
    assert str(err.value) == "FASTCIFAR_SHARE_GPU must be 0 or 1 (1: ranks share the GPUs, for testing only), not 'yes'"
    assert chosen == []
