"""Layouts that CUDA ops choose differently from the CPU's, emulated on the CPU.

On CUDA, ``reflection_pad2d`` (and the constant pad) of an NCHW-shaped view of NHWC data returns
NCHW-contiguous output, where the CPU keeps channels-last. Code that padded a permuted view and
permuted back got contiguous NHWC on the CPU and a non-contiguous view on CUDA, and the Triton
augmentation refuses that on the first batch. ``cuda_layouts`` patches ``F.pad`` to lay its output
out as CUDA does, so the trap fails here instead of on a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fastcifar.data.loader import TorchLoader
from fastcifar.ops import augment as aug
from fastcifar.ops.augment import AugmentSpec, draw_params, pad_images
from fastcifar.ops.tta import tta_logits

CL = torch.channels_last


@pytest.fixture
def cuda_layouts(monkeypatch):
    """F.pad with CUDA's output layout: default (NCHW) contiguous whatever the input's strides."""
    real_pad = F.pad

    def pad(x, *args, **kwargs):
        return real_pad(x, *args, **kwargs).contiguous()

    monkeypatch.setattr(F, "pad", pad)
    monkeypatch.setattr(torch.nn.functional, "pad", pad)


def _images(n=6, size=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, size, size, 3), dtype=torch.uint8, generator=g)


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
    view = _images().permute(0, 3, 1, 2).float()
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
    view = _images().cuda().permute(0, 3, 1, 2).float()
    assert view.is_contiguous(memory_format=CL)
    out = F.pad(view, (2, 2, 2, 2), mode="reflect")
    assert out.is_contiguous() and not out.is_contiguous(memory_format=CL), out.stride()


@pytest.mark.parametrize("mode", ["reflect", "zero"])
@pytest.mark.parametrize("pad", [0, 1, 2, 4])
def test_pad_images_is_contiguous_nhwc_under_cuda_layouts(cuda_layouts, mode, pad):
    images = _images()
    out = pad_images(images, pad, mode)
    assert out.shape == (6, 32 + 2 * pad, 32 + 2 * pad, 3) and out.is_contiguous()
    assert torch.equal(out, _reference_pad(images, pad, mode) if pad else images)


def test_pad_images_odd_sizes_and_bad_pad():
    images = _images(n=2, size=5)
    assert torch.equal(pad_images(images, 3, "reflect"), _reference_pad(images, 3, "reflect"))
    with pytest.raises(ValueError, match="larger than"):
        pad_images(images, 5, "reflect")


def test_triton_loader_batch_under_cuda_layouts(cuda_layouts):
    """The default GPU run without DALI: TorchLoader with the Triton augmentation. Its first batch
    equals the torch path's (the kernel would have raised on a non-contiguous padded set)."""
    images, labels = _images(n=16).numpy(), np.arange(16) % 10
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


@pytest.mark.parametrize("level", [0, 1, 2])
def test_tta_feeds_the_model_channels_last_under_cuda_layouts(cuda_layouts, level):
    """TTA level 2 pads (reflect) for its shifted views: the model (Triton NormActPool checks
    channels-last) must still see a channels-last batch."""
    seen = []

    def model(x):
        seen.append(x.is_contiguous(memory_format=CL))
        return x.float().mean(dim=(2, 3))

    batch = torch.randn(4, 3, 8, 8).contiguous(memory_format=CL)
    tta_logits(model, batch, level)
    assert seen and all(seen)


def test_augment_reference_output_is_channels_last(cuda_layouts):
    padded = pad_images(_images(n=4), 2, "reflect")
    spec = AugmentSpec(crop_pad=2, cutout=4)
    out = aug.augment_reference(padded, draw_params(4, spec, torch.Generator().manual_seed(0), "cpu"), spec)
    assert out.is_contiguous(memory_format=CL)
