"""kernels/augment.py against fastcifar.ops.augment.augment_reference: crop, flip, normalize, jitter,
cutout in one pass, from the whole padded data set through an index tensor or from a gathered batch.
fp32 must be exact (the kernel multiplies by the IEEE-rounded reciprocal of std, as the reference
does); fp16 within 1 ulp."""

import dataclasses

import pytest  # noqa: E402
import torch
from _kernel_asserts import DEVICE, assert_close, needs_triton_backend, poisoned_empty  # noqa: E402

import fastcifar.kernels.augment as am  # noqa: E402
from fastcifar.kernels.augment import TritonAugment, augment  # noqa: E402
from fastcifar.ops.augment import (  # noqa: E402
    AugmentParams,
    AugmentSpec,
    augment_indexed_reference,
    draw_params,
    pad_images,
)

pytestmark = needs_triton_backend
CL = torch.channels_last


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(am, "_empty", poisoned_empty(am._empty))


def _data(num, pad, mode, seed=0, size=32, channels=3):
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (num, size, size, channels), dtype=torch.uint8, generator=g)
    return pad_images(images, pad, mode).contiguous().to(DEVICE)


def _params(batch, pad, cut, seed, size=32, brightness=0.0, contrast=0.0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    spec = AugmentSpec(crop_pad=pad, cutout=cut, brightness=brightness, contrast=contrast)
    return draw_params(batch, spec, g, DEVICE, size=size)


def _ulp_fp16(ref):
    """One fp16 ulp at each reference value (the spacing above |ref|)."""
    r = ref.abs().half()
    return torch.nextafter(r, torch.full_like(r, float("inf"))).float() - r.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "pad, mode, cut, use_index, jitter",
    [
        (4, "reflect", 8, True, None),
        (4, "zero", 12, False, None),
        (2, "reflect", 0, True, None),
        (0, "zero", 16, False, None),
        # --brightness/--contrast: shift then scale per image, fp32 exact (the GPU kernel runs without fp fusion)
        (2, "reflect", 0, True, (0.14, 0.13)),
        (4, "zero", 8, False, (0.5, 0.0)),
        (0, "zero", 0, True, (0.0, 0.4)),
    ],
)
def test_matches_reference(pad, mode, cut, use_index, jitter, dtype):
    data = _data(10, pad, mode, seed=pad + cut)
    batch = 7
    index = torch.randint(0, 10, (batch,), generator=torch.Generator().manual_seed(1)).to(DEVICE) if use_index else None
    params = _params(
        batch if use_index else 10,
        pad,
        cut,
        seed=cut,
        **dict(zip(("brightness", "contrast"), jitter or (), strict=False)),
    )
    assert params.jitter == (jitter is not None)
    got = augment(data, params, AugmentSpec(cutout=cut), dtype=dtype, index=index)
    ref = augment_indexed_reference(data, params, AugmentSpec(cutout=cut), dtype=dtype, index=index)
    assert got.dtype == dtype and got.is_contiguous(memory_format=CL) and got.shape == ref.shape
    if jitter is not None:  # the jitter changed the images: the comparison below sees it
        plain = augment_indexed_reference(
            data, dataclasses.replace(params, shift=None, scale=None), AugmentSpec(cutout=cut), dtype=dtype, index=index
        )
        assert not torch.equal(plain, ref)
    where = f"pad={pad} {mode} cutout={cut} index={use_index} jitter={jitter} {dtype}"
    if dtype == torch.float32:
        assert_close(got, ref, 0.0, f"augment {where}")
    else:
        err = (got.float() - ref.float()).abs()
        ulp = _ulp_fp16(ref.float())
        bad = ~(err <= ulp)
        assert not bool(bad.any()), (
            f"augment {where}: {int(bad.sum())} elements more than 1 fp16 ulp off; worst |diff| {float(err.max()):.3g}"
        )


def test_explicit_parameters_flip_and_corners():
    """Hand-picked parameters: crop corners, both flips, cutout at both corners."""
    data = _data(4, 4, "zero", seed=5)
    t = lambda *v: torch.tensor(v, dtype=torch.int64, device=DEVICE)  # noqa: E731
    params = AugmentParams(
        dy=t(0, 8, 8, 3), dx=t(0, 8, 0, 5), flip=t(0, 1, 1, 0), cy=t(0, 24, 0, 11), cx=t(24, 0, 0, 7)
    )
    got = augment(data, params, AugmentSpec(cutout=8), dtype=torch.float32)
    assert_close(
        got, augment_indexed_reference(data, params, AugmentSpec(cutout=8)), 0.0, "augment with explicit parameters"
    )


def test_module_with_device_constants():
    data = _data(6, 4, "reflect", seed=2)
    index = torch.tensor([5, 0, 0, 3], device=DEVICE)
    params = _params(4, 4, 8, seed=3)
    mod = TritonAugment(AugmentSpec(cutout=8), dtype=torch.float32).to(DEVICE)
    want = augment_indexed_reference(data, params, AugmentSpec(cutout=8), index=index)
    assert_close(mod(data, params, index), want, 0.0, "TritonAugment")


@pytest.mark.parametrize("jitter", [False, True])
def test_writes_into_the_buffer_it_is_given(jitter):
    """out=: the step's input buffer (poisoned here: an unwritten element fails) written in place
    and returned, equal to the reference."""
    data = _data(6, 4, "reflect", seed=7)
    index = torch.tensor([2, 5, 0], device=DEVICE)
    params = _params(3, 4, 8, seed=8, brightness=0.2 * jitter, contrast=0.1 * jitter)
    spec = AugmentSpec(cutout=8, brightness=0.2 * jitter, contrast=0.1 * jitter)
    buf = torch.full((3, 3, 32, 32), float("nan"), device=DEVICE).contiguous(memory_format=CL)
    got = TritonAugment(spec, dtype=torch.float32).to(DEVICE)(data, params, index, out=buf)
    assert got is buf
    assert_close(buf, augment_indexed_reference(data, params, spec, index=index), 0.0, "augment into out")


