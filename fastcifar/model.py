"""Networks: the seed ResNet-9, built from conv + fused (batchnorm, activation, pool) blocks.

The batchnorm/activation/pool trio is one module, ``NormActPool``, so that the Triton kernel
(``fastcifar.kernels.bn_act_pool.TritonNormActPool``, same constructor, same state) can replace it without
touching the network's definition. Tensors are NCHW-shaped and channels-last in memory throughout.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from .config import CHOICES, ConfigError
from .norm_act_pool import (ACTIVATIONS, POOL_PLACES, NormActPool, activation,  # noqa: F401  (re-exported)
                             global_max_pool)

NormFactory = Callable[..., nn.Module]
KERNELS = CHOICES["kernels"]  # --kernels' choices: one list, in fastcifar.config


def resolve_kernels(requested: str, device: torch.device) -> str:
    """``auto`` is Triton on CUDA, every block fused, and the torch reference on the CPU. On an H100
    the fused block beat cuDNN's batchnorm + activation (+ pool) on each of the presets' blocks where
    eager could be timed (11 of 12), forward + backward as graph replays: 1.05-1.41x where a block
    does not pool, 2.8-3.7x where it does; `fast`'s graphed step took 2.964 ms against 3.002 ms with
    cuDNN's batchnorm on its unpooled blocks (2026-11-23, torch 2.11.0+cu130, triton 3.6.0;
    bench/results/first_light.md). Triton on the CPU runs in Triton's interpreter (correct, slow: for
    tests; see ``kernel_module``), which exists only in a process without a GPU: Triton chooses
    interpreter or compiler once per process, at import."""
    if requested not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, not {requested!r}")
    kernels = ("triton" if device.type == "cuda" else "torch") if requested == "auto" else requested
    if kernels == "triton" and device.type != "cuda" and torch.cuda.is_available():
        raise ConfigError("--kernels triton on the CPU needs Triton's interpreter, which a machine with a GPU "
                          "does not run (Triton compiles for the GPU there): use --kernels torch or --device cuda")
    return kernels


def kernel_module(name: str):
    """``fastcifar.kernels.<name>``, its kernels interpreted when there is no GPU to compile for
    (``resolve_kernels`` refuses Triton on CPU tensors where there is one).
    ``TRITON_INTERPRET`` is set for the import only, never left in the process environment."""
    from .kernels import load
    return load(name, interpret=not torch.cuda.is_available())


def norm_factory(kernels: str) -> NormFactory:
    """The NormActPool implementation of a kernel path (``resolve_kernels``' answer)."""
    if kernels == "triton":
        return kernel_module("bn_act_pool").TritonNormActPool
    return NormActPool


def norm_blocks(requested: str, device: torch.device) -> NormFactory:
    """The NormActPool factory a network is built with for ``--kernels requested``: the fused
    Triton block for ``triton``, the plain-torch one for ``torch`` (``resolve_kernels``' answer)."""
    return norm_factory(resolve_kernels(requested, device))


class ConvBlock(nn.Module):
    """kernel x kernel conv (3x3 in ResNet-9; AlexNet's 11x11 stride 4 and 5x5 too; "same" padding;
    no bias: the batchnorm's shift replaces it) followed by NormActPool."""

    def __init__(self, c_in: int, c_out: int, norm: NormFactory, act: str = "relu",
                 pool: Optional[str] = None, kernel: int = 3, stride: int = 1):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, kernel_size=kernel, stride=stride, padding=kernel // 2, bias=False)
        self.norm = norm(c_out, act=act, pool=pool)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x))


class Residual(nn.Module):
    """x + f(x), with f two ConvBlocks of the same width."""

    def __init__(self, channels: int, norm: NormFactory, act: str = "relu"):
        super().__init__()
        self.res1 = ConvBlock(channels, channels, norm, act)
        self.res2 = ConvBlock(channels, channels, norm, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.res2(self.res1(x))


class ResNet9(nn.Module):
    """The seed ResNet-9: prep 64; layer1 128 + pool + residual; layer2 256 + pool;
    layer3 512 + pool + residual; global max pool; linear 512->10 (no bias), logits x 0.125."""

    def __init__(self, num_classes: int = 10, norm: NormFactory = NormActPool,
                 widths=(64, 128, 256, 512), act: str = "relu", logit_scale: float = 0.125):
        super().__init__()
        w0, w1, w2, w3 = widths
        self.prep = ConvBlock(3, w0, norm, act)
        self.layer1 = nn.Sequential(ConvBlock(w0, w1, norm, act, pool="after"), Residual(w1, norm, act))
        self.layer2 = ConvBlock(w1, w2, norm, act, pool="after")
        self.layer3 = nn.Sequential(ConvBlock(w2, w3, norm, act, pool="after"), Residual(w3, norm, act))
        self.fc = nn.Linear(w3, num_classes, bias=False)
        self.logit_scale = logit_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer3(self.layer2(self.layer1(self.prep(x))))
        x = global_max_pool(x)
        return self.fc(x) * self.logit_scale
