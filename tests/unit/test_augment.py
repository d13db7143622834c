"""The augmentation reference: crop from padding, flip, normalization, jitter and cutout, and the loader."""

import dataclasses

import numpy as np
import pytest
import torch

from fastcifar.data.loader import EvalSet, TorchLoader
from fastcifar.ops.augment import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    AugmentParams,
    AugmentSpec,
    augment_reference,
    draw_params,
    normalize,
    pad_images,
)


def params(b, dy=4, dx=4, flip=0, cy=0, cx=0):
    def full(v):
        return torch.full((b,), v, dtype=torch.int64)

    return AugmentParams(full(dy), full(dx), full(flip), full(cy), full(cx))


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


@pytest.fixture
def images():
    return torch.randint(0, 256, (4, 32, 32, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))


def test_centre_crop_without_flip_or_cutout_is_normalization(images):
    out = augment_reference(pad_images(images, 4, "reflect"), params(4), AugmentSpec(cutout=0))
    assert out.shape == (4, 3, 32, 32) and out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out, normalize(images))
    mean = torch.tensor(CIFAR10_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR10_STD).view(1, 3, 1, 1)
    torch.testing.assert_close(out, (images.permute(0, 3, 1, 2).float() - mean) / std)


def test_crop_offset_and_reflect_padding(images):
    padded = pad_images(images, 4, "reflect")
    out = augment_reference(padded, params(4, dy=0, dx=8), AugmentSpec(cutout=0))
    # reflect padding: padded row 0 is image row 4, padded column 0 is image column 4
    np.testing.assert_array_equal(padded[:, 0, 4].numpy(), images[:, 4, 0].numpy())
    np.testing.assert_array_equal(padded[:, 4, 0].numpy(), images[:, 0, 4].numpy())
    expected = normalize(padded[:, 0:32, 8:40])
    torch.testing.assert_close(out, expected)


def test_zero_padding(images):
    padded = pad_images(images, 4, "zero")
    assert padded.shape == (4, 40, 40, 3)
    assert not padded[:, :4].any() and not padded[:, :, -4:].any()
    assert torch.equal(padded[:, 4:36, 4:36], images)


def test_flip_mirrors_columns(images):
    padded = pad_images(images, 4, "reflect")
    out = augment_reference(padded, params(4, flip=1), AugmentSpec(cutout=0))
    torch.testing.assert_close(out, normalize(images).flip(3))


def test_cutout_zeroes_exactly_the_square(images):
    padded = pad_images(images, 4, "reflect")
    out = augment_reference(padded, params(4, cy=3, cx=20), AugmentSpec(cutout=8))
    ref = normalize(images)
    hole = torch.zeros(32, 32, dtype=torch.bool)
    hole[3:11, 20:28] = True
    assert (out[:, :, hole] == 0).all()
    torch.testing.assert_close(out[:, :, ~hole], ref[:, :, ~hole])


def test_unknown_padding_mode(images):
    with pytest.raises(ValueError, match="padding mode"):
        pad_images(images, 4, "wrap")


def test_draw_params_ranges_and_rates():
    g = torch.Generator().manual_seed(0)
    p = draw_params(20000, AugmentSpec(crop_pad=4, cutout=8), generator=g, device="cpu")
    for name, high in (("dy", 8), ("dx", 8), ("cy", 24), ("cx", 24), ("flip", 1)):
        v = getattr(p, name)
        assert v.min() == 0 and v.max() == high, name
        counts = torch.bincount(v, minlength=high + 1).float()
        expected = 20000 / (high + 1)
        # 6 standard deviations of a binomial count: a wrong range or rate fails, chance does not
        assert (counts - expected).abs().max() < 6 * expected**0.5, (name, counts)
    off = draw_params(10, AugmentSpec(crop_pad=0, cutout=0, flip=False), generator=g, device="cpu")
    assert not any(getattr(off, n).any() for n in ("dy", "dx", "flip", "cy", "cx"))


def test_jitter_draws_come_after_the_others_within_their_ranges():
    """--brightness/--contrast: a shift uniform in [-B, B] and a scale uniform in [1 - C, 1 + C] per
    image, drawn after the crop, flip and cutout draws, which stay those of a run without jitter."""
    plain = draw_params(
        20000, AugmentSpec(crop_pad=4, cutout=8), generator=torch.Generator().manual_seed(3), device="cpu"
    )
    p = draw_params(
        20000,
        AugmentSpec(crop_pad=4, cutout=8, brightness=0.14, contrast=0.13),
        generator=torch.Generator().manual_seed(3),
        device="cpu",
    )
    assert plain.shift is None and plain.scale is None and not plain.jitter and p.jitter
    assert all(torch.equal(getattr(p, f), getattr(plain, f)) for f in ("dy", "dx", "flip", "cy", "cx"))
    assert p.shift.dtype == p.scale.dtype == torch.float32
    assert -0.14 <= p.shift.min() < -0.13 and 0.13 < p.shift.max() <= 0.14
    assert 0.87 <= p.scale.min() < 0.88 and 1.12 < p.scale.max() <= 1.13
    # uniform: each fifth of the range holds a fifth of the draws, within 6 standard deviations
    for v, lo, hi in ((p.shift, -0.14, 0.14), (p.scale, 0.87, 1.13)):
        counts = torch.histc(v, bins=5, min=lo, max=hi)
        assert (counts - 4000).abs().max() < 6 * 4000**0.5, counts
    only = draw_params(
        100, AugmentSpec(crop_pad=0, cutout=0, contrast=0.5), generator=torch.Generator().manual_seed(3), device="cpu"
    )
    assert not only.shift.any() and only.scale.min() >= 0.5 and not torch.equal(only.scale, torch.ones(100))
    with pytest.raises(ValueError, match="must not be negative"):
        draw_params(4, AugmentSpec(crop_pad=0, cutout=0, brightness=-0.1), torch.Generator(), "cpu")


