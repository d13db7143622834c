"""fastcifar.data.loader: the torch loader's epochs (shapes, shuffles, the epoch plan drawn ahead and
moved to the device whole, alternating flips), the loader with the Triton kernels against the
reference (also under CUDA's pad layouts, ``cuda_layouts``), and the evaluation set split over ranks."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch
from conftest import uint8_images

from fastcifar.core.streams import Streams
from fastcifar.data.loader import EvalSet, TorchLoader
from fastcifar.ops.augment import (
    AugmentSpec,
    alternating_flip,
    augment_reference,
    draw_params,
    normalize,
    pad_images,
)

CL = torch.channels_last


def test_a_jittering_loader_gives_the_reference_of_its_epochs_draws():
    """The torch loader (reference and Triton kernels) applies the epoch plan's jitter: each batch is
    augment_reference of its images with that plan's slice, and differs from the same loader without it."""
    from fastcifar.data.loader import epoch_plan

    rng = np.random.default_rng(4)
    images = rng.integers(0, 256, (12, 32, 32, 3), dtype=np.uint8)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def make(kernels, **jitter):
        return torch_loader(
            images, np.arange(12), np.arange(12), 4, 3, crop_pad=2, cutout=4, device=device, kernels=kernels, **jitter
        )

    loader = make("torch", brightness=0.3, contrast=0.2)
    loader.set_epoch(5, 1)
    spec = AugmentSpec(crop_pad=2, cutout=4, flip=True, flip_mode="random", brightness=0.3, contrast=0.2)
    order, plan = epoch_plan(5, 0, 1, 12, spec, shard_index=torch.arange(12), n_read=12)
    padded = pad_images(torch.from_numpy(images), 2, "reflect")
    batches = list(loader)
    for step, (x, y) in enumerate(batches):
        idx = order[step * 4 : (step + 1) * 4]
        assert torch.equal(y.cpu(), torch.from_numpy(np.arange(12))[idx])
        ref = augment_reference(padded[idx], plan.part(step * 4, (step + 1) * 4), spec)
        torch.testing.assert_close(x.cpu(), ref, rtol=0, atol=0)
    fused = make("triton", brightness=0.3, contrast=0.2)
    fused.set_epoch(5, 1)
    for (a, _), (b, _) in zip(fused, batches, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    still = make("torch")
    still.set_epoch(5, 1)
    assert not torch.equal(next(iter(still))[0], batches[0][0])


def test_loader_epochs_shapes_and_shuffles():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (50, 32, 32, 3), dtype=np.uint8)
    labels = np.arange(50) % 10
    shard = np.arange(0, 50, 2)
    loader = torch_loader(images, labels, shard, batch_size=8, steps=3)
    loader.set_epoch(0, 0)
    first = list(loader)
    assert len(first) == 3 and all(x.shape == (8, 3, 32, 32) and y.shape == (8,) for x, y in first)
    assert all(x.is_contiguous(memory_format=torch.channels_last) for x, _ in first)
    seen = torch.cat([y for _, y in first])
    assert set(seen.tolist()) <= set(labels[shard].tolist())
    loader.set_epoch(0, 0)
    again = list(loader)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, again, strict=True)), "same seed and epoch must repeat"
    loader.set_epoch(0, 1)
    other = list(loader)
    assert not torch.equal(first[0][0], other[0][0]), "a new epoch must reshuffle"


CUDA = pytest.param("cuda", marks=pytest.mark.cuda)


@pytest.mark.parametrize("device", ["cpu", CUDA])  # on CUDA the plan comes through pinned memory
def test_an_epoch_prepared_ahead_is_the_epoch_drawn_at_its_start(device):
    """``prepare(seed, e)`` (called by the trainer while the GPU finishes the epoch before) draws
    exactly what iterating epoch e would draw; a prepared plan serves its own epoch once, and
    another epoch's iteration neither uses nor drops it."""
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (40, 32, 32, 3), dtype=np.uint8)

    def make():
        return torch_loader(images, np.arange(40) % 10, np.arange(40), 8, 4, device=torch.device(device))

    drawn_then, ahead = make(), make()
    drawn_then.set_epoch(5, 2)
    want = list(drawn_then)
    made = []
    ahead._ahead.make = lambda s, epoch, draw=ahead._ahead.make: made.append((s.run, epoch)) or draw(s, epoch)
    ahead.prepare(5, 2)
    ahead.set_epoch(5, 1)
    list(ahead)  # another epoch: drawn at its start; the prepared one stays
    ahead.set_epoch(5, 2)
    got = list(ahead)
    assert made == [(5, 2), (5, 1)], "epoch 2 was drawn again instead of taken from prepare"
    assert len(got) == len(want) == 4
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(want, got, strict=True))
    list(ahead)  # taken once: a second pass draws again
    assert made == [(5, 2), (5, 1), (5, 2)]


