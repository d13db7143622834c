"""``--save-outputs``: a run's per-example outputs, in memory and as .npy files in its run folder.

What a study of many small runs reads per image (data attribution, leave-k-out pairs, membership
inference, training variance): each run's logits and margins.

- test (``--save-outputs test`` or ``both``): the test set's logits exactly as the run's reported
  accuracy counted them: the evaluation's own tensors (``EvalStep.keep_logits``), with its TTA
  level and ``--tta-share`` selection, from the last evaluation of the test set (the last epoch's,
  or with ``--val-split`` the one after it), so the argmax of each row is the prediction the
  accuracy counted. With ``--subset N`` the run's test set is its fixed test sample.
- train (``train`` or ``both``): the plain view (no augmentation, no TTA) of every training image
  the data set holds, in the data set's order, also those a ``--subset`` or ``--val-split`` left
  out of training: one file per run lines up with every other run's, whatever its subset.

Logits are fp16 (10,000 x 10: 200 KB; 50,000 x 10: 1 MB). Rounding to fp16 can tie a row's two
largest logits (about one step of fp16, 1/128 between 8 and 16, apart), and a tie's argmax is the
lower class; where that would change the row's argmax, its counted class is rounded one fp16 step
up instead (``as_fp16``), so the files' argmax accuracy is the reported one to the image. Margins
are fp32, from the fp32 logits before rounding: the correct class's logit minus the largest other,
> 0 where the prediction was right, < 0 where wrong (0, an exact tie, counts for the lower class).

Under torchrun every rank evaluates its share (``EvalSet``'s dealing) and the rows are gathered in
the set's order (``distributed.all_gather_dealt``): every rank's ``RunResult.outputs`` holds them
all, rank 0 writes the files, each written whole or not at all (``core.atomic``).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fastcifar.core import atomic
from fastcifar.ops.augment import CIFAR10_MEAN, CIFAR10_STD, normalize
from fastcifar.ops.tta import tta_logits
from fastcifar.parallel import distributed
from fastcifar.run.component import Component

FOLDER = "outputs"
FILES = ("test_logits", "test_margins", "train_logits", "train_margins")  # each NAME.npy


@dataclass
class PerExample:
    """A run's per-example outputs (``None``: not asked for), as written to its outputs folder."""

    test_logits: np.ndarray | None = None  # (test images, classes) float16, the reported accuracy's
    test_margins: np.ndarray | None = None  # (test images,) float32: correct logit - largest other
    train_logits: np.ndarray | None = None  # (training images, classes) float16, plain view, data-set order
    train_margins: np.ndarray | None = None  # (training images,) float32


def wanted(setting: str) -> tuple[bool, bool]:
    """(test, train) for a ``--save-outputs`` value."""
    return setting in ("test", "both"), setting in ("train", "both")


def folder(run_dir, run: int, runs: int) -> Path:
    """``outputs/`` for a single run, ``outputs-run<N>/`` for several (as the model files are named)."""
    return Path(run_dir) / (FOLDER if runs == 1 else f"{FOLDER}-run{run}")


def margins(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(N,) fp32: each row's logit of its label minus the largest of the others."""
    logits = logits.float()
    correct = logits.gather(1, labels[:, None]).squeeze(1)
    others = logits.scatter(1, labels[:, None], float("-inf")).amax(1)
    return correct - others


def as_fp16(logits: torch.Tensor) -> np.ndarray:
    """fp32 logits (N, classes) -> fp16 whose row argmax is the fp32 row argmax: where rounding
    ties the largest logit with another that comes first, the largest is rounded one fp16 step up
    (an error of at most one step, 2**-7 between 8 and 16)."""
    want = logits.argmax(1).cpu().numpy()  # torch's argmax: the first of tied maxima, as numpy's
    half = logits.cpu().numpy().astype(np.float16)
    rows = np.flatnonzero(half.argmax(1) != want)
    half[rows, want[rows]] = np.nextafter(half[rows, want[rows]], np.float16(np.inf))
    return half


def save(path: Path, array: np.ndarray) -> None:
    """``array`` as ``path`` (.npy: ``np.load(path, mmap_mode="r")`` maps it), written whole or not at all."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    atomic.write_atomic(path, buffer.getvalue())


@torch.no_grad()
def plain_logits(model, images: np.ndarray, batch_size: int, dtype, ctx, beat=lambda: None) -> torch.Tensor:
    """fp32 logits of this rank's share of uint8 NHWC ``images`` (EvalSet's dealing: rank r, r + N,
    ...), no augmentation, normalized per batch on the device (the whole training set normalized
    at once would take 600 MB of fp32)."""
    mine = np.arange(ctx.rank, len(images), ctx.world_size)
    rows = []
    for start in range(0, len(mine), batch_size):
        batch = torch.from_numpy(images[mine[start : start + batch_size]]).to(ctx.device)
        rows.append(tta_logits(model, normalize(batch, CIFAR10_MEAN, CIFAR10_STD, dtype), 0))
        beat()  # the progress watchdog: a CPU pass over 50,000 images outlasts a small --dist-timeout-s
    return torch.cat(rows)


class Outputs(Component):
    """``--save-outputs``: keeps the last test evaluation's logits (from the last epoch's end, so
    earlier evaluations copy nothing), takes the training set's plain-view logits after the last
    epoch, and gives both to the run's result (``outputs``, ``output_files``) and, on rank 0, to
    its run folder. Before the watchdog closes: it gathers over the ranks."""

    def __init__(self, session, model, eval_step, run: int, epochs: int, beat=lambda: None):
        self.session, self.model, self.eval_step, self.run, self.epochs = session, model, eval_step, run, epochs
        self.test, self.train = wanted(session.cfg.save_outputs)
        self.beat = beat

    def epoch_end(self, epoch: int) -> None:
        if self.test and epoch == self.epochs - 1:
            self.eval_step.keep_logits()

    def finish(self, result) -> None:
        s, ctx = self.session, self.session.ctx
        out = PerExample()
        if self.test:
            # every run evaluates the test set after its last epoch here: a checkpoint is never the last epoch's
            rows = torch.cat(self.eval_step.kept)
            total = s.test_set.total
            logits = distributed.all_gather_dealt(rows, total, ctx)
            out.test_margins = distributed.all_gather_dealt(margins(rows, s.test_set.labels), total, ctx).cpu().numpy()
            out.test_logits = as_fp16(logits)
            self.eval_step.kept = None
        if self.train:
            self.model.eval()
            images, labels = s.whole.train_images, s.whole.train_labels
            rows = plain_logits(self.model, images, s.cfg.eval_batch_size, s.dtype, ctx, self.beat)
            mine = torch.from_numpy(labels[ctx.rank :: ctx.world_size]).to(ctx.device)
            logits = distributed.all_gather_dealt(rows, len(labels), ctx)
            out.train_margins = distributed.all_gather_dealt(margins(rows, mine), len(labels), ctx).cpu().numpy()
            out.train_logits = as_fp16(logits)
        result.outputs = out
        if s.log.dir is None:  # not rank 0: the arrays in memory only
            return
        where = folder(s.log.dir, self.run, s.cfg.runs)
        where.mkdir(parents=True, exist_ok=True)
        for name in FILES:
            array = getattr(out, name)
            if array is not None:
                save(where / f"{name}.npy", array)
                result.output_files[name] = str((where / f"{name}.npy").relative_to(s.log.dir))
        s.log.line(f"outputs: {', '.join(result.output_files.values())} (per-example; docs/experiments.md)")
