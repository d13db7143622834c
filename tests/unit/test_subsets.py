"""Training subsets (``fastcifar/data/subsets.py``): a mask file read or refused in one line naming
the file and the problem, a fraction drawn from the subset stream, the mask saved whole; and the
data set cut by a mask (``Dataset.masked``, ``--val-split`` after it)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from fastcifar.core.config import Config, ConfigError, in_steps, validate
from fastcifar.core.errors import DataError
from fastcifar.data.dataset import Dataset, for_run
from fastcifar.data.subsets import MASK_FILE, chosen_mask, draw_fraction, read_mask, save_mask

N = 50


def saved(tmp_path, array, name="mask.npy", **kw) -> str:
    path = tmp_path / name
    np.save(path, array, **kw)
    return str(path)


def test_a_bool_mask_or_indices_give_the_same_subset(tmp_path):
    mask = np.arange(N) % 3 == 0
    assert (read_mask(saved(tmp_path, mask), N) == mask).all()
    for dtype in (np.int64, np.int32, np.uint16):
        indices = np.flatnonzero(mask).astype(dtype)[::-1]  # any order
        assert (read_mask(saved(tmp_path, indices), N) == mask).all()


@pytest.mark.parametrize(
    "array,problem",
    [
        (np.ones(N - 1, bool), "49 booleans, the training set has 50 images"),
        (np.zeros(N, bool), "selects no training image"),
        (np.array([], np.int64), "selects no training image"),
        (np.array([3, 50]), "index 50 outside 0..49"),
        (np.array([-1, 3]), "index -1 outside 0..49"),
        (np.array([4, 7, 4]), "index 4 given more than once"),
        (np.array([0.0, np.nan]), "holds NaN"),
        (np.array([0.0, 1.0]), "dtype float64; save a bool mask or integer indices"),
        (np.array(["a", "b"]), "dtype <U1"),
        (np.ones((N, 1), bool), "must be one-dimensional, not of shape (50, 1)"),
    ],
)
def test_a_bad_mask_is_one_line_naming_the_file_and_the_problem(tmp_path, array, problem):
    path = saved(tmp_path, array)
    with pytest.raises(DataError) as err:
        read_mask(path, N)
    assert str(err.value).startswith(f"--subset-mask {path}: ") and problem in str(err.value)
    assert "\n" not in str(err.value)


def test_a_pickle_a_foreign_file_and_a_missing_one_are_refused(tmp_path):
    objects = saved(tmp_path, np.array([1, "a", None], dtype=object), allow_pickle=True)
    with pytest.raises(DataError, match="holds Python objects \\(a pickle\\)"):
        read_mask(objects, N)
    text = tmp_path / "mask.txt"
    text.write_text("1 2 3\n")
    with pytest.raises(DataError, match="mask.txt: not a .npy file"):
        read_mask(str(text), N)
    archive = tmp_path / "mask.npz"
    np.savez(archive, m=np.ones(N, bool))
    with pytest.raises(DataError, match="a .npz archive, not a .npy array"):
        read_mask(str(archive), N)
    truncated = tmp_path / "cut.npy"
    truncated.write_bytes((tmp_path / "mask.npy").read_bytes()[:70])
    with pytest.raises(DataError, match="cut.npy: not a .npy array"):
        read_mask(str(truncated), N)
    with pytest.raises(DataError, match="absent.npy: No such file or directory"):
        read_mask(str(tmp_path / "absent.npy"), N)
    with pytest.raises(DataError, match="a folder, not a regular file"):
        read_mask(str(tmp_path), N)
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "fifo.npy")
        with pytest.raises(DataError, match="FIFO"):
            read_mask(str(tmp_path / "fifo.npy"), N)


def test_a_fraction_is_drawn_from_the_subset_seed_and_nests():
    half = draw_fraction(0.5, 1000, seed=7)
    assert half.sum() == 500 and (draw_fraction(0.5, 1000, seed=7) == half).all()
    assert not (draw_fraction(0.5, 1000, seed=8) == half).all()
    assert (half <= draw_fraction(0.6, 1000, seed=7)).all(), "a smaller share lies inside a larger"
    assert draw_fraction(1e-9, 1000, seed=7).sum() == 1
    cfg = Config(subset_fraction=0.5)
    assert (chosen_mask(cfg, 1000, 7) == half).all() and chosen_mask(Config(), 1000, 7) is None


def test_the_mask_is_saved_whole(tmp_path):
    mask = np.arange(N) % 2 == 1
    path = save_mask(tmp_path, mask)
    assert path.name == MASK_FILE and sorted(p.name for p in tmp_path.iterdir()) == [MASK_FILE]
    back = np.load(path, allow_pickle=False)
    assert back.dtype == np.bool_ and (back == mask).all()
    with pytest.raises(ConfigError, match=f"cannot write {tmp_path / 'no' / MASK_FILE}: No such file"):
        save_mask(tmp_path / "no", mask)


def test_subset_options_exclude_each_other_in_one_line():
    with pytest.raises(ConfigError) as err:
        validate(Config(subset=100, subset_fraction=0.5))
    assert str(err.value) == "--subset and --subset-fraction each choose the training subset: give one of them"
    with pytest.raises(ConfigError, match="--subset-mask and --subset-fraction each"):
        validate(Config(subset_mask="m.npy", subset_fraction=0.5))
    with pytest.raises(ConfigError, match=r"--subset-fraction must lie in \[0, 1\], not 1.5"):
        validate(Config(subset_fraction=1.5))


def dataset(n=N) -> Dataset:
    images = np.zeros((n, 32, 32, 3), np.uint8)
    images[:, 0, 0, 0] = np.arange(n)  # each image says its data-set index
    return Dataset(images, np.arange(n) % 10, images[:20], np.arange(20) % 10, tuple("abcdefghij"), "t")


def test_a_masked_set_keeps_its_data_set_indices_and_the_whole_test_set():
    mask = np.arange(N) % 4 != 0
    data, _, _, notes = for_run(dataset(), 0, 0, mask)
    assert (data.index == np.flatnonzero(mask)).all() and data.n_read == N
    assert (data.train_images[:, 0, 0, 0] == data.index).all() and (data.mask() == mask).all()
    assert len(data.test_labels) == 20 and notes == ["subset: 37 of 50 training images; the test set whole"]
    whole, _, _, _ = for_run(dataset(), 0, 0)
    assert whole.kept is None and whole.mask().all() and (whole.index == np.arange(N)).all()
    cut, _, _, _ = for_run(dataset(), 10, 0)  # --subset N: its indices too
    assert (cut.train_images[:, 0, 0, 0] == cut.index).all() and cut.mask().sum() == 10


def test_val_split_holds_out_the_same_images_when_the_subset_loses_one():
    full, val_full, _, _ = for_run(dataset(), 0, 8)
    mask = np.ones(N, bool)
    mask[np.flatnonzero(~full.mask())[0]] = False  # drop one held-out image: one other replaces it
    mask[full.index[0]] = False  # and one training image: nothing changes for the held-out set
    cut, val_cut, _, _ = for_run(dataset(), 0, 8, mask)
    assert len(set(val_full[:, 0, 0, 0]) & set(val_cut[:, 0, 0, 0])) == 7
    assert not (cut.mask() & ~mask).any() and cut.mask().sum() == N - 2 - 8


def test_steps_fix_the_optimizer_steps_whatever_the_subset():
    cfg = Config(epochs=10, warmup_epochs=2, steps=45)
    for steps_per_epoch in (10, 4, 45, 90):
        got = in_steps(cfg, steps_per_epoch)
        assert round(got.epochs * steps_per_epoch, 9) == 45 and got.warmup_epochs / got.epochs == 0.2
        assert in_steps(got, steps_per_epoch) is got, "a resumed run's settings are in steps already"
    assert in_steps(Config(), 10) == Config()
    with pytest.raises(ConfigError, match="--steps 45 is 1125 epochs of 0.04"):
        in_steps(Config(steps=45), 0.04)
