"""The CIFAR AlexNet (``--arch alexnet``, preset ``alexnet``): the second network of the
compressed-communication system, beside ResNet-9.

The widely used CIFAR adaptation of AlexNet: five convolutions, 11x11 stride 4 (32x32 -> 8x8),
5x5, then three 3x3, with 2x2 max-pools after the first, second and fifth (8 -> 4 -> 2 -> 1), and
one linear layer 256 -> 10. At the default widths 64,192,384,256,256 it has 2.47 M parameters
(ResNet-9: 6.57 M), 87% of them in the three 3x3 convolutions.

One departure, on purpose: each convolution is followed by this project's ``NormActPool``
(batchnorm, ReLU, pool) instead of a bare ReLU, so the Triton kernel path and the seed recipe's
learning rate apply unchanged; the original has no batchnorm, and its recipe is not known here.
"""

from __future__ import annotations

from torch import nn

from fastcifar.models.blocks import ConvBlock, NormFactory
from fastcifar.ops.norm_act_pool import NormActPool


class AlexNet(nn.Module):
    def __init__(self, num_classes: int = 10, norm: NormFactory = NormActPool, widths=(64, 192, 384, 256, 256)):
        super().__init__()
        w1, w2, w3, w4, w5 = widths
        self.features = nn.Sequential(
            ConvBlock(3, w1, norm, pool="after", kernel=11, stride=4),  # 32 -> 8, pool -> 4
            ConvBlock(w1, w2, norm, pool="after", kernel=5),  # 4, pool -> 2
            ConvBlock(w2, w3, norm),
            ConvBlock(w3, w4, norm),
            ConvBlock(w4, w5, norm, pool="after"),  # 2, pool -> 1
        )
        self.fc = nn.Linear(w5, num_classes)

    @classmethod
    def from_config(cls, cfg, norm: NormFactory, num_classes: int) -> AlexNet:
        return cls(num_classes, widths=cfg.widths, norm=norm)

    def forward(self, x):
        return self.fc(self.features(x).flatten(1))
