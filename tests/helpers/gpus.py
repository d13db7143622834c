"""A machine's GPUs as torch sees them, mocked for tests on a machine without one: the count, the
capability and name, torch's arch list and the device chosen (``set_device``)."""

from __future__ import annotations

import functools

import torch

# torch's arch lists (torch._C._cuda_getArchFlags()) of the pip wheels README's Install table names
# (issue 69, read from the installed wheels): torch 2.14.1+cu130 (the default line) and 2.10.0 (CUDA
# 12.8: the Volta line)
CU130_ARCHS = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
TORCH_2_10_ARCHS = ["sm_70", "sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
NAMES = {(7, 0): "Tesla V100-SXM2-16GB", (9, 0): "NVIDIA H100 80GB HBM3", (12, 0): "NVIDIA RTX PRO 6000"}


def fake_gpus(monkeypatch, n: int, capability=(9, 0), archs=CU130_ARCHS, sms: int = 132, driver=()) -> list[int]:
    """CUDA with ``n`` GPUs of ``capability`` (n = 0: CUDA unavailable, while ``nvidia-smi -L`` lists
    the lines ``driver``); returns the list ``set_device`` appends each chosen index to."""
    from fastcifar.core import gpu

    chosen: list[int] = []

    class Props:
        multi_processor_count = sms
        major, minor = capability
        name = NAMES.get(tuple(capability), "GPU")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: tuple(capability))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: Props.name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: Props())
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: list(archs))
    monkeypatch.setattr(gpu, "driver_gpus", lambda timeout_s=gpu.NVIDIA_SMI_TIMEOUT_S: list(driver))
    # a fresh cache of SM counts for the mocked machine, the real one back afterwards
    monkeypatch.setattr(gpu, "_cuda_sms", functools.cache(gpu._cuda_sms.__wrapped__))
    monkeypatch.setattr(gpu, "_cuda_capability", functools.cache(gpu._cuda_capability.__wrapped__))
    return chosen