@pytest.mark.cuda
def test_preparing_an_epoch_does_not_wait_for_the_gpu_and_survives_pinned_reuse():
    """What ``prepare`` is for: with the GPU busy (a 200M-cycle sleep queued, ~0.1 s) the host
    returns before the stream is done, and the plan copied later is intact although more plans of
    the same size went through the pinned-memory cache meanwhile (a buffer handed out again before
    its copy ran would corrupt it). Not a test of pinning itself: at this size (196 KB) a copy from
    pageable memory returned early too (H100, driver 580, 2026-11-22)."""
    images = np.random.default_rng(2).integers(0, 256, (4096, 32, 32, 3), dtype=np.uint8)
    loader = torch_loader(
        images, np.arange(4096) % 10, np.arange(4096), 512, 8, dtype=torch.float16, device=torch.device("cuda")
    )
    want_order, want_params = loader._device_plan(5, 2)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    loader.prepare(5, 2)
    assert not torch.cuda.current_stream().query(), "prepare waited for the GPU's queued work"
    for epoch in (3, 4, 6):  # the same sizes through the pinned cache while the first copy waits
        loader._device_plan(5, epoch)
    order, params = loader._ahead.take(5, 2)
    torch.cuda.synchronize()
    assert torch.equal(order, want_order)
    assert all(torch.equal(getattr(params, f), getattr(want_params, f)) for f in ("dy", "dx", "flip", "cy", "cx"))


def test_loader_with_triton_kernels_equals_the_reference():
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (6, 32, 32, 3), dtype=np.uint8)
    # Triton runs CPU tensors only in a process without a GPU (its interpreter); the GPU where there is one
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def make(kernels):
        return torch_loader(images, np.arange(6), np.arange(6), 3, 2, device=device, kernels=kernels)

    fused, ref = make("triton"), make("torch")
    assert fused.fused is not None and ref.fused is None
    for (a, ya), (b, yb) in zip(fused, ref, strict=True):  # same seed: same order and parameters
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        assert torch.equal(ya, yb)


def test_loader_with_triton_kernels_writes_each_batch_into_the_bound_step_buffers():
    """bind_static: the Triton augmentation writes each batch into the step's buffers, which the
    step then takes without a copy; the batches are those of an unbound loader."""
    from fastcifar.run.graphs import StaticBatch

    rng = np.random.default_rng(2)
    images = rng.integers(0, 256, (6, 32, 32, 3), dtype=np.uint8)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def make():
        return torch_loader(images, np.arange(6), np.arange(6), 3, 2, device=device, kernels="triton")

    bound, free = make(), make()
    batch = StaticBatch(3, torch.float32, device)
    batch.images.fill_(float("nan"))  # an unwritten element shows
    bound.bind_static(batch.images, batch.labels)
    for (a, ya), (b, yb) in zip(bound, free, strict=True):
        assert a.data_ptr() == batch.images.data_ptr() and ya.data_ptr() == batch.labels.data_ptr()
        assert torch.equal(a, b) and torch.equal(ya, yb)
        # the step's load sees its own buffers: nothing copied (a copy would not show; a changed
        # buffer would: the load returns before touching them)
        assert batch.load(a, ya) == 3 and torch.equal(batch.images, b)
    # buffers of another batch size stay unbound: the loader allocates, the step copies
    other = make()
    other.bind_static(StaticBatch(4, torch.float32, device).images, torch.zeros(4, dtype=torch.int64, device=device))
    assert other.static is None
    ref = torch_loader(images, np.arange(6), np.arange(6), 3, 2, device=device, kernels="torch")
    ref.bind_static(batch.images, batch.labels)
    assert ref.static is None  # the reference path keeps its batches (and the step copies them)


def test_loader_rejects_too_many_steps():
    with pytest.raises(ValueError, match="need 30 images"):
        torch_loader(np.zeros((10, 32, 32, 3), np.uint8), np.zeros(10, np.int64), np.arange(10), 10, 3)


def test_eval_set_splits_over_ranks():
    images = np.zeros((11, 32, 32, 3), np.uint8)
    labels = np.arange(11)
    parts = [
        EvalSet(images, labels, 4, dtype=torch.float32, device=torch.device("cpu"), rank=r, world_size=3)
        for r in range(3)
    ]
    got = sorted(torch.cat([y for p in parts for _, y in p]).tolist())
    assert got == list(range(11))
    assert [len(p) for p in parts] == [1, 1, 1]
    assert [p.largest_batch for p in parts] == [4, 4, 3]  # rank 2's 3 images: one batch of 3


