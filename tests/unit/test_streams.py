"""A run's seed streams (``fastcifar/core/streams.py``) and what each decides, on every loader: the
torch loader with the reference and with the Triton kernel (under the interpreter), and DALI's
CPU backend. The training labels here are the data-set indices, so a batch's labels say which
images it holds; the mean 0 and std 1 make the output the source pixels, compared exactly."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from fastcifar.core.config import Config, ConfigError, from_preset, validate
from fastcifar.core.streams import STREAMS, Streams, as_streams, derive
from fastcifar.data import rank_shard, shard_indices, shard_sizes
from fastcifar.data.dali import dali_available
from fastcifar.data.loader import epoch_plan
from fastcifar.data.train_loader import make_train_loader
from fastcifar.ops.augment import AugmentSpec

N, BATCH = 96, 8  # the training set as read; 12 batches of 8
SPEC = AugmentSpec(crop_pad=4, cutout=8, brightness=0.2, contrast=0.2)  # every draw: crop, flip, cutout, jitter
DALI = pytest.param(("dali", "torch"), marks=pytest.mark.skipif(not dali_available()[0], reason="no DALI here"))
ORDERS = [("torch", "torch"), DALI]  # the order is the loader's, whichever kernels augment
ENGINES = [("torch", "torch"), ("torch", "triton"), DALI]
IMAGES = np.random.default_rng(3).integers(0, 256, (N, 32, 32, 3), dtype=np.uint8)


def streams(order=1, aug=2, init=3, run=0) -> Streams:
    return Streams(run=run, init=init, order=order, aug=aug, subset=4)


def loader(engine, kept=None, rank=0, world=1, emulate=1):
    """A training loader over the images ``kept`` (bool over the N as read; None: all), rank
    ``rank`` of ``world``, one epoch of every whole batch its shard holds."""
    name, kernels = engine
    kept = np.ones(N, bool) if kept is None else kept
    index = np.flatnonzero(kept)
    shard = rank_shard(index, N, rank, world)
    shards = world * emulate
    steps = min(shard_sizes(index, N, shards)) // BATCH
    return make_train_loader(
        name,
        IMAGES[index],
        index,  # label = data-set index
        shard,
        BATCH * emulate,
        steps,
        augment=SPEC,
        kernels=kernels,
        dtype=torch.float32,
        device=torch.device("cpu"),
        rank=rank,
        emulate_ranks=emulate,
        index=index,
        n_read=N,
    )


def epoch(engine, seeds, e=1, **where):
    """(the data-set indices in training order, {index: its augmented image}) of epoch ``e``."""
    data = loader(engine, **where)
    data.set_epoch(seeds, e)
    order, seen = [], {}
    for x, y in data:
        for image, i in zip(x, y.tolist(), strict=True):
            order.append(i)
            seen[i] = image.clone()
    return order, seen


def test_each_stream_is_its_own_and_a_given_seed_shifts_with_the_run():
    a = Streams.derived(0)
    assert len({a.init, a.order, a.aug, a.subset}) == 4 and a.run == 0
    assert Streams.derived(0) == a and Streams.derived(1).order != a.order
    assert a.order == derive(0, 2) and as_streams(0) == a and as_streams(a) is a
    cfg = from_preset("resnet9", seed=10, seed_order=7, seed_aug=7)
    run1, run3 = Streams.for_run(cfg, 10), Streams.for_run(cfg, 12)
    assert (run1.order, run1.aug, run3.order, run3.aug) == (7, 7, 9, 9), "run k: the given seed + k - 1"
    assert run1.init == Streams.derived(10).init and run3.init == Streams.derived(12).init
    assert run1.subset == Streams.derived(10).subset
    assert {f.name for f in dataclasses.fields(Streams)} == {"run", *STREAMS}


def test_the_stream_seeds_are_checked_in_one_line():
    with pytest.raises(ConfigError, match=r"^--seed-aug must be -1 \(derived from --seed\) or lie in 0\.\.") as err:
        validate(Config(seed_aug=-2))
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="--seed-init"):
        validate(Config(seed_init=2**63 - 1, runs=2))  # run 2 would need 2^63
    validate(Config(seed_init=5, seed_order=0, seed_aug=2**62, seed_subset=-1))


@pytest.mark.parametrize("engine", ORDERS)
def test_the_order_seed_alone_decides_the_order(engine):
    order, _ = epoch(engine, streams(order=1, aug=2, init=3))
    again, _ = epoch(engine, streams(order=1, aug=9, init=8, run=5))
    other, _ = epoch(engine, streams(order=6, aug=2, init=3))
    assert order == again, "the init and aug seeds moved the order"
    assert sorted(order) == list(range(N)) and order != other


@pytest.mark.parametrize("engine", ORDERS)
def test_a_smaller_subset_keeps_the_order_of_the_images_it_keeps(engine):
    """Leave-k-out: the order is drawn over the whole set and filtered, so the run without some
    images sees the others in the same relative order (each later one moves up a place per
    removed image, across batch boundaries); per rank too, an image's rank fixed by the whole set."""
    seeds = streams()
    kept = np.ones(N, bool)
    kept[[5, 40, 41, 77]] = False
    for rank, world in [(0, 1), (0, 2), (1, 2)]:
        full, _ = epoch(engine, seeds, rank=rank, world=world)
        part, _ = epoch(engine, seeds, kept=kept, rank=rank, world=world)
        plan, _ = epoch_plan(
            seeds, rank, 1, N, SPEC, shard_index=torch.from_numpy(shard_indices(N, rank, world)), n_read=N
        )
        whole = shard_indices(N, rank, world)[plan.numpy()]  # the rank's full permutation, no batch dropped
        want = [i for i in whole if kept[i]][: len(part)]
        assert part == want, f"rank {rank} of {world}: the subset's order is not the full order filtered"
        assert full == whole.tolist()[: len(full)]


