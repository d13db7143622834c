"""``--tensorboard``: each run's epochs as TensorBoard event files, a component of the run.

Rank 0 writes ``tensorboard/run<N>/`` in the run folder (``tensorboard --logdir runs`` then shows
every run of every invocation side by side): per epoch, after its evaluation and off the clock, the
train and test (or --val-split validation) loss and accuracy, the learning rate (the log's lr
column), the training rate in images a second, the mean step time and the epoch's training and
evaluation times; at the start, the settings as text. torch's ``SummaryWriter`` writes the files;
it needs the ``tensorboard`` package (``pip install -e '.[tensorboard]'``), which ``check`` asks
for before anything is read or written. A folder it cannot write (``tensorboard`` in the run folder
is a file, or a folder without write permission; a disk that fills later) turns the logger off with
one line on stderr, and the run goes on: its log.txt and summary.json are the record, TensorBoard
a view of it.
"""

from __future__ import annotations

import json
import sys

from fastcifar.core import optional
from fastcifar.core.config import Config, config_file_text
from fastcifar.run.component import Component

FIX = "pip install tensorboard (or pip install -e '.[tensorboard]' in the checkout), or leave out --tensorboard"


def check(cfg: Config) -> None:
    """With --tensorboard, a tensorboard that cannot be imported is one line, exit 2, before the run starts."""
    if cfg.tensorboard:
        optional.load("tensorboard", FIX, "--tensorboard")
        optional.load("torch.utils.tensorboard", FIX, "--tensorboard")  # torch's check of its version


class TensorBoard(Component):
    """Run ``run``'s epochs into ``folder`` (rank 0's run folder / tensorboard / run<N>)."""

    def __init__(self, cfg: Config, folder, run: int, images_per_step: int, steps: list[int], names: dict, say=print):
        SummaryWriter = optional.load("torch.utils.tensorboard", FIX, "--tensorboard").SummaryWriter
        self.cfg, self.images_per_step, self.steps, self.say = cfg, images_per_step, steps, say
        self.evaluated = "val" if names else "test"  # --val-split: the epochs' evaluation is on held-out images
        self.folder = folder / "tensorboard" / f"run{run}"
        self.writer = None
        try:
            self.writer = SummaryWriter(log_dir=str(self.folder))
        except OSError as exc:
            self._off(exc)

    def _off(self, exc: OSError) -> None:
        """One line, and no more TensorBoard for this run; the run itself goes on."""
        self.writer = None
        why = exc.strerror or type(exc).__name__
        print(f"fastcifar: note: --tensorboard is off for this run: cannot write {self.folder}: {why}", file=sys.stderr)

    def start(self, result) -> None:
        if self.writer is None:
            return
        # where the events go, before the first epoch: TensorBoard can watch the run as it trains
        self.say(f"tensorboard: events in {self.folder} (tensorboard --logdir {self.folder.parent.parent.parent})")
        try:  # markdown: a code block keeps the JSON's lines
            self.writer.add_text("settings", "```\n" + config_file_text(self.cfg) + "```", 0)
            self.writer.add_text("seed", json.dumps(result.seed), 0)
        except OSError as exc:
            self._off(exc)

    def epoch_done(self, epoch: int, record) -> None:
        if self.writer is None:
            return
        try:
            self._epoch(epoch, record)
        except OSError as exc:
            self._off(exc)

    def _epoch(self, epoch: int, record) -> None:
        step, steps = record.epoch, self.steps[epoch]
        scalars = {
            "loss/train": record.train_loss,
            f"loss/{self.evaluated}": record.test_loss,
            "accuracy/train": record.train_acc,
            f"accuracy/{self.evaluated}": record.test_acc,
            "lr": record.lr,
            "rate/images_per_s": steps * self.images_per_step / max(record.train_time, 1e-9),
            "time/step_s": record.train_time / steps,
            "time/epoch_train_s": record.train_time,
            "time/epoch_eval_s": record.test_time,
        }
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()  # a stopped run keeps every finished epoch, as timing_log.tsv does

    def finish(self, result) -> None:
        if self.writer is not None:
            try:
                self.writer.close()
            except OSError as exc:
                self._off(exc)
