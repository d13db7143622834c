"""The training augmentation, defined once: random crop from padding, horizontal flip, brightness and
contrast jitter, cutout.

``AugmentSpec`` is what an augmentation is (built once from the run's config and passed whole);
``draw_params`` draws each image's random parameters from it (``AugmentParams``); ``augment_reference``
applies them. This is the reference every loader follows (the plain-torch loader calls it directly;
the Triton kernel in ``kernels/augment.py`` and the DALI pipeline are tested against it). Order, per
image, in output coordinates:

1. pad the 32x32 uint8 image by ``crop_pad`` pixels on each side (reflect or zero padding);
2. take the 32x32 window whose top-left corner is (dy, dx) in the padded image, 0 <= dy, dx <= 2*crop_pad;
3. mirror it left-right if ``flip`` (drawn at random per image, or alternating: see
   ``alternating_flip``);
4. normalize per channel: (x - mean) * (1 / std), in fp32;
5. jitter (when drawn): (x + shift) * scale in fp32, one shift and one scale per image for all its
   channels (``shift`` uniform in [-brightness, brightness], in units of each channel's std;
   ``scale`` uniform in [1 - contrast, 1 + contrast]; the record script's jitter); then cast to the
   output dtype;
6. zero the ``cutout`` x ``cutout`` square whose top-left corner is (cy, cx), fully inside the image
   (0 <= cy, cx <= 32 - cutout). Zero after normalization is the data set's mean colour.

Images are NHWC uint8 in memory; the output is NCHW-shaped with channels-last strides (the layout
cuDNN's fast NHWC convolutions want), so it is NHWC in memory as well.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from fastcifar.core.config import CHOICES

# Per-channel mean and standard deviation of the CIFAR-10 training pixels, 0-255 scale.
CIFAR10_MEAN = (125.307, 122.950, 113.865)
CIFAR10_STD = (62.993, 62.089, 66.705)


@dataclass(frozen=True)
class AugmentParams:
    """Per-image random parameters of one batch, as ``draw_params`` fills them from an ``AugmentSpec``:
    int64 tensors of shape (B,) on the data's device, and the jitter's two float32 ones (B,), both or
    neither (None: no jitter, the image unchanged). Code that moves them (``part``, ``concat``,
    ``data.loader.plan_to_device``) goes over the fields, whatever their names."""

    dy: torch.Tensor  # crop row offset into the padded image, 0..2*crop_pad
    dx: torch.Tensor  # crop column offset into the padded image, 0..2*crop_pad
    flip: torch.Tensor  # 1: mirror left-right, 0: keep
    cy: torch.Tensor  # cutout top row in the output image, 0..size-cutout
    cx: torch.Tensor  # cutout left column in the output image, 0..size-cutout
    shift: torch.Tensor | None = None  # added to the normalized image (brightness), float32
    scale: torch.Tensor | None = None  # then multiplied with it (contrast), float32

    def __post_init__(self):
        if (self.shift is None) != (self.scale is None):
            raise ValueError("the jitter needs both shift and scale, or neither")

    @property
    def jitter(self) -> bool:
        return self.shift is not None

    def part(self, lo: int, hi: int) -> AugmentParams:
        """The parameters of images lo..hi-1 (views, no copy)."""
        return AugmentParams(
            **{
                f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[lo:hi]
                for f in dataclasses.fields(self)
            }
        )

    def take(self, index: torch.Tensor) -> AugmentParams:
        """The parameters of the images at ``index`` (int64, on their device), in that order."""
        return AugmentParams(
            **{
                f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[index]
                for f in dataclasses.fields(self)
            }
        )

    @staticmethod
    def concat(parts: list[AugmentParams]) -> AugmentParams:
        """Batches' parameters one after the other (jittered all, or none)."""
        return AugmentParams(
            **{
                f.name: None if getattr(parts[0], f.name) is None else torch.cat([getattr(p, f.name) for p in parts])
                for f in dataclasses.fields(parts[0])
            }
        )


FLIP_MODES = CHOICES["flip_mode"]
PAD_MODES = CHOICES["pad_mode"]