@pytest.mark.parametrize("engine", ENGINES)
def test_the_aug_seed_alone_decides_each_images_augmentation(engine):
    """Same aug seed: image i gets the same crop, flip, cutout and jitter in an epoch whatever the
    order seed, the subset, the rank count; another aug seed or epoch changes them."""
    _, base = epoch(engine, streams(order=1, aug=2))
    _, reordered = epoch(engine, streams(order=6, aug=2, init=11))
    kept = np.arange(N) % 3 != 0
    _, subset = epoch(engine, streams(order=1, aug=2), kept=kept)
    _, rank1 = epoch(engine, streams(order=1, aug=2), rank=1, world=2)
    for other in (reordered, subset, rank1):
        assert other and all(torch.equal(image, base[i]) for i, image in other.items())
    _, reaugmented = epoch(engine, streams(order=1, aug=5))
    _, next_epoch = epoch(engine, streams(order=1, aug=2), e=2)
    for other in (reaugmented, next_epoch):
        assert sum(not torch.equal(image, base[i]) for i, image in other.items()) > N // 2


@pytest.mark.parametrize("engine", ORDERS)
def test_emulated_ranks_see_what_each_rank_sees_with_a_subset(engine):
    kept = np.arange(N) % 5 != 0
    both = loader(engine, kept=kept, emulate=2)
    both.set_epoch(streams(), 1)
    for r, part in enumerate(both.loaders):
        mine, _ = epoch(engine, streams(), kept=kept, rank=r, world=2)
        part.set_epoch(streams(), 1)
        assert torch.cat([y for _, y in part]).tolist() == mine


def test_each_image_stays_in_its_ranks_shard_whatever_the_subset():
    index = np.flatnonzero(np.arange(N) % 4 != 1)
    for world in (1, 2, 3):
        for r in range(world):
            assert (rank_shard(np.arange(N), N, r, world) == shard_indices(N, r, world)).all()
            mine = index[rank_shard(index, N, r, world)]
            assert set(mine) == set(shard_indices(N, r, world)) & set(index)
        assert sum(shard_sizes(index, N, world)) == len(index)
