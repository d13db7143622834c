"""The seed ResNet-9 (Page, 2018): prep conv, three stages, two of them residual, a linear head.

Built from ``ConvBlock`` (conv + the fused batchnorm/activation/pool block), so the Triton kernel
replaces the normalize blocks without touching the network's definition. Tensors are NCHW-shaped
and channels-last in memory throughout.
"""

from __future__ import annotations

import torch
from torch import nn

from fastcifar.models.blocks import ConvBlock, NormFactory
from fastcifar.ops.norm_act_pool import NormActPool, global_max_pool


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

    def __init__(
        self,
        num_classes: int = 10,
        norm: NormFactory = NormActPool,
        widths=(64, 128, 256, 512),
        act: str = "relu",
        logit_scale: float = 0.125,
    ):
        super().__init__()
        w0, w1, w2, w3 = widths
        self.prep = ConvBlock(3, w0, norm, act)
        self.layer1 = nn.Sequential(ConvBlock(w0, w1, norm, act, pool="after"), Residual(w1, norm, act))
        self.layer2 = ConvBlock(w1, w2, norm, act, pool="after")
        self.layer3 = nn.Sequential(ConvBlock(w2, w3, norm, act, pool="after"), Residual(w3, norm, act))
        self.fc = nn.Linear(w3, num_classes, bias=False)
        self.logit_scale = logit_scale

    @classmethod
    def from_config(cls, cfg, norm: NormFactory, num_classes: int) -> ResNet9:
        return cls(num_classes, widths=cfg.widths, norm=norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer3(self.layer2(self.layer1(self.prep(x))))
        x = global_max_pool(x)
        return self.fc(x) * self.logit_scale