@dataclass(frozen=True)
class AugmentSpec:
    """What the training augmentation is: every setting the draws, the reference, the Triton kernel
    and DALI read, in one object that travels whole from the config to each of them. Each field
    has the name (and the default) of the ``Config`` field it comes from (``from_config``), so a new
    setting is one field here and one there. The data set's mean and std are not in it: they are
    the data's (evaluation normalizes with them too), passed beside the spec as device tensors."""

    crop_pad: int = 4  # pixels of padding per side the crop is taken from; 0 = no crop
    pad_mode: str = "reflect"  # reflect | zero
    flip: bool = True  # horizontal flip, half of the images per epoch
    flip_mode: str = "random"  # random: a coin per image | alternate: a coin per image, mirrored every other epoch
    cutout: int = 8  # side of the zeroed square, pixels; 0 = off
    brightness: float = 0.0  # shift half-width, in units of each channel's std; 0 = off
    contrast: float = 0.0  # scale half-width around 1; 0 = off

    def __post_init__(self):
        if self.flip_mode not in FLIP_MODES:
            raise ValueError(f"flip mode must be one of {FLIP_MODES}, not {self.flip_mode!r}")
        if self.pad_mode not in PAD_MODES:
            raise ValueError(f"padding mode must be 'reflect' or 'zero', not {self.pad_mode!r}")
        if not (self.brightness >= 0 and self.contrast >= 0):  # NaN too
            raise ValueError(f"brightness and contrast must not be negative, not {self.brightness}, {self.contrast}")
        if self.crop_pad < 0 or self.cutout < 0:
            raise ValueError(f"crop_pad and cutout must not be negative, not {self.crop_pad}, {self.cutout}")

    @classmethod
    def from_config(cls, cfg: Any) -> AugmentSpec:
        """The run's augmentation: each field from the config field of the same name."""
        return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)})

    @property
    def jitter(self) -> bool:
        """Whether the draws include a shift and a scale per image."""
        return self.brightness > 0 or self.contrast > 0

    def check(self, size: int) -> None:
        """Refuse settings that images of side ``size`` cannot take (the config checks its own 32)."""
        if not 0 <= self.cutout <= size:
            raise ValueError(f"cutout {self.cutout} outside 0..{size}")
        if self.pad_mode == "reflect" and self.crop_pad >= size:
            raise ValueError(f"pad {self.crop_pad} outside 0..{size - 1}")

    def ranges(self, size: int = 32) -> dict[str, int]:
        """Each integer parameter's largest value (the smallest is 0) for images of side ``size``:
        what a pinned parameter is checked against (``data.dali.DaliLoader``'s ``params_fn``)."""
        return {
            "dy": 2 * self.crop_pad,
            "dx": 2 * self.crop_pad,
            "flip": int(self.flip),
            "cy": size - self.cutout,
            "cx": size - self.cutout,
        }


DEFAULT_AUGMENT = AugmentSpec()  # the config's defaults; frozen, so one instance serves as every default


def draw_params(
    batch: int,
    spec: AugmentSpec,
    generator: torch.Generator,
    device: torch.device | str,
    size: int = 32,
    *,
    index: torch.Tensor | None = None,
    epoch: int = 0,
    seed: int = 0,
) -> AugmentParams:
    """Draw one batch of ``spec``'s parameters on ``device`` (the generator must live on that device).

    Every parameter is uniform over its range; ``cutout=0`` and ``flip=False`` give all-zero
    columns that the augmentation then ignores. ``flip_mode="alternate"`` replaces the random
    flip by ``alternating_flip(index, epoch, seed)``: ``index`` holds the batch's data-set
    indices (int64, on ``device``). The other parameters' draws are the same in both modes.
    ``brightness`` or ``contrast`` > 0 draws the jitter after everything else (so the other draws
    are those of a run without it): a shift uniform in [-brightness, brightness] and a scale uniform
    in [1 - contrast, 1 + contrast] per image, float32; the one left at 0 stays 0 or 1. A new
    augmentation's draws go last too, and draw nothing when it is off: the runs without it keep
    their draws.
    """

    def uniform(high: int) -> torch.Tensor:  # integers in [0, high]
        return torch.randint(0, high + 1, (batch,), generator=generator, device=device)

    zeros = torch.zeros(batch, dtype=torch.int64, device=device)
    if not spec.flip:
        flips = zeros
    elif spec.flip_mode == "random":
        flips = uniform(1)
    else:
        if index is None or index.shape != (batch,):
            raise ValueError(f"alternating flips need the batch's {batch} data-set indices")
        flips = alternating_flip(index, epoch, seed)

    def symmetric(half_width: float) -> torch.Tensor:  # float32 in [-half_width, half_width]
        return (torch.rand(batch, generator=generator, device=device, dtype=torch.float32) * 2 - 1) * half_width

    # in this order: the draws of a run without jitter come first, unchanged
    pad, cutout = spec.crop_pad, spec.cutout
    dy = uniform(2 * pad) if pad else zeros
    dx = uniform(2 * pad) if pad else zeros
    cy = uniform(size - cutout) if cutout else zeros
    cx = uniform(size - cutout) if cutout else zeros
    shift = scale = None
    if spec.jitter:
        brightness, contrast = spec.brightness, spec.contrast
        shift = symmetric(brightness) if brightness else torch.zeros(batch, device=device, dtype=torch.float32)
        scale = 1 + symmetric(contrast) if contrast else torch.ones(batch, device=device, dtype=torch.float32)
    return AugmentParams(dy=dy, dx=dx, flip=flips, cy=cy, cx=cx, shift=shift, scale=scale)


