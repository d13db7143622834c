"""Cutout on a channels-last batch: zero a size x size square per image, forward and backward.

The training path does cutout inside the fused augmentation (``kernels/augment.py``, zero extra
passes); this op is for a float batch that already exists (another loader's output, or cutout moved
after some other transform). It is one read and one write of the batch (the minimum out of place);
backward applies the same mask to the gradient (one read, one write).

Per image n the square is rows cy[n] .. cy[n]+size-1, columns cx[n] .. cx[n]+size-1 (clipped to the
image); ``fastcifar.ops.augment.draw_params`` draws (cy, cx) on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

from fastcifar.kernels.checks import check_activation

# Fixed, not tuned on a GPU: 2048 elements per program = 8 per thread at 8 warps (4 KiB of fp16 in
# flight). At 32 per thread (4096 at 4 warps) the int64 index math took 255 registers and spilled on
# sm_90; at 8 it spills nothing (its rows in bench/results/kernel_registers.md, from
# python bench/kernel_registers.py).
BLOCK = 2048
NUM_WARPS = 8


@triton.jit
def _cutout_kernel(x_ptr, y_ptr, cy_ptr, cx_ptr, total, C, H, W, size, BLOCK: tl.constexpr):
    """y = x with the square zeroed; x, y flat NHWC (element e is channel e % C of pixel e // C)."""
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = e < total
    pix = e // C
    w = pix % W
    h = (pix // W) % H
    n = pix // (W * H)
    cy = tl.load(cy_ptr + n, mask=mask, other=0)
    cx = tl.load(cx_ptr + n, mask=mask, other=0)
    hole = (h >= cy) & (h < cy + size) & (w >= cx) & (w < cx + size)
    x = tl.load(x_ptr + e, mask=mask, other=0.0)
    tl.store(y_ptr + e, tl.where(hole, tl.zeros_like(x), x), mask=mask)


def _empty_like(x: torch.Tensor) -> torch.Tensor:
    """Every output the launcher allocates comes from here (tests replace it with NaN-filled ones)."""
    return torch.empty_like(x, memory_format=torch.channels_last)


def check_positions(t: torch.Tensor, name: str, n: int, device) -> None:
    if t.dim() != 1 or t.shape[0] != n:
        raise ValueError(f"{name} must have shape ({n},) (one per image), got {tuple(t.shape)}")
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the images on {device}")


def cutout_forward(x: torch.Tensor, cy: torch.Tensor, cx: torch.Tensor, size: int) -> torch.Tensor:
    """Launcher: a new channels-last tensor equal to x with each image's square zeroed."""
    check_activation(x)
    n, c, h, w = x.shape
    check_positions(cy, "cy", n, x.device)
    check_positions(cx, "cx", n, x.device)
    if not isinstance(size, int) or size < 0:
        raise ValueError(f"cutout size must be a non-negative int, got {size!r}")
    y = _empty_like(x)
    if x.numel():
        _cutout_kernel[(triton.cdiv(x.numel(), BLOCK),)](
            x, y, cy, cx, x.numel(), c, h, w, size, BLOCK=BLOCK, num_warps=NUM_WARPS
        )
    return y


class CutoutFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cy, cx, size):
        ctx.save_for_backward(cy, cx)
        ctx.size = size
        return cutout_forward(x, cy, cx, size)

    @staticmethod
    def backward(ctx, dy):
        cy, cx = ctx.saved_tensors
        # no-op for channels-last gradients; a foreign layout (e.g. from .sum()) is copied once
        dy = dy.contiguous(memory_format=torch.channels_last)
        return cutout_forward(dy, cy, cx, ctx.size), None, None, None


def cutout(x: torch.Tensor, cy: torch.Tensor, cx: torch.Tensor, size: int) -> torch.Tensor:
    """Functional form with autograd."""
    return CutoutFunction.apply(x, cy, cx, size)


class Cutout(nn.Module):
    """``Cutout(size)(x, cy, cx)``: zero each image's size x size square at (cy, cx)."""

    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def forward(self, x: torch.Tensor, cy: torch.Tensor, cx: torch.Tensor) -> torch.Tensor:
        return cutout(x, cy, cx, self.size)

    def extra_repr(self) -> str:
        return f"size={self.size}"
