"""fastcifar.ops.augment, the augmentation reference: crop from padding, flip (alternating too),
normalization, jitter and cutout, the spec's checks, and the padding's layout under CUDA's pad layouts
(``cuda_layouts``, tests/conftest.py, emulated on the CPU and checked against CUDA where there is one)."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import uint8_images

from fastcifar.core.config import Config, from_preset
from fastcifar.ops import augment as aug
from fastcifar.ops.augment import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    AugmentParams,
    AugmentSpec,
    alternating_flip,
    augment_reference,
    draw_params,
    normalize,
    pad_images,
)


def params(b, dy=4, dx=4, flip=0, cy=0, cx=0):
    def full(v):
        return torch.full((b,), v, dtype=torch.int64)

    return AugmentParams(full(dy), full(dx), full(flip), full(cy), full(cx))


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


def test_spec_fields_are_the_config_fields_of_the_same_name_and_default():
    """``AugmentSpec.from_config`` reads each field from the config field of its name: a new
    augmentation is one field here and one there, with the same default (a spec built without a
    config augments as a run of the config's defaults does)."""

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


def test_alternating_flip_alternates_and_mirrors_half_per_epoch():
    index = torch.arange(20000)
    flips = [alternating_flip(index, e, seed=3) for e in range(4)]
    for a, b in itertools.pairwise(flips):
        assert torch.equal(a ^ b, torch.ones_like(a)), "every image changes orientation every epoch"
    for f in flips:
        rate = f.float().mean().item()
        assert abs(rate - 0.5) < 6 * (0.25 / 20000) ** 0.5, rate  # 6 standard deviations
    other_seed = alternating_flip(index, 0, seed=4)
    assert 0.4 < (other_seed != flips[0]).float().mean() < 0.6, "the run seed changes the coins"
    # a coin depends on the index, not the position in a batch
    perm = torch.randperm(20000)
    assert torch.equal(alternating_flip(index[perm], 1, 3), flips[1][perm])


def test_draw_params_alternate_mode():
    g = torch.Generator().manual_seed(0)
    index = torch.tensor([5, 9, 100, 7])
    alternate = AugmentSpec(crop_pad=2, cutout=0, flip_mode="alternate")
    p = draw_params(4, alternate, generator=g, device="cpu", index=index, epoch=1, seed=2)
    assert torch.equal(p.flip, alternating_flip(index, 1, 2))
    g2 = torch.Generator().manual_seed(0)
    r = draw_params(4, AugmentSpec(crop_pad=2, cutout=0), generator=g2, device="cpu")
    off = draw_params(
        4,
        AugmentSpec(crop_pad=2, cutout=0, flip=False, flip_mode="alternate"),
        generator=torch.Generator().manual_seed(0),
        device="cpu",
    )
    assert not off.flip.any()
    assert p.dy.shape == r.dy.shape == (4,)
    with pytest.raises(ValueError, match="indices"):
        draw_params(4, alternate, generator=g, device="cpu")
    with pytest.raises(ValueError, match="flip mode"):
        draw_params(4, AugmentSpec(crop_pad=2, cutout=0, flip_mode="sometimes"), generator=g, device="cpu")


CL = torch.channels_last


def _reference_pad(images, pad, mode):
    """What F.pad computes on the NCHW view, back in NHWC, made contiguous (any layout)."""
    nchw = images.permute(0, 3, 1, 2).float()
    if mode == "reflect":
        out = F.pad(nchw, (pad,) * 4, mode="reflect")
    else:
        out = F.pad(nchw, (pad,) * 4, mode="constant", value=0.0)
    return out.permute(0, 2, 3, 1).contiguous().to(torch.uint8)


def test_the_emulation_changes_what_the_cpu_does(monkeypatch):
    """The CPU's own pad keeps a channels-last view channels-last, so the old pad_images' permute
    back was contiguous NHWC here; under ``cuda_layouts`` it is not, as on CUDA. Fails if the CPU
    ever lays the output out as CUDA does (the emulation would then test nothing new) or if the
    fixture stops changing the layout."""
    view = uint8_images().permute(0, 3, 1, 2).float()
    native = F.pad(view, (2, 2, 2, 2), mode="reflect")
    assert native.is_contiguous(memory_format=CL) and native.permute(0, 2, 3, 1).is_contiguous()
    real_pad = F.pad
    monkeypatch.setattr(F, "pad", lambda x, *a, **k: real_pad(x, *a, **k).contiguous())  # cuda_layouts' patch
    emulated = F.pad(view, (2, 2, 2, 2), mode="reflect")
    assert not emulated.is_contiguous(memory_format=CL)
    assert not emulated.permute(0, 2, 3, 1).is_contiguous()  # what the old code handed the loader
    assert torch.equal(emulated, native)  # same values: only the layout differs


@pytest.mark.cuda
def test_cuda_reflect_pad_of_a_channels_last_view_is_nchw_contiguous():
    """The emulation's premise, checked where it can be: if a torch release makes CUDA's
    reflection_pad2d keep channels-last, this fails and ``cuda_layouts`` no longer mirrors CUDA."""
    view = uint8_images().cuda().permute(0, 3, 1, 2).float()
    assert view.is_contiguous(memory_format=CL)
    out = F.pad(view, (2, 2, 2, 2), mode="reflect")
    assert out.is_contiguous() and not out.is_contiguous(memory_format=CL), out.stride()


@pytest.mark.parametrize("mode", ["reflect", "zero"])
@pytest.mark.parametrize("pad", [0, 1, 2, 4])
def test_pad_images_is_contiguous_nhwc_under_cuda_layouts(cuda_layouts, mode, pad):
    images = uint8_images()
    out = pad_images(images, pad, mode)
    assert out.shape == (6, 32 + 2 * pad, 32 + 2 * pad, 3) and out.is_contiguous()
    assert torch.equal(out, _reference_pad(images, pad, mode) if pad else images)


def test_pad_images_odd_sizes_and_bad_pad():
    images = uint8_images(n=2, size=5)
    assert torch.equal(pad_images(images, 3, "reflect"), _reference_pad(images, 3, "reflect"))
    with pytest.raises(ValueError, match="larger than"):
        pad_images(images, 5, "reflect")


def test_augment_reference_output_is_channels_last(cuda_layouts):
    padded = pad_images(uint8_images(n=4), 2, "reflect")
    spec = AugmentSpec(crop_pad=2, cutout=4)
    out = aug.augment_reference(padded, draw_params(4, spec, torch.Generator().manual_seed(0), "cpu"), spec)
    assert out.is_contiguous(memory_format=CL)