@pytest.mark.parametrize("jitter", [{}, {"brightness": 0.2, "contrast": 0.1}])
def test_an_epoch_plan_reaches_the_device_whole(jitter):
    """``plan_to_device`` copies the order and every parameter the draws filled (by dtype, one copy
    each), whatever their names: each arrives equal, the unfilled ones stay None."""
    from fastcifar.data.loader import plan_to_device

    spec = AugmentSpec(crop_pad=2, cutout=4, **jitter)
    order = torch.randperm(30, generator=torch.Generator().manual_seed(0))
    params = draw_params(30, spec, torch.Generator().manual_seed(1), "cpu")
    got_order, got = plan_to_device(order, params, torch.device("cpu"))
    assert torch.equal(got_order, order)
    for f in dataclasses.fields(params):
        want, have = getattr(params, f.name), getattr(got, f.name)
        assert (want is None and have is None) or (have.dtype == want.dtype and torch.equal(have, want)), f.name


def test_loader_alternates_each_images_flip_across_epochs():
    # Left-right asymmetric images, label = data-set index: the output says which image and whether mirrored.
    n = 24
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
    shard = np.arange(n)[::-1].copy()  # shard order differs from data-set order
    loader = TorchLoader(
        images,
        np.arange(n),
        shard,
        batch_size=6,
        steps_per_epoch=4,
        augment=AugmentSpec(crop_pad=0, pad_mode="reflect", cutout=0, flip=True, flip_mode="alternate"),
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    plain = normalize(torch.from_numpy(images))

    def flips_of_epoch(epoch):
        loader.set_epoch(7, epoch)
        seen = {}
        for x, y in loader:
            for img, label in zip(x, y.tolist(), strict=True):
                if torch.equal(img, plain[label]):
                    seen[label] = 0
                elif torch.equal(img, plain[label].flip(2)):
                    seen[label] = 1
                else:
                    raise AssertionError("neither the image nor its mirror")
        return seen

    epochs = [flips_of_epoch(e) for e in range(3)]
    assert all(len(e) == n for e in epochs)
    for a, b in itertools.pairwise(epochs):
        assert all(a[i] != b[i] for i in range(n))
    aug = Streams.derived(7).aug  # the flips hash the aug stream's seed
    assert epochs[0] == {i: int(alternating_flip(torch.tensor([i]), 0, aug)) for i in range(n)}


def torch_loader(images, labels, shard, batch_size, steps, **settings):
    """A TorchLoader with these tests' usual settings (pad 4 by reflection, cutout 8, flips, fp32 on
    the CPU), each overridable: the augmentation's as AugmentSpec fields, the others as the loader's."""
    usual = {"crop_pad": 4, "pad_mode": "reflect", "cutout": 8, "flip": True}
    spec_fields = {f.name for f in dataclasses.fields(AugmentSpec)}
    augment = AugmentSpec(**(usual | {k: v for k, v in settings.items() if k in spec_fields}))
    loader_settings = {"dtype": torch.float32, "device": torch.device("cpu")} | {
        k: v for k, v in settings.items() if k not in spec_fields
    }
    return TorchLoader(images, labels, shard, batch_size, steps, augment=augment, **loader_settings)


def test_triton_loader_batch_under_cuda_layouts(cuda_layouts):
    """The default GPU run without DALI: TorchLoader with the Triton augmentation. Its first batch
    equals the torch path's (the kernel would have raised on a non-contiguous padded set)."""
    images, labels = uint8_images(n=16).numpy(), np.arange(16) % 10
    shard = np.arange(16)
    batches = {}
    # the real layouts where there is a GPU (Triton runs on CPU tensors only where there is none)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for kernels in ("torch", "triton"):
        loader = TorchLoader(
            images,
            labels,
            shard,
            8,
            2,
            augment=AugmentSpec(crop_pad=2, pad_mode="reflect", cutout=4, flip=True),
            dtype=torch.float32,
            device=device,
            kernels=kernels,
        )
        assert loader.images.is_contiguous()
        batches[kernels] = next(iter(loader))
    torch.testing.assert_close(batches["triton"][0], batches["torch"][0], rtol=0, atol=0)
    assert torch.equal(batches["triton"][1], batches["torch"][1])
    assert batches["triton"][0].is_contiguous(memory_format=CL)
