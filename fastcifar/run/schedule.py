"""The run's schedule, in one place: how many steps each epoch has, the learning rate of every
step, and the device table a captured step reads its rate from.

- ``epoch_lengths``: ceil(epochs x steps) steps in all (airbench's count): whole epochs and a last
  one cut short when ``--epochs`` has a fraction;
- ``warmup_decay_lr`` and ``stepwise_lr``: the two shapes of the rate, as functions of one step
  (``--lr-at end``: by epoch progress; ``start``: by step index, airbench's);
- ``lr_schedule``: the rate of every step of a run, computed with numpy in float64 in the same
  operation order as the two functions, so each entry is the same double (a test holds it to
  that) without a Python float per step;
- ``DeviceSchedule``: that table on the device, read at a device-side step counter, so a captured
  CUDA graph replays each later step's rate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch


def epoch_lengths(epochs: float, steps: int) -> list[int]:
    """Steps in each epoch: ceil(epochs x steps) in all (airbench's count), whole epochs of
    ``steps`` and a last one cut short when ``epochs`` has a fraction (9.9 x 48: 9 x 48 + 44)."""
    total = math.ceil(round(epochs * steps, 9))  # round: 1.1 x 10 is 11.000000000000002 in floats
    return [min(steps, total - start) for start in range(0, total, steps)]


def warmup_decay_lr(
    progress: float, epochs: float, warmup_epochs: float, peak: float, start: float = 0.0, end: float = 0.0
) -> float:
    """Piecewise linear: ``start x peak`` at epoch 0, ``peak`` at ``warmup_epochs``, ``end x peak``
    at ``epochs`` (the seed recipe: start = end = 0).

    ``progress`` is in epochs (fractional). With no warm-up the rate starts at the peak.
    """
    if progress < warmup_epochs:
        return peak * (start + (1.0 - start) * progress / warmup_epochs)
    if epochs <= warmup_epochs:
        return peak
    left = max(0.0, (epochs - progress) / (epochs - warmup_epochs))  # 1 at the peak, 0 at the end
    return peak * (end + (1.0 - end) * left)


def stepwise_lr(step: int, total: int, warmup_steps: int, peak: float, start: float = 0.0, end: float = 0.0) -> float:
    """airbench's step-indexed schedule: linear through (0, start x peak), (warmup_steps, peak),
    (total, end x peak), read at the step's index (step 0 at exactly ``start``; step total - 1
    stops one step short of ``end``)."""
    if step < warmup_steps:
        return peak * (start + (1.0 - start) * step / warmup_steps)
    return peak * (1.0 + (end - 1.0) * (step - warmup_steps) / max(total - warmup_steps, 1))


def lr_schedule(cfg, steps: int, peak: float) -> np.ndarray:
    """The rate of every step of a run (float64). ``lr_at end``: step i of the run reads the
    piecewise-linear schedule at progress (i + 1) / steps epochs; ``start`` (airbench): step i
    reads it at i, the warm-up floored to whole steps, int(total x warmup_epochs / epochs)."""
    total = sum(epoch_lengths(cfg.epochs, steps))
    index = np.arange(total, dtype=np.float64)
    start, end = float(cfg.lr_start), float(cfg.lr_end)
    with np.errstate(divide="ignore", invalid="ignore"):  # np.where computes the branch it drops too
        if cfg.lr_at == "end":
            progress, warm, epochs = (index + 1) / steps, float(cfg.warmup_epochs), float(cfg.epochs)
            rising = peak * (start + (1.0 - start) * progress / warm)
            falling = (
                np.full(total, peak)
                if epochs <= warm
                else peak * (end + (1.0 - end) * np.maximum(0.0, (epochs - progress) / (epochs - warm)))
            )
            return np.where(progress < warm, rising, falling)
        warm = int(round(total * cfg.warmup_epochs / cfg.epochs, 9))
        rising = peak * (start + (1.0 - start) * index / warm)
        falling = peak * (1.0 + (end - 1.0) * (index - warm) / max(total - warm, 1))
        return np.where(index < warm, rising, falling)


class DeviceSchedule:
    """Per-step values (the learning rate) in a device table, read at a device-side step counter.

    ``apply(target)`` copies the current entry into ``target`` and advances the counter, both as
    device ops, so a captured graph replays them with the value of each later step."""

    def __init__(self, values: Sequence[float] | np.ndarray, device: torch.device):
        if len(values) == 0:
            raise ValueError("a schedule needs at least one step")
        self.values = np.asarray(values, dtype=np.float64)  # the host copy, for logs
        self.table = torch.tensor(self.values, dtype=torch.float32, device=device)
        self.counter = torch.zeros(1, dtype=torch.int64, device=device)

    def __len__(self) -> int:
        return len(self.values)

    def value(self, step: int) -> float:
        """The rate of step ``step`` (0-based), as the host computed it: for logs."""
        return float(self.values[step])

    def apply(self, target: torch.Tensor) -> None:
        # clamp: a step past the end (a warm-up step replayed too often) reuses the last value
        index = self.counter.clamp(max=len(self.values) - 1)
        target.copy_(torch.index_select(self.table, 0, index).reshape(target.shape))
        self.counter.add_(1)

    def reset(self, step: int = 0) -> None:
        self.counter.fill_(step)