def test_index_past_the_data_set_reads_nothing():
    """An index outside the data set (-1, or its length) reads no byte: the image is that of an
    all-zero image (the masked load's ``other``), the in-range images of the batch are unchanged. The
    image's bounds are part of the load's mask (a mask that Triton 3.9's interpreter refused, issue 71)."""
    data = _data(6, 4, "reflect", seed=4)
    index = torch.tensor([2, -1, 6, 5], device=DEVICE)
    params = _params(4, 4, 8, seed=6)
    got = augment(data, params, AugmentSpec(cutout=8), dtype=torch.float32, index=index)
    inside = torch.tensor([0, 3])
    want = augment_indexed_reference(data, params, AugmentSpec(cutout=8), index=index.clamp(0, 5))
    assert_close(got[inside], want[inside], 0.0, "augment: the in-range images")
    zeros = augment_indexed_reference(torch.zeros_like(data), params, AugmentSpec(cutout=8), index=index.clamp(0, 5))
    assert_close(got[1:3], zeros[1:3], 0.0, "augment: an index past the data set reads as an all-zero image")


@pytest.mark.parametrize("size, channels, pad", [(12, 1, 2), (20, 2, 3), (8, 4, 0), (40, 3, 2)])
def test_other_sides_and_channel_counts(size, channels, pad, monkeypatch):
    """A program per image (or per block of its rows) over its rows and each row's pixels x channels,
    both padded to a power of two (12 rows of 12 x 1 lanes: 16 x 16; 20 x 2 = 40 lanes: 64; 40 rows of
    120 lanes: two blocks of 32 x 128): every element of every image is written (the output starts as
    NaN) and the padding lanes write nothing past the batch (the output is the front of a NaN buffer
    whose tail must stay NaN)."""
    assert am.tile(32, 3) == (128, 32) and am.tile(40, 3) == (128, 32) and am.tile(96, 3) == (512, 8)
    with pytest.raises(ValueError, match="at most 16384"):
        am.tile(6000, 3)
    tail = []

    def guarded_empty(shape, dtype, device):
        b, c, h, w = shape
        buf = torch.full((b * c * h * w + 4096,), float("nan"), dtype=dtype, device=device)
        tail.append(buf[b * c * h * w :])
        return buf[: b * c * h * w].view(b, h, w, c).permute(0, 3, 1, 2)  # channels-last, as _empty's

    monkeypatch.setattr(am, "_empty", guarded_empty)
    data = _data(9, pad, "reflect", seed=size, size=size, channels=channels)
    index = torch.tensor([8, 0, 3, 3, 5], device=DEVICE)
    params = _params(5, pad, 4, seed=channels, size=size, brightness=0.2, contrast=0.1)
    mean, std = (0.3 * 255,) * channels, (0.2 * 255,) * channels
    got = augment(data, params, AugmentSpec(cutout=4), mean, std, dtype=torch.float32, size=size, index=index)
    ref = augment_indexed_reference(data, params, AugmentSpec(cutout=4), mean, std, size=size, index=index)
    assert got.shape == (5, channels, size, size)
    assert_close(got, ref, 0.0, f"augment {size}x{size}x{channels}")
    assert torch.isnan(tail[0]).all(), "written past the batch"


@pytest.mark.parametrize(
    "case, error, message",
    [
        ("float_data", ValueError, "uint8"),
        ("nchw_view", ValueError, "contiguous NHWC"),
        ("uneven_pad", ValueError, "padded evenly"),
        ("dtype", TypeError, "output dtype"),
        ("cutout", ValueError, "cutout must be"),
        ("params_len", ValueError, "params.cy must be a 1-D tensor of length 4"),
        ("index_float", TypeError, "index must be one of"),
        ("out_shape", ValueError, "out must be torch.float16 (4, 3, 32, 32)"),
        ("out_dtype", ValueError, "out must be torch.float16"),
        ("out_nchw", ValueError, "out must be channels-last contiguous"),
    ],
)
def test_launcher_rejects(case, error, message):
    data = _data(6, 4, "zero")
    index = torch.tensor([5, 0, 0, 3], device=DEVICE)
    params = _params(4, 4, 8, seed=3)
    kw = dict(spec=AugmentSpec(cutout=8), dtype=torch.float16)
    if case == "float_data":
        data = data.float()
    elif case == "nchw_view":
        data = data.permute(0, 3, 1, 2).contiguous().permute(0, 2, 3, 1)
    elif case == "uneven_pad":
        data = data[:, 1:].contiguous()
    elif case == "dtype":
        kw["dtype"] = torch.float64
    elif case == "cutout":
        kw["spec"] = AugmentSpec(cutout=33)
    elif case == "params_len":
        params = AugmentParams(params.dy, params.dx, params.flip, params.cy[:3], params.cx)
    elif case == "index_float":
        index = index.float()
    elif case == "out_shape":
        kw["out"] = torch.empty(5, 3, 32, 32, dtype=torch.float16, device=DEVICE).contiguous(memory_format=CL)
    elif case == "out_dtype":
        kw["out"] = torch.empty(4, 3, 32, 32, dtype=torch.float32, device=DEVICE).contiguous(memory_format=CL)
    elif case == "out_nchw":
        kw["out"] = torch.empty(4, 3, 32, 32, dtype=torch.float16, device=DEVICE)
    with pytest.raises(error) as info:
        augment(data, params, index=index, **kw)
    assert message in str(info.value), str(info.value)