# Knuth's multiplicative hash constant (2^32 / golden ratio): consecutive indices land far apart.
_HASH_MUL = 2654435761
_MASK32 = (1 << 32) - 1


def alternating_flip(index: torch.Tensor, epoch: int, seed: int) -> torch.Tensor:
    """Deterministic flips that alternate per image across epochs: 1 = mirror, int64 like ``index``.

    Image ``i`` is mirrored in epoch ``e`` iff ``coin(i, seed) XOR (e odd)``, where ``coin`` is a
    hash bit, so over any two consecutive epochs every image is seen once each way (random flips
    repeat an orientation half the time) and about half the images are mirrored in each epoch.
    Depends only on the data-set index, the run seed and the epoch: every loader (torch, Triton,
    DALI) and every rank count agree. Integer arithmetic stays below 2^63 for indices < 2^31.
    """
    salt = (seed * 0x9E3779B1 + 0x7F4A7C15) & _MASK32
    h = (index.to(torch.int64) * _HASH_MUL + salt) & _MASK32
    h = (h ^ (h >> 15)) * 0x2C1B3C6D & _MASK32  # one more mix: the top bit depends on every index bit
    coin = (h >> 31) & 1
    return coin ^ (epoch & 1)


def pad_images(images: torch.Tensor, pad: int, mode: str) -> torch.Tensor:
    """Pad NHWC images by ``pad`` on each spatial side; ``mode`` is "reflect" or "zero".

    Returns a contiguous NHWC tensor on every backend. Both modes work on the NHWC tensor itself,
    never on an NCHW view of it: CUDA's reflection_pad2d returns NCHW-contiguous output where the
    CPU's keeps channels-last, so padding a permuted view and permuting back gave a non-contiguous
    result on CUDA only, which the Triton augmentation refuses ("data must be contiguous NHWC")."""
    if pad == 0:
        return images.contiguous()
    if mode not in ("reflect", "zero"):
        raise ValueError(f"padding mode must be 'reflect' or 'zero', not {mode!r}")
    if mode == "reflect":
        # a gather of reflected row and column indices: exact for uint8 on every backend (no float
        # copy, 4x the 150 MB uint8 set) and laid out like its input
        rows = _reflect_index(images.shape[1], pad, images.device)
        cols = _reflect_index(images.shape[2], pad, images.device)
        padded = images[:, rows][:, :, cols]
    else:  # F.pad's pairs run from the last dim: C by 0, W by pad, H by pad
        padded = torch.nn.functional.pad(images, (0, 0, pad, pad, pad, pad), mode="constant", value=0)
    return padded.contiguous()  # a no-op unless some backend's op chose another layout


def _reflect_index(size: int, pad: int, device) -> torch.Tensor:
    """Indices -pad..size+pad-1 reflected into 0..size-1 without repeating the edge (F.pad's reflect)."""
    if pad >= size:
        raise ValueError(f"reflect padding of {pad} needs images larger than {pad} pixels, got {size}")
    i = torch.arange(-pad, size + pad, device=device).abs()
    return torch.where(i > size - 1, 2 * (size - 1) - i, i)


