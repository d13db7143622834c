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

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl
from torch import nn

from fastcifar.ops.augment import CIFAR10_MEAN, CIFAR10_STD, AugmentParams, augment_reference
from .checks import check_device

OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Fixed, not tuned on a GPU: 1024 output elements per program, 4 per thread at 8 warps. The stores
# are contiguous (the output is NHWC in memory), the uint8 loads are gathered but stay within one or
# two 96-byte image rows per 32 output elements. Each element carries its image's 6 int64 parameters
# (and 2 float32 with the jitter) and offsets: at 32 elements per thread (4096 at 4 warps) ptxas spilled 8 KB per thread on sm_90,
# at 4 per thread it spills nothing (python bench/kernel_registers.py; its rows in
# bench/results/kernel_registers.md).
BLOCK = 1024
NUM_WARPS = 8


@triton.jit
def _augment_kernel(data_ptr, index_ptr, dy_ptr, dx_ptr, flip_ptr, cy_ptr, cx_ptr, shift_ptr, scale_ptr, mean_ptr,
                    std_ptr, out_ptr, total, num_images, C, S, Hp, Wp, cutout,
                    HAS_INDEX: tl.constexpr, JITTER: tl.constexpr, BLOCK: tl.constexpr):
    """out[b, oh, ow, c] (flat NHWC) = (data[img, dy+oh, dx+(flip ? S-1-ow : ow), c] - mean[c]) * (1 / std[c]),
    then (JITTER) (that + shift[b]) * scale[b]; 0 inside the cutout square; img = index[b] (or b)."""
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = e < total
    c = e % C
    pix = e // C
    ow = pix % S
    oh = (pix // S) % S
    b = pix // (S * S)
    if HAS_INDEX:
        img = tl.load(index_ptr + b, mask=mask, other=0).to(tl.int64)
    else:
        img = b
    dy = tl.load(dy_ptr + b, mask=mask, other=0)
    dx = tl.load(dx_ptr + b, mask=mask, other=0)
    flip = tl.load(flip_ptr + b, mask=mask, other=0)
    cy = tl.load(cy_ptr + b, mask=mask, other=0)
    cx = tl.load(cx_ptr + b, mask=mask, other=0)
    row = dy + oh
    col = dx + tl.where(flip != 0, S - 1 - ow, ow)
    inside = (img >= 0) & (img < num_images) & (row >= 0) & (row < Hp) & (col >= 0) & (col < Wp)
    src = ((img * Hp + row) * Wp + col) * C + c
    v = tl.load(data_ptr + src, mask=mask & inside, other=0).to(tl.float32)
    m = tl.load(mean_ptr + c, mask=mask, other=0.0)
    s = tl.load(std_ptr + c, mask=mask, other=1.0)
    y = (v - m) * tl.math.div_rn(s * 0.0 + 1.0, s)  # times the IEEE reciprocal, as the reference (and DALI)
    if JITTER:  # launched without fp fusion: an fma of the line above with this add would round once, not twice
        sh = tl.load(shift_ptr + b, mask=mask, other=0.0)
        sc = tl.load(scale_ptr + b, mask=mask, other=1.0)
        y = (y + sh) * sc
    hole = (oh >= cy) & (oh < cy + cutout) & (ow >= cx) & (ow < cx + cutout)
    y = tl.where(hole, 0.0, y)
    tl.store(out_ptr + e, y.to(out_ptr.dtype.element_ty), mask=mask)


def _empty(shape, dtype, device) -> torch.Tensor:
    """The output comes from here (tests replace it with a NaN-filled one)."""
    return torch.empty(shape, dtype=dtype, device=device, memory_format=torch.channels_last)


def _check_vector(t, name, n, device, dtypes=(torch.int32, torch.int64)):
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.shape[0] != n:
        raise ValueError(f"{name} must be a 1-D tensor of length {n}, got "
                         f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must be one of {dtypes}, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the images on {device}")


def channel_constants(values, channels: int, device) -> torch.Tensor:
    """Mean or std as a contiguous fp32 (C,) tensor on ``device`` (a tuple, or a tensor already)."""
    t = torch.as_tensor(values, dtype=torch.float32, device=device).contiguous()
    if t.shape != (channels,):
        raise ValueError(f"need {channels} per-channel values, got shape {tuple(t.shape)}")
    return t


def augment(data: torch.Tensor, params: AugmentParams, cutout: int, mean=CIFAR10_MEAN, std=CIFAR10_STD,
            dtype: torch.dtype = torch.float16, size: int = 32, index: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Launcher. ``data``: padded NHWC uint8 images, (D, size+2*pad, size+2*pad, C) contiguous -- the
    batch itself, or (better) the whole padded data set with ``index`` (B,) picking the batch.
    Returns (B, C, size, size) ``dtype``, channels-last, equal to ``augment_reference(data[index], ...)``.
    Pass ``mean``/``std`` as fp32 (C,) device tensors (see ``channel_constants``) on the hot path to
    skip the per-call host-to-device copy of the tuples."""
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
    y = _empty((b, c, size, size), dtype, data.device)
    if y.numel():
        jitter = (params.shift, params.scale) if params.jitter else (mean_t, mean_t)  # unread without JITTER
        _augment_kernel[(triton.cdiv(y.numel(), BLOCK),)](
            data, index if index is not None else data, params.dy, params.dx, params.flip, params.cy, params.cx,
            *jitter, mean_t, std_t, y, y.numel(), d, c, size, hp, wp, cutout,
            HAS_INDEX=index is not None, JITTER=params.jitter, BLOCK=BLOCK, num_warps=NUM_WARPS,
            enable_fp_fusion=not params.jitter)
    return y


class TritonAugment(nn.Module):
    """Holds the constants (mean/std as device buffers, cutout, dtype) and calls ``augment``."""

    def __init__(self, cutout: int, mean: Sequence[float] = CIFAR10_MEAN, std: Sequence[float] = CIFAR10_STD,
                 dtype: torch.dtype = torch.float16, size: int = 32):
        super().__init__()
        self.cutout, self.dtype, self.size = cutout, dtype, size
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32), persistent=False)
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32), persistent=False)

    @torch.no_grad()
    def forward(self, data: torch.Tensor, params: AugmentParams, index: Optional[torch.Tensor] = None) -> torch.Tensor:
        return augment(data, params, self.cutout, self.mean, self.std, self.dtype, self.size, index)

    def extra_repr(self) -> str:
        return f"cutout={self.cutout}, dtype={self.dtype}, size={self.size}"


def augment_indexed_reference(data: torch.Tensor, params: AugmentParams, cutout: int, mean=CIFAR10_MEAN,
                              std=CIFAR10_STD, dtype: torch.dtype = torch.float32, size: int = 32,
                              index: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``augment``'s contract in plain PyTorch: gather the batch, then ``augment_reference``."""
    batch = data if index is None else data[index]
    return augment_reference(batch, params, cutout, mean, std, dtype, size)