def test_jitter_shifts_then_scales_the_normalized_image_and_leaves_the_cutout(images):
    b = images.shape[0]
    shift, scale = torch.tensor([0.5, -0.25, 0.0, 1.0]), torch.tensor([1.0, 0.5, 1.5, 0.75])
    plain = params(b, cy=3, cx=5)
    jittered = AugmentParams(plain.dy, plain.dx, plain.flip, plain.cy, plain.cx, shift=shift, scale=scale)
    ref = augment_reference(pad_images(images, 4, "reflect"), plain, AugmentSpec(cutout=0))
    out = augment_reference(pad_images(images, 4, "reflect"), jittered, AugmentSpec(cutout=0))
    torch.testing.assert_close(out, (ref + shift[:, None, None, None]) * scale[:, None, None, None], rtol=0, atol=0)
    cut = augment_reference(pad_images(images, 4, "reflect"), jittered, AugmentSpec(cutout=8))
    assert not cut[:, :, 3:11, 5:13].any()  # the hole stays the mean colour
    assert torch.equal(cut[:, :, 11:], out[:, :, 11:])
    with pytest.raises(ValueError, match="both shift and scale"):
        AugmentParams(plain.dy, plain.dx, plain.flip, plain.cy, plain.cx, shift=shift)


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
    order, plan = epoch_plan(5, 0, 1, 12, 12, spec, shard_index=torch.arange(12))
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
    ahead._ahead.make = lambda seed, epoch, draw=ahead._ahead.make: made.append((seed, epoch)) or draw(seed, epoch)
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


def test_spec_fields_are_the_config_fields_of_the_same_name_and_default():
    """``AugmentSpec.from_config`` reads each field from the config field of its name: a new
    augmentation is one field here and one there, with the same default (a spec built without a
    config augments as a run of the config's defaults does)."""
    from fastcifar.core.config import Config, from_preset

    assert AugmentSpec.from_config(Config()) == AugmentSpec()
    cfg = from_preset("fast-jitter")
    spec = AugmentSpec.from_config(cfg)
    assert {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)} == {
        f.name: getattr(cfg, f.name) for f in dataclasses.fields(spec)
    }
    assert (spec.crop_pad, spec.flip_mode, spec.cutout, spec.brightness, spec.jitter) == (2, "alternate", 0, 0.14, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.cutout = 8


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"flip_mode": "sometimes"}, "flip mode"),
        ({"pad_mode": "wrap"}, "padding mode"),
        ({"brightness": float("nan")}, "must not be negative"),
        ({"contrast": -0.1}, "must not be negative"),
        ({"crop_pad": -1}, "must not be negative"),
        ({"cutout": -2}, "must not be negative"),
    ],
)
def test_spec_refuses_settings_no_implementation_can_run(fields, message):
    with pytest.raises(ValueError, match=message):
        AugmentSpec(**fields)


def test_spec_checks_the_image_side_and_gives_each_integer_parameters_range():
    AugmentSpec(crop_pad=31, cutout=32).check(32)
    AugmentSpec(crop_pad=32, pad_mode="zero").check(32)
    with pytest.raises(ValueError, match="cutout 33 outside 0..32"):
        AugmentSpec(cutout=33).check(32)
    with pytest.raises(ValueError, match="pad 32 outside 0..31"):
        AugmentSpec(crop_pad=32).check(32)
    assert AugmentSpec(crop_pad=2, cutout=5, flip=False).ranges(20) == {"dy": 4, "dx": 4, "flip": 0, "cy": 15, "cx": 15}
    # every integer parameter the draws fill has its range, and the draws stay inside it
    spec = AugmentSpec(crop_pad=3, cutout=6, brightness=0.1)
    p = draw_params(500, spec, torch.Generator().manual_seed(1), "cpu", 24)
    filled = {f.name for f in dataclasses.fields(p) if getattr(p, f.name) is not None}
    assert filled - {"shift", "scale"} == set(spec.ranges(24))
    assert all(0 <= getattr(p, name).min() and getattr(p, name).max() <= high for name, high in spec.ranges(24).items())


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
