"""Test-time augmentation: the logits the recipe's evaluation counts, at three levels.

    0: the image alone
    1: mean of the image's and its mirror image's logits (the seed recipe's flip TTA)
    2: level 1 at weight 1/2, plus level 1 of the image shifted one pixel up-left and one pixel
       down-right (reflect padding) at 1/4 each: 6 forward passes per image

Level 2 is the multi-crop TTA of the public speedruns (airbench reports it worth about a tenth of
a point, or ~1 epoch, on CIFAR-10); it costs 3x level 1's evaluation time, which is off the
training clock but is reported as test time. The views are stacked into one batch per level, so
each level is a single forward pass of 1, 2 or 6 times the batch.

``share`` < 1 gives the views only to that share of the batch, the images the plain view is least
sure of (lowest top softmax probability; the record script gives them to its least confident 25%):
one plain pass over the batch, then the level's views of the chosen rows, whose logits replace
their plain ones. At 0.25, level 2 costs 1 + 6 x 0.25 = 2.5 passes instead of 6. The views are
computed for ceil(share x batch) rows, a count fixed by the batch's size, so the evaluation can be
captured in a CUDA graph; in a padded last batch they go to ceil(share x its real rows), the count
the real rows alone would get, and never to padding. The share is taken per evaluation batch (per
rank), not over the whole test set as the record script takes it: with share < 1 the figure
depends a little on how the test set is cut into batches (``--eval-batch-size``, the rank count),
and ``fastcifar evaluate`` reproduces a one-process run's.

``--tta-scope test`` takes the share over the whole test set instead, as the record script does:
``share_views`` replaces the plain logits of the ceil(share x N) least sure of all N images
(``least_sure``) with their views' (``views_logits``), in batches of the evaluation's size. Under
torchrun "whole" is the rank's part of the test set (every world-th image): each rank chooses among
its own images, with no collective; one process chooses over the whole test set, as the record
does, and the figure no longer depends on ``--eval-batch-size``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from fastcifar.core.config import CHOICES

TTA_LEVELS = CHOICES["tta"]
TTA_SCOPES = CHOICES["tta_scope"]  # where the share is taken: each evaluation batch, or the test set


def translations(images: torch.Tensor, pixels: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The NCHW batch shifted by ``pixels`` toward the bottom-right and toward the top-left: the
    windows at the padded image's top-left and bottom-right corners, reflect padding."""
    padded = F.pad(images, (pixels,) * 4, mode="reflect")
    h, w = images.shape[2:]
    return padded[:, :, :h, :w], padded[:, :, 2 * pixels :, 2 * pixels :]


def _stacked(model, views: list[torch.Tensor]) -> torch.Tensor:
    batch = torch.cat(views).contiguous(memory_format=torch.channels_last)
    return model(batch).float().view(len(views), views[0].shape[0], -1)


def tta_logits(
    model: torch.nn.Module, images: torch.Tensor, level: int, share: float = 1.0, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Float32 logits (B, classes) of an NCHW batch with test-time augmentation ``level``, given to
    the ``share`` of its rows the plain view is least sure of (the rest keep the plain view's
    logits); ``valid`` (B,), nonzero for real rows, keeps padding rows out of that share."""
    level = int(level)
    if level not in TTA_LEVELS:
        raise ValueError(f"TTA level must be one of {TTA_LEVELS}, not {level}")
    if not 0.0 < share <= 1.0:
        raise ValueError(f"the TTA share must lie in (0, 1], not {share}")
    if level == 0 or share == 1.0:
        return _all_views(model, images, level)
    plain = model(images).float()
    confidence = plain.softmax(1).amax(1)
    most = math.ceil(share * images.shape[0])
    if valid is not None:
        confidence = torch.where(valid.bool(), confidence, torch.full_like(confidence, 2.0))  # above any probability
    # least sure first, padding last; a stable sort, so ties (and a padded batch's real rows) come in
    # the same order on every device and batch padding; NaN (an fp16 overflow) counts as least sure
    order = torch.sort(confidence.nan_to_num(nan=-1.0), stable=True).indices[:most]
    views = _all_views(model, images.index_select(0, order), level)
    if valid is not None:
        # the share of the real rows, as if the batch held them alone (a padded batch's count is
        # known on the device only): the first ceil(share x real) of the order keep their views.
        # float64, as Python's math.ceil(share * n) computes it
        count = torch.ceil(valid.bool().sum(dtype=torch.float64) * share)
        keep = torch.arange(most, device=images.device) < count
        views = torch.where(keep[:, None], views, plain.index_select(0, order))
    return plain.index_copy(0, order, views)


def _all_views(model: torch.nn.Module, images: torch.Tensor, level: int) -> torch.Tensor:
    if level == 0:
        return model(images).float()
    if level == 1:
        return _stacked(model, [images, images.flip(3)]).mean(0)
    toward_bottom_right, toward_top_left = translations(images)
    views = [
        images,
        images.flip(3),
        toward_bottom_right,
        toward_bottom_right.flip(3),
        toward_top_left,
        toward_top_left.flip(3),
    ]
    logits = _stacked(model, views).view(3, 2, images.shape[0], -1).mean(1)  # flip mean per view
    return 0.5 * logits[0] + 0.25 * (logits[1] + logits[2])


def views_logits(model: torch.nn.Module, images: torch.Tensor, level: int) -> torch.Tensor:
    """Float32 logits (B, classes) of an NCHW batch with every view of TTA ``level``, for every row."""
    return _all_views(model, images, level)


def least_sure(logits: torch.Tensor, share: float) -> torch.Tensor:
    """Row indices of the ceil(share x rows) rows of ``logits`` whose top softmax probability is
    lowest, least sure first; a stable sort (ties in row order), NaN (an fp16 overflow) least sure."""
    confidence = logits.float().softmax(1).amax(1).nan_to_num(nan=-1.0)
    return torch.sort(confidence, stable=True).indices[: math.ceil(share * logits.shape[0])]


def share_views(
    logits: torch.Tensor, share: float, batch_size: int, views: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """``--tta-scope test``: ``logits`` (N, classes), the plain view's of a whole test set, with the
    rows of its ``share`` least sure (``least_sure``) replaced, in place, by ``views(rows)``: the
    logits of all the level's views of those rows' images, asked for ``batch_size`` rows at a time
    (the evaluation batch: the memory and, captured, the shape of one TTA pass)."""
    for rows in least_sure(logits, share).split(batch_size):
        logits.index_copy_(0, rows, views(rows))
    return logits
