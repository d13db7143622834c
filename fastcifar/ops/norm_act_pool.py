"""``NormActPool``: batchnorm, an activation and an optional 2x2 max-pool as one module.

Its own module so that the network (``fastcifar.models.blocks``) and the fused Triton kernel
(``fastcifar.kernels.bn_act_pool.TritonNormActPool``, same constructor, same state) both build on it
without importing each other.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fastcifar.core.config import CHOICES

ACTIVATIONS = CHOICES["activation"]
POOL_PLACES = (None, "before", "after")
NormFactory = Callable[..., nn.Module]


def activation(x: torch.Tensor, act: str) -> torch.Tensor:
    if act == "relu":
        return F.relu(x)
    if act == "gelu":
        return F.gelu(x)
    if act == "celu":
        return F.celu(x)
    if act == "silu":
        return F.silu(x)
    raise ValueError(f"unknown activation {act!r}; choose from {ACTIVATIONS}")


def global_max_pool(x: torch.Tensor) -> torch.Tensor:
    """Each channel's largest value, (N, C, H, W) -> (N, C), through ``max``'s index, not ``amax``.

    Why: ``amax``'s backward finds the maximum again, as the elements equal to the forward's output.
    Under ``torch.compile`` the backward recomputes the activation before it in fp32 where the
    forward rounded it to fp16, nothing equals the maximum, and the gradient is 0 / 0: every conv
    of `fast` had NaN gradients after the first step (inductor, torch 2.11 on an H100 and 2.14 on
    the CPU). ``max`` saves the index in the forward, and the backward cannot miss it.
    On a tie it sends the gradient to one element where ``amax`` splits it: both are subgradients.
    Channels-last keeps H and W adjacent (strides W*C and C), so ``flatten`` is a view."""
    return x.flatten(2).max(dim=2).values


class NormActPool(nn.BatchNorm2d):
    """BatchNorm2d, then an activation, with an optional 2x2 max-pool before or after.

    ``pool="before"`` pools first (4x fewer elements to normalize, as the fast recipes do);
    ``pool="after"`` pools the activation (the seed ResNet-9's order). Parameters and running
    statistics stay fp32 when the activations are fp16.
    """

    def __init__(
        self,
        num_features: int,
        act: str = "relu",
        pool: str | None = None,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
    ):
        if act not in ACTIVATIONS:
            raise ValueError(f"unknown activation {act!r}; choose from {ACTIVATIONS}")
        if pool not in POOL_PLACES:
            raise ValueError(f"pool must be one of {POOL_PLACES}, not {pool!r}")
        super().__init__(num_features, eps=eps, momentum=momentum)
        self.act = act
        self.pool = pool

    def step_momentum(self) -> float:
        """Count this batch (in training) and return the running statistics' momentum for it:
        ``self.momentum``, or with None the cumulative average, as nn.BatchNorm2d does (a host
        read of the counter: no preset uses it). Every kernel path's forward calls it, so their
        states agree."""
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                momentum = 1.0 / float(self.num_batches_tracked)
        return momentum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalize(x, self.running_mean, self.running_var, self.step_momentum())

    def normalize(
        self, x: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor, momentum: float
    ) -> torch.Tensor:
        """The block on ``x`` with these running statistics (updated in place in training, with
        ``momentum``): what each kernel path (the Triton kernel, its custom op) overrides, so
        ``PerRankStatistics`` can run any of them once per rank."""
        if self.pool == "before":
            x = F.max_pool2d(x, 2)
        x = F.batch_norm(x, running_mean, running_var, self.weight, self.bias, self.training, momentum, self.eps)
        x = activation(x, self.act)
        if self.pool == "after":
            x = F.max_pool2d(x, 2)
        return x

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, act={self.act}, pool={self.pool}"


class ConvBlock(nn.Module):
    """kernel x kernel conv (3x3 in ResNet-9; AlexNet's 11x11 stride 4 and 5x5 too; "same" padding;
    no bias: the batchnorm's shift replaces it) followed by NormActPool. Here, beside the normalize
    block, so that the fused conv kernel (``fastcifar.kernels.conv_stats.TritonConvBlock``, same
    constructor and state) can build on it as the Triton normalize block builds on NormActPool."""

    def __init__(
        self,
        c_in: int,
        c_out: int,
        norm: NormFactory,
        act: str = "relu",
        pool: str | None = None,
        kernel: int = 3,
        stride: int = 1,
    ):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, kernel_size=kernel, stride=stride, padding=kernel // 2, bias=False)
        self.norm = norm(c_out, act=act, pool=pool)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x))


class PerRankStatistics:
    """Batchnorm statistics per rank, for a batch that is ``ranks`` ranks' batches side by side
    (``--emulate-ranks``): mixed into a NormActPool class (``per_rank``), it splits a training
    batch into ``ranks`` equal chunks along the batch and normalizes each with its own batch mean
    and variance, as each rank of a data-parallel run normalizes only its own images (on 8 ranks
    the default preset's 2000 images make 8 batchnorm batches of 250; ghost batchnorm, by another
    name). Each chunk goes through the class's own ``normalize`` (the plain-torch, Triton or
    custom-op kernel), so a chunk's output and gradient are what its rank's would be.

    Running statistics: each rank's update is ``r <- (1 - m) r + m s_rank`` (s: the chunk's mean,
    or its unbiased variance), and ``distributed.average_buffers`` averages the ranks' ``r`` after
    every epoch. The update is linear, so the average of the ranks' running statistics is the
    running statistic updated with the average of the chunks' statistics, at every step: this
    keeps one copy, updates each rank's from it and stores their mean, and holds after each epoch
    what the average over ranks holds (in fp32 up to rounding order). Momentum None (the
    cumulative average, m = 1/count) is linear the same way; the count advances once a step, as
    on each rank. In eval mode nothing is split: the ranks evaluate the same averaged model."""

    ranks: int = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.ranks == 1:
            return super().forward(x)
        if x.shape[0] % self.ranks:
            raise ValueError(f"a training batch of {x.shape[0]} does not split over {self.ranks} emulated ranks")
        momentum = self.step_momentum()  # once: each rank counts one batch a step
        means = self.running_mean.expand(self.ranks, -1).clone()  # row r: rank r's running statistics
        variances = self.running_var.expand(self.ranks, -1).clone()
        out = torch.cat(
            [self.normalize(chunk, means[r], variances[r], momentum) for r, chunk in enumerate(x.chunk(self.ranks))]
        )
        with torch.no_grad():
            self.running_mean.copy_(means.mean(0))
            self.running_var.copy_(variances.mean(0))
        return out


@functools.cache
def _per_rank_class(norm: type, ranks: int) -> type:
    return type(f"PerRank{norm.__name__}", (PerRankStatistics, norm), {"ranks": ranks})


def per_rank(norm, ranks: int):
    """The norm block factory ``norm`` (a NormActPool class) with batchnorm statistics per emulated
    rank (``PerRankStatistics``); ``norm`` itself for one rank. Same constructor and state: a
    model file of an emulated run loads into the plain block."""
    return norm if ranks == 1 else _per_rank_class(norm, ranks)


def as_plain_torch(model: nn.Module) -> nn.Module:
    """Turn every NormActPool subclass in ``model`` (the Triton and compiled kernels) back into
    the plain-torch NormActPool, and every ConvBlock subclass (the fused conv) into ConvBlock, in
    place: same state, same maths, and it runs where compiled Triton kernels cannot (CPU tensors on
    a GPU machine, torch.func transforms)."""
    for m in model.modules():
        for plain in (NormActPool, ConvBlock):
            if isinstance(m, plain) and type(m) is not plain:
                m.__class__ = plain
    return model


def bn_act_pool_reference(
    x,
    weight,
    bias,
    running_mean,
    running_var,
    training: bool,
    momentum: float = 0.1,
    eps: float = 1e-5,
    act: str = "relu",
    pool: str | None = None,
) -> torch.Tensor:
    """Plain PyTorch: [2x2 max-pool] -> batch_norm -> activation -> [2x2 max-pool] (NormActPool.forward)."""
    if pool == "before":
        x = F.max_pool2d(x, 2)
    x = F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)
    x = activation(x, act)
    if pool == "after":
        x = F.max_pool2d(x, 2)
    return x


def bn_act_pool_reference_with_stats(
    x, weight, bias, mean, rstd, act: str = "relu", pool: str | None = None, eps: float = 1e-5
) -> torch.Tensor:
    """Training-mode reference whose forward uses the given batch statistics (the kernel's own fp32
    ``mean``/``rstd``, from ``bn_act_pool_forward``'s ``saved``) while its gradient flows through the
    batch mean and variance as batchnorm's does.

    Why: two correct batchnorms sum in different orders (cuDNN's vs the kernel's two-stage
    reduction), so their fp32 statistics differ in the last bits, and in fp16 about 1e-4 of the
    rounded activations then land on the other side of a ReLU's zero or of a 2x2 max's tie; each
    such element moves a whole gradient in ``dx``. With the kernel's statistics every rounding
    decision matches, and what remains to compare is the math. Rounds where eager rounds: the BN
    output and the activation output are cast to ``x``'s dtype. ``eps`` enters only the gradient path
    (the batch's rstd); give the one that made ``rstd`` (`fast` uses 1e-12)."""
    if pool == "before":
        x = F.max_pool2d(x, 2)
    out = activation(bn_reference_with_stats(x, weight, bias, mean, rstd, eps), act)
    if pool == "after":
        out = F.max_pool2d(out, 2)
    return out


def bn_reference_with_stats(x, weight, bias, mean, rstd, eps: float = 1e-5) -> torch.Tensor:
    """The batchnorm of ``bn_act_pool_reference_with_stats`` alone: the activation's input, rounded
    to ``x``'s dtype (the kernel tests read a ReLU's kink off it, ``near_tie_windows``)."""
    xf = x.float()
    batch_mean = xf.mean(dim=(0, 2, 3))
    batch_rstd = torch.rsqrt(xf.var(dim=(0, 2, 3), unbiased=False) + eps)
    # the values of the given statistics, the gradient of the batch's (a straight-through swap)
    m = batch_mean + (mean.float() - batch_mean).detach()
    r = batch_rstd + (rstd.float() - batch_rstd).detach()
    scale = (weight * r).view(1, -1, 1, 1)
    shift = (bias - m * weight * r).view(1, -1, 1, 1)
    return (xf * scale + shift).to(x.dtype)


def conv_bn_act_pool_reference(
    x,
    conv_weight,
    weight,
    bias,
    running_mean,
    running_var,
    training: bool,
    momentum: float = 0.1,
    eps: float = 1e-5,
    act: str = "relu",
    pool: str | None = None,
) -> torch.Tensor:
    """Plain PyTorch: conv (stride 1, padding k//2, no bias), then ``bn_act_pool_reference``."""
    y = F.conv2d(x, conv_weight, padding=conv_weight.shape[-1] // 2)
    return bn_act_pool_reference(y, weight, bias, running_mean, running_var, training, momentum, eps, act, pool)
