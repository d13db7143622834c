"""Which training images a run uses: ``--subset-mask FILE``, ``--subset-fraction F``, ``--subset N``.

A subset is a boolean mask over the training set as read (one entry per image, in the reader's
order: the data-set index). The run folder keeps the mask it trained on (``subset_mask.npy``,
bool [n_train], what ``--val-split`` held out excluded), so a study can read which images each of
its runs saw.

- ``--subset-mask FILE``: a ``.npy`` of booleans (one per training image) or of integer indices
  (each once, in 0..n_train-1), read with ``allow_pickle=False``; anything else is refused in one
  line naming the file and the problem.
- ``--subset-fraction F``: round(F x n_train) images drawn from the subset stream
  (``core.streams``): a fixed ``--seed-subset`` gives the same subset, and with one seed a
  smaller fraction's subset lies inside a larger one's (the first images of one permutation).
- ``--subset N``: a quick run's fixed sample, the same whatever the seeds, and the test set cut to
  the same fraction (``dataset.Dataset.subset``); a study uses one of the two above, which leave
  the test set whole.
"""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import numpy as np

from fastcifar.core.atomic import write_atomic
from fastcifar.core.errors import ConfigError, DataError
from fastcifar.core.readfile import read_regular, why

NPY_MAGIC = b"\x93NUMPY"  # the first bytes of every .npy file (numpy.lib.format)
MASK_FILE = "subset_mask.npy"  # in the run folder: bool [n_train], the images the run trained on


def read_mask(path: str, n_train: int) -> np.ndarray:
    """The subset in the ``.npy`` file ``path`` as a bool mask of ``n_train``; DataError (one line
    naming the file and the problem) for anything else."""
    where = f"--subset-mask {path}"
    try:
        raw = read_regular(path)
    except OSError as exc:
        raise DataError(f"{where}: {why(exc)}") from None
    if zipfile.is_zipfile(io.BytesIO(raw)):
        raise DataError(f"{where}: a .npz archive, not a .npy array (np.save one array)")
    if not raw.startswith(NPY_MAGIC):  # np.load would try it as a pickle and say so
        raise DataError(f"{where}: not a .npy file (np.save writes one)")
    try:
        values = np.load(io.BytesIO(raw), allow_pickle=False)
    except ValueError as exc:
        if "pickle" in str(exc).lower():
            raise DataError(f"{where}: holds Python objects (a pickle); save a bool or integer array") from None
        raise DataError(f"{where}: not a .npy array ({exc})") from None
    except (OSError, EOFError) as exc:
        raise DataError(f"{where}: not a .npy array ({type(exc).__name__}: {exc})") from None
    return _as_mask(values, n_train, where)


def _as_mask(values: np.ndarray, n_train: int, where: str) -> np.ndarray:
    if values.ndim != 1:
        raise DataError(f"{where}: must be one-dimensional, not of shape {values.shape}")
    if values.dtype == np.bool_:
        if len(values) != n_train:
            raise DataError(f"{where}: {len(values)} booleans, the training set has {n_train} images")
        mask = values.copy()
    elif np.issubdtype(values.dtype, np.integer):
        if len(values) and (values.min() < 0 or values.max() >= n_train):
            bad = values[(values < 0) | (values >= n_train)][0]
            raise DataError(f"{where}: index {bad} outside 0..{n_train - 1} (the training set's images)")
        mask = np.zeros(n_train, dtype=bool)
        mask[values] = True
        if mask.sum() != len(values):
            unique, counts = np.unique(values, return_counts=True)
            raise DataError(f"{where}: index {unique[counts > 1][0]} given more than once")
    elif np.issubdtype(values.dtype, np.floating) and np.isnan(values).any():
        raise DataError(f"{where}: holds NaN; save a bool mask or integer indices")
    else:
        raise DataError(f"{where}: dtype {values.dtype}; save a bool mask or integer indices")
    if not mask.any():
        raise DataError(f"{where}: selects no training image")
    return mask


def draw_fraction(fraction: float, n_train: int, seed: int) -> np.ndarray:
    """round(``fraction`` x ``n_train``) images (at least 1) drawn from ``seed``, as a bool mask:
    the first ones of a permutation, so a smaller fraction's subset lies inside a larger one's."""
    keep = max(1, round(fraction * n_train))
    mask = np.zeros(n_train, dtype=bool)
    mask[np.random.default_rng(seed).permutation(n_train)[:keep]] = True
    return mask


def chosen_mask(cfg, n_train: int, subset_seed: int) -> np.ndarray | None:
    """The subset ``--subset-mask`` or ``--subset-fraction`` chooses (None: neither is given;
    ``--subset N`` is ``Dataset.subset``'s)."""
    if cfg.subset_mask:
        return read_mask(cfg.subset_mask, n_train)
    if cfg.subset_fraction:
        return draw_fraction(cfg.subset_fraction, n_train, subset_seed)
    return None


def save_mask(folder: str | Path, mask: np.ndarray) -> Path:
    """``mask`` (bool) as the run folder's ``subset_mask.npy``, written whole or not at all."""
    path = Path(folder) / MASK_FILE
    blob = io.BytesIO()
    np.save(blob, np.asarray(mask, dtype=bool), allow_pickle=False)
    try:
        return write_atomic(path, blob.getvalue())
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {why(exc)}") from None
