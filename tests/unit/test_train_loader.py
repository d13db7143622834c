"""The training loader a run gets (``fastcifar/data/train_loader.py``): which one for ``--loader``
and the device, and the one built, with the augmentation spec handed to it whole; under
--emulate-ranks, each rank's loader side by side (N = 3: unequal shards)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastcifar.data import dali as dl
from fastcifar.data import shard_indices
from fastcifar.data import train_loader as tl
from fastcifar.data.dali import DaliUnavailableError, dali_available
from fastcifar.data.loader import EmulatedRanks
from fastcifar.data.train_loader import make_train_loader, resolve_loader
from fastcifar.ops.augment import AugmentSpec

CPU = torch.device("cpu")

LOADERS = ["torch", pytest.param("dali", marks=pytest.mark.skipif(not dali_available()[0], reason="no DALI here"))]


def test_resolve_loader_explicit_and_auto(monkeypatch):
    assert resolve_loader("torch", "cuda") == ("torch", None)
    monkeypatch.setattr(dl, "dali_available", lambda: (True, "DALI 9.9"))
    assert resolve_loader("dali", "cuda") == ("dali", None)
    # measured: the torch loader on CUDA (H100, ~10x DALI's images/s), DALI on the CPU backend
    assert resolve_loader("auto", "cuda:1") == ("torch", None)
    assert resolve_loader("auto", "cpu") == ("dali", None)
    monkeypatch.setitem(tl.AUTO_LOADER, "cpu", "torch")
    assert resolve_loader("auto", "cpu") == ("torch", None)
    with pytest.raises(ValueError, match="--loader must be one of"):
        resolve_loader("nvidia", "cuda")


def test_missing_dali_fails_explicit_request_and_notices_fallback(monkeypatch):
    monkeypatch.setattr(dl, "dali_available", lambda: (False, "ImportError: No module named 'nvidia.dali'"))
    with pytest.raises(DaliUnavailableError) as err:
        resolve_loader("dali", "cuda")
    assert "\n" not in str(err.value) and "--loader dali" in str(err.value) and "nvidia.dali" in str(err.value)
    monkeypatch.setitem(tl.AUTO_LOADER, "cuda", "dali")
    name, notice = resolve_loader("auto", "cuda")
    assert name == "torch" and "\n" not in notice and "DALI unavailable" in notice


@pytest.mark.parametrize("name", LOADERS)
@pytest.mark.parametrize("ranks", [1, 2])
def test_the_spec_reaches_every_loader_whole(name, ranks):
    """The factory passes the augmentation as the one object it was given, to the loader and to
    each emulated rank's: a new field of the spec needs no edit on the way."""
    images = np.random.default_rng(0).integers(0, 256, (40, 32, 32, 3), dtype=np.uint8)
    spec = AugmentSpec(crop_pad=2, cutout=4, flip_mode="alternate", brightness=0.1)
    loader = make_train_loader(
        name,
        images,
        np.arange(40) % 10,
        shard_indices(40, 0, 1),
        8,
        2,
        augment=spec,
        kernels="torch",
        dtype=torch.float32,
        device=torch.device("cpu"),
        emulate_ranks=ranks,
    )
    each = loader.loaders if ranks > 1 else [loader]
    assert isinstance(loader, EmulatedRanks) == (ranks > 1) and len(each) == ranks
    assert all(part.augment is spec for part in each)
    assert [part.rank for part in each] == list(range(ranks))
    with pytest.raises(ValueError, match="rank 0 of 1"):
        make_train_loader(
            name,
            images,
            np.arange(40) % 10,
            shard_indices(40, 0, 1),
            8,
            2,
            augment=spec,
            kernels="torch",
            dtype=torch.float32,
            device=torch.device("cpu"),
            rank=1,
            emulate_ranks=2,
        )


@pytest.mark.parametrize(
    "name",
    [
        "torch",
        pytest.param("dali", marks=pytest.mark.skipif(not dali_available()[0], reason="DALI does not import here")),
    ],
)
def test_emulated_ranks_loader_is_each_ranks_loader_side_by_side(name):
    """101 images over 3 ranks: shards of 34, 34 and 33; each step's batch is rank 0's, 1's and 2's
    as their own loaders (own shard, own seed per rank and epoch) give them, bit for bit."""
    images, labels = _data()
    ranks, per_rank_batch, steps = 3, 10, 3
    emulated = make_train_loader(
        name,
        images,
        labels,
        shard_indices(101, 0, 1),
        ranks * per_rank_batch,
        steps,
        kernels="torch",
        emulate_ranks=ranks,
        rank=0,
        **AUGMENT,
    )
    alone = [
        make_train_loader(
            name,
            images,
            labels,
            shard_indices(101, r, ranks),
            per_rank_batch,
            steps,
            kernels="torch",
            rank=r,
            **AUGMENT,
        )
        for r in range(ranks)
    ]
    assert all(type(loader) is type(alone[0]) for loader in emulated.loaders)
    assert isinstance(emulated, EmulatedRanks) and emulated.batch_size == 30 and len(emulated) == steps
    for epoch in (0, 1):  # the alternating flip mirrors every other epoch
        emulated.set_epoch(7, epoch)
        for loader in alone:
            loader.set_epoch(7, epoch)
        if epoch:
            emulated.prepare(7, epoch)  # drawn ahead, as the trainer does
        batches = list(emulated)
        assert len(batches) == steps
        for step, (images_e, labels_e), *parts in zip(range(steps), batches, *alone, strict=False):
            assert torch.equal(images_e, torch.cat([p[0] for p in parts])), f"epoch {epoch} step {step}"
            assert torch.equal(labels_e, torch.cat([p[1] for p in parts]))
    emulated.set_epoch(7, 0)
    assert len(list(emulated.first(2))) == 2  # a fractional last epoch stops every rank after 2 steps
    # the whitening init: each rank's first ceil(50 / 3) = 17 images, as each rank reads them
    want = torch.cat([loader.plain_images(17) for loader in alone])
    assert torch.equal(emulated.plain_images(50), want)
    assert not torch.equal(want, alone[0].plain_images(51)), "the test needs the ranks' images to differ"


AUGMENT = dict(
    augment=AugmentSpec(crop_pad=2, pad_mode="reflect", cutout=4, flip=True, flip_mode="alternate"),
    dtype=torch.float32,
    device=CPU,
)


def _data(n=101, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8), rng.integers(0, 10, n).astype(np.int64)
