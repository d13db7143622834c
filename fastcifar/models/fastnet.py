"""FastNet: the `fast` preset's network, shaped for speed rather than for depth.

    whiten: 2x2 conv, 3 -> 24 channels, no padding (32 -> 31), weights set from the data's patches
    GELU
    block(24 -> w0), block(w0 -> w1), block(w1 -> w2)   each: conv, pool, BN, GELU, conv, BN, GELU
    global max pool (3x3 -> 1), linear w2 -> 10 without bias, logits x 1/9

with widths (w0, w1, w2) = (64, 256, 256) in the preset. Every block pools right after its first
conv, before the batchnorm (``NormActPool(pool="before")``): the batchnorm and activation then touch
4x fewer elements, and the second conv runs at a quarter of the first one's resolution. The shape
follows the public single-GPU speedrun networks (Page's ResNet-9 descendants, hlb-CIFAR10 and
airbench); the code and its tests are ours.

The first conv whitens 2x2 patches: its weights are the eigenvectors of the patches' second moment,
each scaled by 1/sqrt(eigenvalue + eps), once with each sign (so the GELU after it keeps both
halves of every direction). The weights come from training images, so ``init_whitening`` runs
inside the timed region (see ``fastcifar.run.whitening``), and they are then frozen.
"""

from __future__ import annotations

import torch
from torch import nn

from fastcifar.models.blocks import ConvBlock, NormFactory
from fastcifar.ops.norm_act_pool import NormActPool, activation, global_max_pool


