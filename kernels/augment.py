"""The training augmentation in one pass: gather + crop + flip + normalize + jitter + cutout, uint8 -> float.

Equal to ``fastcifar.ops.augment.augment_reference`` (the definition; see its docstring for the order).
The kernel reads the whole padded data set in place through a (B,) index tensor, so the batch is
never gathered into a uint8 copy first: each output element reads 1 byte and writes 2 (fp16) or
4 (fp32); the eager reference makes ~6 passes (gather, float, subtract, divide, cast, masked fill,
layout copy). Parameters are drawn on the device by ``fastcifar.ops.augment.draw_params`` and read by
the kernel there, so nothing is synchronized with the host.

No backward: the input is uint8 pixels, which carry no gradient; the output is a leaf of the graph.

Out-of-range parameters (a crop past the padding, an index past the data set) are not validated on
the host (that would need a device sync every step); the kernel masks its reads to stay inside the
data set, so a bad parameter gives a wrong image, never an illegal memory access.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import nn

from fastcifar.ops.augment import CIFAR10_MEAN, CIFAR10_STD, AugmentParams, AugmentSpec

from .checks import check_device

OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# One program per image: a (S rows) x (S x C pixels of a row, padded to a power of two) tile, so an
# image's parameters are scalars loaded once, and everything that depends only on the row or only on
# the position within a row (the crop's source row, the flipped column, the channel's mean and
# reciprocal std, the cutout's band) is computed on a vector of S or S x C lanes, not per element;
# per element remain an add of the two offsets, the load, the arithmetic and the store. Every offset
# within an image is 32-bit; the image's own (into the data set, past 2^31 bytes for a large folder
# set) is a 64-bit scalar. Each element's coordinates computed with five 64-bit divisions by
# runtime values instead (a software routine on the GPU, 24 calls per thread in its sm_90 SASS)
# ran at 141 GB/s, 6.5x slower than torch.compile of the reference
# (bench/results/visits/visit-12.md, 12e).
# 4 warps: a CIFAR image's 32 x 128 lanes (96 of each row's 128 used) at 32 per thread. Compiled for
# sm_90 (Triton 3.8, no GPU), the jitter variant: 72 registers, no spills, 960 SASS instructions a
# thread, so 123k an image. At 8 warps the first draft of this layout took 94 registers and 205k
# instructions an image, at 16 warps 62 and 360k (each thread recomputes the row-wise vectors for
# the lanes it holds). sm_70 to sm_90: 64-77 registers, no spills (bench/results/kernel_registers.md).
# Not yet timed on a GPU; its floor at the default's batch is 18.4 MB of traffic, about 0.006 ms on
# an H100 (bench_augment.py's floor_ms).
NUM_WARPS = 4


@triton.jit
def _augment_kernel(
    data_ptr,
    index_ptr,
    dy_ptr,
    dx_ptr,
    flip_ptr,
    cy_ptr,
    cx_ptr,
    shift_ptr,
    scale_ptr,
    mean_ptr,
    std_ptr,
    out_ptr,
    num_images,
    Hp,
    Wp,
    cutout,
    C: tl.constexpr,
    S: tl.constexpr,
    ROWS: tl.constexpr,
    LANES: tl.constexpr,
    HAS_INDEX: tl.constexpr,
    JITTER: tl.constexpr,
):
    """out[b, oh, ow, c] (flat NHWC) = (data[img, dy+oh, dx+(flip ? S-1-ow : ow), c] - mean[c]) * (1 / std[c]),
    then (JITTER) (that + shift[b]) * scale[b]; 0 inside the cutout square; img = index[b] (or b).
    Program (b, r) writes rows r * ROWS .. of image b (those < S), lanes j = ow * C + c < S * C of LANES."""
    b = tl.program_id(0).to(tl.int64)
    img = tl.load(index_ptr + b).to(tl.int64) if HAS_INDEX else b
    dy = tl.load(dy_ptr + b).to(tl.int32)
    dx = tl.load(dx_ptr + b).to(tl.int32)
    flip = tl.load(flip_ptr + b)
    cy = tl.load(cy_ptr + b).to(tl.int32)
    cx = tl.load(cx_ptr + b).to(tl.int32)
    oh = tl.program_id(1) * ROWS + tl.arange(0, ROWS)  # the output row
    j = tl.arange(0, LANES)  # the position within it: pixel ow, channel c
    ow = j // C
    c = j - ow * C
    used_j = j < S * C
    row = dy + oh
    col = dx + tl.where(flip != 0, S - 1 - ow, ow)
    # the image's bounds compared as a vector of its rows, not as one scalar joined to the mask: the
    # interpreter splats a scalar boolean into an int64 array, so the joined mask became int32, which
    # Triton 3.8's interpreted load took and 3.9's refuses ("mask has unsupported dtype")
    img_rows = tl.zeros([ROWS], tl.int64) + img
    row_ok = (oh < S) & (row >= 0) & (row < Hp) & (img_rows >= 0) & (img_rows < num_images)
    col_ok = used_j & (col >= 0) & (col < Wp)
    m = tl.load(mean_ptr + c, mask=used_j, other=0.0)
    r = tl.math.div_rn(tl.full([LANES], 1.0, tl.float32), tl.load(std_ptr + c, mask=used_j, other=1.0))
    hole = (((oh >= cy) & (oh < cy + cutout))[:, None]) & (((ow >= cx) & (ow < cx + cutout))[None, :])
    src = data_ptr + img * Hp * Wp * C + ((row * Wp * C)[:, None] + (col * C + c)[None, :])
    v = tl.load(src, mask=row_ok[:, None] & col_ok[None, :], other=0).to(tl.float32)
    y = (v - m[None, :]) * r[None, :]  # times the IEEE reciprocal, as the reference (and DALI)
    if JITTER:  # launched without fp fusion: an fma of the line above with this add would round once, not twice
        y = (y + tl.load(shift_ptr + b)) * tl.load(scale_ptr + b)
    y = tl.where(hole, 0.0, y)
    dst = out_ptr + b * S * S * C + ((oh * S * C)[:, None] + j[None, :])
    tl.store(dst, y.to(out_ptr.dtype.element_ty), mask=(oh < S)[:, None] & used_j[None, :])


TILE = 4096  # elements a program holds: a whole CIFAR image (32 rows of 128 lanes), 32 per thread
MAX_LANES = 16384  # a row of more values than this (a side of 5462 at 3 channels) is refused


def tile(size: int, channels: int) -> tuple[int, int]:
    """(lanes, rows) of a program's tile for images of side ``size``: a row's size x channels values
    padded to a power of two, and as many rows as fit in TILE (all 32 of a CIFAR image; 8 of a 96 x 96
    one, whose image then takes 12 programs)."""
    lanes = triton.next_power_of_2(size * channels)
    if lanes > MAX_LANES:
        raise ValueError(
            f"images of side {size} with {channels} channels have {size * channels} values a row; "
            f"the augmentation kernel takes at most {MAX_LANES}"
        )
    return lanes, min(triton.next_power_of_2(size), max(1, TILE // lanes))


def _empty(shape, dtype, device) -> torch.Tensor:
    """The output comes from here (tests replace it with a NaN-filled one)."""
    return torch.empty(shape, dtype=dtype, device=device, memory_format=torch.channels_last)


def _check_vector(t, name, n, device, dtypes=(torch.int32, torch.int64)):
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.shape[0] != n:
        raise ValueError(
            f"{name} must be a 1-D tensor of length {n}, got "
            f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}"
        )
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must be one of {dtypes}, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the images on {device}")


def _check_out(out, shape, dtype, device) -> None:
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != shape or out.dtype != dtype:
        got = f"{out.dtype} {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"out must be {dtype} {shape}, got {got}")
    if not out.is_contiguous(memory_format=torch.channels_last):
        raise ValueError(f"out must be channels-last contiguous, got strides {out.stride()}")
    if out.device != device:
        raise ValueError(f"out is on {out.device}, the images on {device}")


def channel_constants(values, channels: int, device) -> torch.Tensor:
    """Mean or std as a contiguous fp32 (C,) tensor on ``device`` (a tuple, or a tensor already)."""
    t = torch.as_tensor(values, dtype=torch.float32, device=device).contiguous()
    if t.shape != (channels,):
        raise ValueError(f"need {channels} per-channel values, got shape {tuple(t.shape)}")
    return t


def augment(
    data: torch.Tensor,
    params: AugmentParams,
    spec: AugmentSpec,
    mean=CIFAR10_MEAN,
    std=CIFAR10_STD,
    dtype: torch.dtype = torch.float16,
    size: int = 32,
    index: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launcher. ``data``: padded NHWC uint8 images, (D, size+2*pad, size+2*pad, C) contiguous -- the
    batch itself, or (better) the whole padded data set with ``index`` (B,) picking the batch.
    ``params``: drawn from ``spec`` (``fastcifar.ops.augment.draw_params``), on the data's device.
    Returns (B, C, size, size) ``dtype``, channels-last, equal to ``augment_reference(data[index], ...)``.
    Pass ``mean``/``std`` as fp32 (C,) device tensors (see ``channel_constants``) on the hot path to
    skip the per-call host-to-device copy of the tuples. ``out``: write there instead (that shape and
    dtype, channels-last contiguous, on the data's device) and return it: the training step's input
    buffer, so the batch is written once and never copied into it (2000 x 3072 x 2 bytes a step)."""
    if data.dim() != 4 or data.dtype != torch.uint8:
        raise ValueError(f"data must be NHWC uint8 images (D, H, W, C), got {data.dtype} {tuple(data.shape)}")
    if not data.is_contiguous():
        raise ValueError(f"data must be contiguous NHWC, got strides {data.stride()}")
    check_device(data, "data")
    d, hp, wp, c = data.shape
    if hp < size or wp < size or (hp - size) % 2 or (wp - size) % 2:
        raise ValueError(f"data must be {size}x{size} images padded evenly on each side, got {hp}x{wp}")
    if dtype not in OUT_DTYPES:
        raise TypeError(f"output dtype must be one of {OUT_DTYPES}, got {dtype}")
    cutout = spec.cutout
    if not isinstance(cutout, int) or not 0 <= cutout <= size:
        raise ValueError(f"cutout must be an int in [0, {size}], got {cutout!r}")
    if index is None:
        b = d
    else:
        _check_vector(index, "index", index.shape[0] if index.dim() == 1 else -1, data.device)
        b = index.shape[0]
    for name in ("dy", "dx", "flip", "cy", "cx"):
        _check_vector(getattr(params, name), f"params.{name}", b, data.device)
    if params.jitter:
        for name in ("shift", "scale"):
            _check_vector(getattr(params, name), f"params.{name}", b, data.device, dtypes=(torch.float32,))
    mean_t = channel_constants(mean, c, data.device)
    std_t = channel_constants(std, c, data.device)
    lanes, rows = tile(size, c)
    if out is None:
        y = _empty((b, c, size, size), dtype, data.device)
    else:
        _check_out(out, (b, c, size, size), dtype, data.device)
        y = out
    if y.numel():
        jitter = (params.shift, params.scale) if params.jitter else (mean_t, mean_t)  # unread without JITTER
        _augment_kernel[(b, triton.cdiv(size, rows))](
            data,
            index if index is not None else data,
            params.dy,
            params.dx,
            params.flip,
            params.cy,
            params.cx,
            *jitter,
            mean_t,
            std_t,
            y,
            d,
            hp,
            wp,
            cutout,
            C=c,
            S=size,
            ROWS=rows,
            LANES=lanes,
            HAS_INDEX=index is not None,
            JITTER=params.jitter,
            num_warps=NUM_WARPS,
            enable_fp_fusion=not params.jitter,
        )
    return y


class TritonAugment(nn.Module):
    """Holds the constants (the spec, mean/std as device buffers, dtype) and calls ``augment``."""

    def __init__(
        self,
        spec: AugmentSpec,
        mean: Sequence[float] = CIFAR10_MEAN,
        std: Sequence[float] = CIFAR10_STD,
        dtype: torch.dtype = torch.float16,
        size: int = 32,
    ):
        super().__init__()
        self.spec, self.dtype, self.size = spec, dtype, size
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32), persistent=False)
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32), persistent=False)

    @torch.no_grad()
    def forward(
        self,
        data: torch.Tensor,
        params: AugmentParams,
        index: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return augment(data, params, self.spec, self.mean, self.std, self.dtype, self.size, index, out)

    def extra_repr(self) -> str:
        return f"{self.spec}, dtype={self.dtype}, size={self.size}"
