"""The in-memory form every reader returns: uint8 NHWC images and int64 labels, train and test."""

from __future__ import annotations

import dataclasses
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
    # which images of the training set as read these training images are (its data-set indices):
    # bool [n as read]; None = all of them, in order
    kept: np.ndarray | None = None
    note: str = ""  # what the reader left out, for the log (an image folder's skipped files); "" when nothing

    @property
    def n_read(self) -> int:
        """Training images as read, before any subset: the range of the data-set indices."""
        return len(self.train_labels) if self.kept is None else len(self.kept)

    @property
    def index(self) -> np.ndarray:
        """Each training image's data-set index (its position in the training set as read)."""
        return np.arange(len(self.train_labels)) if self.kept is None else np.flatnonzero(self.kept)

    def mask(self) -> np.ndarray:
        """The training images these are, as a bool mask of the training set as read."""
        return np.ones(len(self.train_labels), dtype=bool) if self.kept is None else self.kept.copy()

    def keep(self, rows: np.ndarray, source: str | None = None) -> Dataset:
        """The set with only the training images at the sorted positions ``rows``, their data-set
        indices kept (``kept``); the test set as it is."""
        kept = np.zeros(self.n_read, dtype=bool)
        kept[self.index[rows]] = True
        return dataclasses.replace(
            self,
            train_images=self.train_images[rows],
            train_labels=self.train_labels[rows],
            source=self.source if source is None else source,
            kept=kept,
        )

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
        cut = self.keep(pick_train, f"{self.source} (a fixed subset)")  # the counts are printed beside the source
        return dataclasses.replace(
            cut, test_images=self.test_images[pick_test], test_labels=self.test_labels[pick_test]
        )

    def masked(self, mask: np.ndarray, source: str) -> Dataset:
        """The training images ``mask`` (bool, over the training set as read) selects; the test set whole."""
        if self.kept is not None or len(mask) != len(self.train_labels):
            raise ValueError("a subset mask applies to the training set as read, once")
        return self.keep(np.flatnonzero(mask), source)

    def hold_out(self, n_val: int) -> tuple[Dataset, np.ndarray, np.ndarray]:
        """``--val-split``: (the set without ``n_val`` training images, their images, their labels).
        A fixed choice from a constant seed, the same on every rank, before any sharding; 0 leaves
        the set as it is (and holds out nothing). The seed's permutation runs over the training set
        as read and is filtered to this set's images, so a subset that drops an image keeps the
        same held-out images (one of them at most is replaced)."""
        n_all = len(self.train_labels)
        if n_val <= 0:
            return self, self.train_images[:0], self.train_labels[:0]
        if n_val >= n_all:
            raise DataError(f"--val-split {n_val} leaves no training images: {self.source} has {n_all}")
        position = np.full(self.n_read, -1)
        position[self.index] = np.arange(n_all)
        order = position[np.random.default_rng(2).permutation(self.n_read)]
        order = order[order >= 0]
        val, keep = np.sort(order[:n_val]), np.sort(order[n_val:])
        return self.keep(keep), self.train_images[val], self.train_labels[val]


def for_run(
    data: Dataset, subset: int, val_split: int, mask: np.ndarray | None = None
) -> tuple[Dataset, np.ndarray, np.ndarray, list[str]]:
    """``--subset`` (or the subset ``mask``: ``subsets.chosen_mask``) then ``--val-split`` on a read
    set: (the training and test sets, the held-out images and labels, lines for the log saying
    what was cut)."""
    notes = []
    if mask is not None:
        cut = data.masked(mask, f"{data.source} (a subset)")
        notes.append(f"subset: {int(mask.sum())} of {len(mask)} training images; the test set whole")
    else:
        cut = data.subset(subset)
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