class FastBlock(nn.Module):
    """conv -> 2x2 max-pool -> BN -> act, then conv -> BN -> act at the pooled resolution."""

    def __init__(self, c_in: int, c_out: int, norm: NormFactory, act: str = "gelu"):
        super().__init__()
        self.conv1 = ConvBlock(c_in, c_out, norm, act, pool="before")
        self.conv2 = ConvBlock(c_out, c_out, norm, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(self.conv1(x))


class FastNet(nn.Module):
    def __init__(
        self,
        num_classes: int = 10,
        norm: NormFactory = NormActPool,
        widths=(64, 256, 256),
        act: str = "gelu",
        whiten_kernel: int = 2,
        logit_scale: float = 1 / 9,
        head_unit_init: bool = False,
    ):
        super().__init__()
        w0, w1, w2 = widths
        self.act = act
        patch_dim = 3 * whiten_kernel * whiten_kernel
        self.whiten = nn.Conv2d(3, 2 * patch_dim, kernel_size=whiten_kernel, padding=0, bias=True)
        nn.init.zeros_(self.whiten.bias)  # the data init sets the weights; the bias starts at no shift
        self.blocks = nn.Sequential(
            FastBlock(2 * patch_dim, w0, norm, act), FastBlock(w0, w1, norm, act), FastBlock(w1, w2, norm, act)
        )
        self.fc = nn.Linear(w2, num_classes, bias=False)
        self.logit_scale = logit_scale
        # Identity ("dirac") init of each 3x3 conv's first c_in filters: the block starts by passing
        # its input through (public speedrun ablations report fewer epochs to the same accuracy).
        with torch.no_grad():
            for m in self.blocks.modules():
                if isinstance(m, nn.Conv2d):
                    nn.init.dirac_(m.weight[: m.in_channels])
            if head_unit_init:  # airbench94_muon's head: std 1, paired with logits / width
                self.fc.weight.div_(self.fc.weight.std())

    @classmethod
    def from_config(cls, cfg, norm: NormFactory, num_classes: int) -> FastNet:
        """The network of ``cfg``: its widths, whitening kernel, activation and head; the
        whitening conv's weights take no step with ``--whiten-frozen`` (the data init sets them)."""
        model = cls(
            num_classes,
            widths=cfg.widths,
            norm=norm,
            whiten_kernel=cfg.whiten_kernel,
            logit_scale=cfg.logit_scale or 1 / 9,
            head_unit_init=cfg.head_unit_init,
            act=cfg.activation,
        )
        model.whiten.weight.requires_grad_(not cfg.whiten_frozen)
        return model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = activation(self.whiten(x), self.act)
        x = self.blocks(x)
        x = global_max_pool(x)  # over the last 3x3 map
        return self.fc(x) * self.logit_scale


def patches(images: torch.Tensor, kernel: int) -> torch.Tensor:
    """Every ``kernel`` x ``kernel`` patch of NCHW ``images`` (stride 1, no padding) as rows of
    length C*k*k, ordered as a conv weight of shape (C, k, k) flattens."""
    n, c = images.shape[:2]
    p = images.unfold(2, kernel, 1).unfold(3, kernel, 1)  # N, C, H', W', k, k
    return p.permute(0, 2, 3, 1, 4, 5).reshape(-1, c * kernel * kernel)


def patch_covariance(images: torch.Tensor, kernel: int, chunk: int = 1000) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Sum of patches, sum of their outer products (float64) and the patch count: the parts of a
    covariance that add up over ranks. ``chunk`` images at a time: 1000 images' 2x2 patches are
    92 MB in float64, all 5000 at once would be 460 MB."""
    d = images.shape[1] * kernel * kernel
    total = torch.zeros(d, dtype=torch.float64, device=images.device)
    outer = torch.zeros(d, d, dtype=torch.float64, device=images.device)
    count = 0
    for start in range(0, len(images), chunk):
        x = patches(images[start : start + chunk].double(), kernel)
        total += x.sum(0)
        outer += x.T @ x
        count += x.shape[0]
    return total, outer, count


def whitening_weights(
    total: torch.Tensor,
    outer: torch.Tensor,
    count: int,
    kernel: int,
    channels: int = 3,
    eps: float = 5e-4,
    centred: bool = False,
) -> torch.Tensor:
    """Conv weights (2*D, C, k, k), D = C*k*k, that whiten patches: row i is eigenvector v_i of the
    patches' second moment E[x x^T] (airbench's; ``centred``: their covariance, E[x x^T] - m m^T)
    over sqrt(lambda_i + eps), rows D.. the same negated. On normalized CIFAR-10 the patch mean is
    near 0, so the two differ little; the second moment is what the published recipe measured.

    ``eps`` (in the normalized data's squared units) keeps the near-zero directions from being
    amplified without bound: a direction with lambda = eps comes out with variance 1/2.
    """
    mean = total / count
    cov = outer / count - torch.outer(mean, mean) if centred else outer / count
    eigenvalues, eigenvectors = torch.linalg.eigh(cov)  # ascending; columns are eigenvectors
    eigenvalues, eigenvectors = eigenvalues.flip(0), eigenvectors.flip(1)  # strongest direction first
    w = (eigenvectors / torch.sqrt(eigenvalues.clamp_min(0) + eps)).T
    w = w.reshape(-1, channels, kernel, kernel)
    return torch.cat([w, -w])


@torch.no_grad()
def init_whitening(
    conv: nn.Conv2d, images: torch.Tensor, eps: float = 5e-4, reduce=None, centred: bool = False
) -> torch.Tensor:
    """Set ``conv``'s weights to whiten the patches of ``images`` (NCHW, normalized) in place.

    ``reduce`` (optional) sums the covariance parts over ranks in place, so that every rank gets
    the same weights from all ranks' images. Returns the weights (float64).
    """
    kernel = conv.kernel_size[0]
    total, outer, count = patch_covariance(images, kernel)
    parts = torch.cat([total, outer.flatten(), torch.tensor([float(count)], dtype=torch.float64, device=total.device)])
    if reduce is not None:
        reduce(parts)
    d = total.numel()
    total, outer, count = parts[:d], parts[d : d + d * d].view(d, d), parts[-1].item()
    w = whitening_weights(total, outer, count, kernel, conv.in_channels, eps, centred)
    conv.weight.copy_(w.to(conv.weight.dtype))  # in place: storage a captured graph may hold stays
    return w
