"""The divergence guard: a run whose loss is non-finite or has exploded stops with one line.

Without it `--lr 1e6` trained on NaN for every epoch, "finished" at chance accuracy, exited 0
and wrote a bare NaN into summary.json. The check reads the epoch's mean training loss, which
the trainer already has on the host once per epoch (all ranks hold the same all-reduced value,
so every rank stops at the same epoch): no extra synchronization inside the step.
"""

from __future__ import annotations

import math

from fastcifar.core.signals import StopRun
from fastcifar.run.component import Component

# A net that predicts every class equally scores ln(classes) (2.30 nats for 10); a mean training
# loss 10x above that means the logits have blown up, not that learning is slow.
EXPLODED_FACTOR = 10.0


class Diverged(StopRun):
    exit_code = 4  # 2 is bad input, 3 a lost rank


class LossGuard(Component):
    """The run's component: reads each epoch's record after its evaluation."""

    def __init__(self, num_classes: int, factor: float = EXPLODED_FACTOR):
        self.limit = factor * math.log(max(num_classes, 2))

    def check(self, train_loss: float, run: int, epoch: int) -> None:
        """Raise ``Diverged`` if the mean training loss of ``epoch`` (1-based) is non-finite or above the limit."""
        if not math.isfinite(train_loss):
            raise Diverged(
                f"training diverged: the training loss is {train_loss} in run {run}, epoch {epoch}; try a lower --lr"
            )
        if train_loss > self.limit:
            raise Diverged(
                f"training diverged: the training loss is {train_loss:.4g} in run {run}, epoch {epoch} "
                f"(above {self.limit:.3g}, {EXPLODED_FACTOR:g}x a uniform guess); try a lower --lr"
            )

    def epoch_done(self, epoch: int, record) -> None:
        self.check(record.train_loss, record.run, epoch + 1)