def normalize(images: torch.Tensor, mean=CIFAR10_MEAN, std=CIFAR10_STD, dtype=torch.float32) -> torch.Tensor:
    """NHWC uint8 -> NCHW-shaped channels-last ``dtype``, (x - mean) * (1 / std) computed in fp32."""
    m = torch.as_tensor(mean, dtype=torch.float32, device=images.device)  # no copy when already there
    s = torch.as_tensor(std, dtype=torch.float32, device=images.device)
    # times the fp32 reciprocal, not divided: DALI's crop_mirror_normalize computes it this way, so
    # both loaders give the same bits (a division differs from it in the last bit on ~38% of pixels)
    out = ((images.float() - m) * (1.0 / s)).to(dtype)
    return out.permute(0, 3, 1, 2)  # NHWC memory, NCHW shape: channels-last, no copy


def augment_reference(
    padded: torch.Tensor,
    params: AugmentParams,
    spec: AugmentSpec,
    mean=CIFAR10_MEAN,
    std=CIFAR10_STD,
    dtype: torch.dtype = torch.float32,
    size: int = 32,
) -> torch.Tensor:
    """Crop, flip, normalize, jitter and cut out one batch of already padded NHWC uint8 images with
    ``params`` drawn from ``spec``.

    ``padded`` is (B, size+2*pad, size+2*pad, C); returns (B, C, size, size), channels-last.
    """
    cutout = spec.cutout
    b = padded.shape[0]
    ar = torch.arange(size, device=padded.device)
    rows = params.dy[:, None] + ar  # (B, size)
    cols = params.dx[:, None] + ar
    cols = torch.where(params.flip[:, None].bool(), cols.flip(1), cols)
    batch_idx = torch.arange(b, device=padded.device)[:, None, None]
    crops = padded[batch_idx, rows[:, :, None], cols[:, None, :]]  # (B, size, size, C) gather
    out = normalize(crops, mean, std, torch.float32)
    if params.jitter:  # two fp32 roundings, add then multiply, as the Triton kernel and DALI do them
        out = (out + params.shift.float()[:, None, None, None]) * params.scale.float()[:, None, None, None]
    out = out.to(dtype)  # normalize's own cast: the same bits as normalizing to dtype directly
    if cutout:
        inside_y = (ar[None, :] >= params.cy[:, None]) & (ar[None, :] < params.cy[:, None] + cutout)
        inside_x = (ar[None, :] >= params.cx[:, None]) & (ar[None, :] < params.cx[:, None] + cutout)
        hole = inside_y[:, None, :, None] & inside_x[:, None, None, :]  # (B, 1, size, size)
        out = out.masked_fill(hole, 0.0)
    return out.contiguous(memory_format=torch.channels_last)


def augment_indexed_reference(
    data: torch.Tensor,
    params: AugmentParams,
    spec: AugmentSpec,
    mean=CIFAR10_MEAN,
    std=CIFAR10_STD,
    dtype: torch.dtype = torch.float32,
    size: int = 32,
    index: torch.Tensor | None = None,
) -> torch.Tensor:
    """``augment``'s contract in plain PyTorch: gather the batch, then ``augment_reference``."""
    batch = data if index is None else data[index]
    return augment_reference(batch, params, spec, mean, std, dtype, size)


def cutout_reference(x: torch.Tensor, cy: torch.Tensor, cx: torch.Tensor, size: int) -> torch.Tensor:
    """Cutout on a float batch (bench/cutout.py's kernel), the same mask as ``augment_reference``'s step 5."""
    n, c, h, w = x.shape
    rows = torch.arange(h, device=x.device)
    cols = torch.arange(w, device=x.device)
    inside_y = (rows[None, :] >= cy[:, None]) & (rows[None, :] < cy[:, None] + size)
    inside_x = (cols[None, :] >= cx[:, None]) & (cols[None, :] < cx[:, None] + size)
    hole = inside_y[:, None, :, None] & inside_x[:, None, None, :]  # (N, 1, H, W)
    return x.masked_fill(hole, 0.0)
