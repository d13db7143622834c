"""The training loader a run gets (``fastcifar/data/train_loader.py``): which one for ``--loader``
and the device, and the one built, with the augmentation spec handed to it whole."""

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
