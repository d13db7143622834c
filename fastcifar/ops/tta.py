"""Test-time augmentation: the logits the recipe's evaluation counts, at three levels.

    0: the image alone
    1: mean of the image's and its mirror image's logits (the seed recipe's flip TTA)
    2: level 1 at weight 1/2, plus level 1 of the image shifted one pixel up-left and one pixel
       down-right (reflect padding) at 1/4 each: 6 forward passes per image

Level 2 is the multi-crop TTA of the public speedruns (airbench reports it worth about a tenth of
a point, or ~1 epoch, on CIFAR-10); it costs 3x level 1's evaluation time, which is off the
training clock but is reported as test time. The views are stacked into one batch per level, so
each level is a single forward pass of 1, 2 or 6 times the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastcifar.core.config import CHOICES

TTA_LEVELS = CHOICES["tta"]


def translations(images: torch.Tensor, pixels: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The NCHW batch shifted by ``pixels`` toward the bottom-right and toward the top-left: the
    windows at the padded image's top-left and bottom-right corners, reflect padding."""
    padded = F.pad(images, (pixels,) * 4, mode="reflect")
    h, w = images.shape[2:]
    return padded[:, :, :h, :w], padded[:, :, 2 * pixels:, 2 * pixels:]


def _stacked(model, views: list[torch.Tensor]) -> torch.Tensor:
    batch = torch.cat(views).contiguous(memory_format=torch.channels_last)
    return model(batch).float().view(len(views), views[0].shape[0], -1)


def tta_logits(model: torch.nn.Module, images: torch.Tensor, level: int) -> torch.Tensor:
    """Float32 logits (B, classes) of an NCHW batch with test-time augmentation ``level``."""
    level = int(level)
    if level == 0:
        return model(images).float()
    if level == 1:
        return _stacked(model, [images, images.flip(3)]).mean(0)
    if level == 2:
        toward_bottom_right, toward_top_left = translations(images)
        views = [images, images.flip(3), toward_bottom_right, toward_bottom_right.flip(3),
                 toward_top_left, toward_top_left.flip(3)]
        logits = _stacked(model, views).view(3, 2, images.shape[0], -1).mean(1)  # flip mean per view
        return 0.5 * logits[0] + 0.25 * (logits[1] + logits[2])
    raise ValueError(f"TTA level must be one of {TTA_LEVELS}, not {level}")
