"""The in-memory form every reader returns: uint8 NHWC images and int64 labels, train and test."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fastcifar.core.errors import DataError
from fastcifar.core.names import check_class_names

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
IMAGE_SHAPE = (32, 32, 3)


@dataclass
class Dataset:
    train_images: np.ndarray  # (N, 32, 32, 3) uint8
    train_labels: np.ndarray  # (N,) int64, 0..9
    test_images: np.ndarray
    test_labels: np.ndarray
    classes: tuple[str, ...]
    source: str  # what was read, for logs and summaries
    note: str = ""  # what the reader left out, for the log (an image folder's skipped files); "" when nothing

    def validate(self) -> Dataset:
        """Check shapes, dtypes, label range and class names (``core.names``); raise DataError
        naming what is wrong."""
        check_class_names(self.classes, f"{self.source}: class names", DataError)
        for split in ("train", "test"):
            images = getattr(self, f"{split}_images")
            labels = getattr(self, f"{split}_labels")
            if images.dtype != np.uint8 or images.ndim != 4 or images.shape[1:] != IMAGE_SHAPE:
                raise DataError(
                    f"{self.source}: {split} images must be uint8 (N, 32, 32, 3), got {images.dtype} {images.shape}"
                )
            if labels.shape != (images.shape[0],):
                raise DataError(f"{self.source}: {split} has {images.shape[0]} images but {labels.shape[0]} labels")
            if len(labels) and (labels.min() < 0 or labels.max() >= len(self.classes)):
                raise DataError(f"{self.source}: {split} labels outside 0..{len(self.classes) - 1}")
            if len(labels) == 0:
                raise DataError(f"{self.source}: the {split} split is empty")
        return self

    def subset(self, n_train: int) -> Dataset:
        """A fixed random sample of ``n_train`` training images and the same fraction of the
        test set (at least 100): for short CPU runs. Image folders are stored class by class,
        so taking the first N would give one class; the sample uses a constant seed instead."""
        n_all = len(self.train_labels)
        if n_train > n_all:
            raise DataError(f"--subset {n_train} is larger than the training set of {self.source} ({n_all} images)")
        if n_train <= 0 or n_train == n_all:
            return self
        n_test = min(len(self.test_labels), max(100, round(len(self.test_labels) * n_train / n_all)))
        pick_train = np.sort(np.random.default_rng(0).permutation(n_all)[:n_train])
        pick_test = np.sort(np.random.default_rng(1).permutation(len(self.test_labels))[:n_test])
        return Dataset(
            self.train_images[pick_train],
            self.train_labels[pick_train],
            self.test_images[pick_test],
            self.test_labels[pick_test],
            self.classes,
            f"{self.source} (a fixed subset)",
        )  # the counts are printed beside the source

    def hold_out(self, n_val: int) -> tuple[Dataset, np.ndarray, np.ndarray]:
        """``--val-split``: (the set without ``n_val`` training images, their images, their labels).
        A fixed choice from a constant seed, the same on every rank, before any sharding; 0 leaves
        the set as it is (and holds out nothing)."""
        n_all = len(self.train_labels)
        if n_val <= 0:
            return self, self.train_images[:0], self.train_labels[:0]
        if n_val >= n_all:
            raise DataError(f"--val-split {n_val} leaves no training images: {self.source} has {n_all}")
        order = np.random.default_rng(2).permutation(n_all)
        val, keep = np.sort(order[:n_val]), np.sort(order[n_val:])
        rest = Dataset(
            self.train_images[keep],
            self.train_labels[keep],
            self.test_images,
            self.test_labels,
            self.classes,
            self.source,
        )
        return rest, self.train_images[val], self.train_labels[val]


def for_run(data: Dataset, subset: int, val_split: int) -> tuple[Dataset, np.ndarray, np.ndarray, list[str]]:
    """``--subset`` then ``--val-split`` on a read set: (the training and test sets, the held-out
    images and labels, lines for the log saying what was cut)."""
    cut = data.subset(subset)
    notes = []
    if len(cut.test_labels) < len(data.test_labels):
        notes.append(
            f"--subset {subset}: the test set is cut to the same fraction, {len(cut.test_labels)} of "
            f"{len(data.test_labels)} images (its accuracy is noisier than the full set's)"
        )
    cut, val_images, val_labels = cut.hold_out(val_split)
    if val_split:
        notes.append(
            f"--val-split {val_split}: each epoch is evaluated on {val_split} held-out training "
            f"images (val_acc); the test set once, after the last epoch"
        )
    return cut, val_images, val_labels, notes
