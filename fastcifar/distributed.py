"""Ranks, devices and process groups: one process per device, launched by torchrun (or alone).

torchrun sets RANK, WORLD_SIZE and LOCAL_RANK; a process started without them is rank 0 of 1
and creates no process group. NCCL joins GPU ranks, gloo CPU ranks.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .config import ConfigError


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None: a single process, no process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for, but PyTorch sees no CUDA GPU")
    if local_rank >= torch.cuda.device_count():
        raise ConfigError(f"local rank {local_rank} has no GPU: this machine has {torch.cuda.device_count()}")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def setup(requested_device: str, timeout_s: float = 300.0) -> DistContext:
    """Read torchrun's environment, pick this rank's device and join the process group."""
    try:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError as exc:
        raise ConfigError(f"bad torchrun environment (RANK/WORLD_SIZE/LOCAL_RANK): {exc}") from None
    device = pick_device(requested_device, local_rank)
    if world_size == 1:
        return DistContext(0, 1, 0, device, None)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        kwargs = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return DistContext(rank, world_size, local_rank, device, backend)


def teardown(ctx: DistContext) -> None:
    if ctx.distributed and dist.is_initialized():
        dist.destroy_process_group()


@torch.no_grad()
def average_buffers(module: torch.nn.Module, ctx: DistContext) -> None:
    """Average floating-point buffers (batchnorm running statistics) over ranks before evaluation:
    each rank normalizes with its own batch statistics in training, so their running means drift apart."""
    if not ctx.distributed:
        return
    for buf in module.buffers():
        if buf.is_floating_point():
            dist.all_reduce(buf)
            buf.div_(ctx.world_size)


def all_sum(values: list[float], ctx: DistContext, device: torch.device) -> list[float]:
    """Sum a few scalars over ranks (epoch metrics); one collective, one host sync."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if ctx.distributed:
        dist.all_reduce(t)
    return t.tolist()
