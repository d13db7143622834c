"""A "same" convolution (odd square kernel, stride 1) as an implicit GEMM whose epilogue takes the
batchnorm's statistics, and for a block that pools first the 2x2 max-pool too: the conv half of a
``ConvBlock`` fused with the first stage of its ``TritonNormActPool``.

Drop-in for ``ConvBlock`` (``fastcifar.ops.norm_act_pool``): ``TritonConvBlock``, same constructor and
state, turned on per block by ``--fused-conv`` (``fastcifar.models.blocks.fuse_conv_blocks``).

Why. With cuDNN's conv the normalize block must read the conv's output once more for the statistics
before it can apply them: in units of the block's *normalized* map P, the default preset's
pool-first blocks write the conv output (4P), read it for pool + statistics (4P) and write the
pooled z and its argmax (1.5P) before the apply reads z; here the conv's accumulator tile is pooled
and its statistics taken while it is still in registers, so only z and the argmax are written
(1.5P): 8P fewer bytes moved per forward, 69% of the forward's map traffic around the conv. Blocks
that do not pool skip the statistics read (P of the forward's 3P). Backward is unchanged: the
normalize block's backward kernels (they only need z or the conv output, the argmax and the
statistics, all saved as before), then cuDNN's convolution backward for the input and filter
gradients.

What it can save, computed (not measured): at the default preset's six convs (2000 images) the
traffic it removes is about 1.19 GB a step (each pool-first block 8P, the others P), 0.39 ms at the
H100's measured 3004 GB/s copy rate (bench/results/visits/visit-6.md, 6e): about 5% of the graphed
step (7.12 ms, visit-6.md 6b), and only if the Triton conv's main loop keeps up with cuDNN's.

No prologue. Applying the previous block's normalize + activation on the A tile's load (the other
half of fusing the normalize block into the conv) would spare that block's apply pass (read its
pooled map, write the activations: 2P) in the forward, but the filter gradient needs those
activations, so cuDNN's backward would need them written after all: the pass moves to the backward
unless the filter gradient is a Triton kernel with the same prologue. The most it could save is 2P
per block, about 0.09 ms a step at the same rate: not worth a Triton filter-gradient kernel before
the forward kernel is measured.

Layout. The input is channels-last (NHWC in memory), so an output pixel's receptive field at one
kernel tap is a contiguous run of C_in channels: the GEMM's A tile is BLOCK_M output pixels x BLOCK_K
input channels at one tap (masked to zero where the tap falls in the padding), its B tile BLOCK_K x
BLOCK_N of the filter at that tap (read through the filter's strides: a channels-last filter has C_in
contiguous too), K = taps x C_in, walked as one loop over (tap, channel block). A tile's rows are
output pixels in NHW order; for the pooled epilogue they are BLOCK_M / 4 windows of the pooled map
in NHW order, with four accumulators, one per position in the window (each its own A tile, all the
same B tile), so the epilogue pools them element-wise and the pooled rows are consecutive.

Statistics. Each program walks ``tiles_per_prog`` consecutive M tiles of one channel block and
keeps a running (count, mean, M2) per channel, each tile's mean and M2 (two passes over the tile
in registers) folded in by Chan's parallel formula; it writes one (mean, M2) partial per channel, the format of
``bn_act_pool``'s stage 1 (``Partials``), whose stage 2 and apply then run unchanged. Deterministic:
no atomics, every sum in a fixed order. Statistics are of the values written (rounded to the I/O
dtype), as the normalize block would read them.

Numerics. fp32 accumulation (fp32 inputs in IEEE fp32, not TF32: the backward's library conv
follows torch's TF32 setting instead), the output rounded once to the I/O dtype, as cuDNN's fp16
conv rounds its fp32 accumulator; the summation order over K differs from cuDNN's, so outputs
differ from it in the last bit now and then (the tests' tolerance), and a 2x2 window whose top two
values are that close may pick the other argmax: either is a correct subgradient (the normalize
kernel's tests exempt such windows on the GPU the same way).

Block sizes: 128 x 64 x 32 (M x N x K) on 8 warps, 2 stages, 8 programs per SM of the device in
all (1056 on an H100's 132 SMs, 864 on an A100's 108; ``core.gpu.sm_count``, asked once per device:
at 70-172 registers a thread one to three fit on an SM at a time, so they run in waves). With one
accumulator reshaped into windows, or on 4 warps, the pooled variant needed 255 registers a thread
and spilled on sm_80 and sm_90 (ptxas, compiled on the CPU; bench/results/kernel_registers.md has
the rows); fp32 has smaller tiles (``LAUNCH_FP32``), and so has every dtype below capability 8.0
(``launch_for``: Volta and Turing have no mma that Triton's ``tl.dot`` uses, it becomes FMAs, and
the 128 x 64 x 32 tiles spilled 204-612 B at 255 registers on sm_70 and sm_75). Nothing
here is tuned on a GPU yet: ``bench/bench_conv_stats.py`` times the kernel against cuDNN
+ the normalize block at the default preset's shapes. A likely limit to look at there: the pooled
variant's 32-row accumulators are below the 64 rows Hopper's wgmma instructions take, so it
probably runs on the older mma path.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fastcifar.core import gpu
from fastcifar.ops.norm_act_pool import ConvBlock

from .bn_act_pool import (
    Partials,
    TritonNormActPool,
    _argmax4,
    _empty,
    bn_act_pool_backward,
    normalize_partials,
)
from .checks import check_activation


class ConvLaunch(NamedTuple):
    block_m: int  # output pixels per tile (4 per pooled row when the epilogue pools)
    block_n: int  # output channels per tile, at most
    block_k: int  # input channels per step of the K loop, at most
    warps: int
    stages: int
    # programs in all per SM of the device, over the channel blocks (each walks consecutive M tiles)
    programs_per_sm: int


LAUNCH = ConvLaunch(128, 64, 32, 8, 2, 8)  # fp16 and bf16 from capability 8.0
# fp32 (tests, --precision fp32): twice the registers per accumulated element; fp16's tiles spilled
# (255 registers a thread on sm_80 and sm_90 in the pooled variant), and so did 64 x 64 x 16 and
# 8-warp 64 x 32 x 16 at some shapes (4-24 bytes); these compile without spills at the default
# preset's and the odd shapes (bench/kernel_registers.py's DEFAULT_CONVS, ODD_CONVS) on both
LAUNCH_FP32 = ConvLaunch(64, 32, 16, 4, 1, 8)
AMPERE = (8, 0)  # from here tl.dot runs on mma tensor-core instructions; below, every dtype takes LAUNCH_FP32's tiles
DOT_MIN = 16  # tl.dot's smallest tile side


# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def _a_tile(x_ptr, n, oh, ow, ok, dh, dw, H, W, C_in, kk, kmask):
    """The A tile at one tap: rows (n, oh + dh, ow + dw) of x, channels ``kk``; zero in the padding."""
    ih = oh + dh
    iw = ow + dw
    inside = ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
    row = ((n * H + ih) * W + iw).to(tl.int64) * C_in
    return tl.load(x_ptr + row[:, None] + kk[None, :], mask=inside[:, None] & kmask[None, :], other=0.0)


@triton.jit
def _mma(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _conv_stats_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    idx_ptr,
    pmean_ptr,
    pm2_ptr,
    H,
    W,
    C_in,
    C_out,
    Ho,
    Wo,
    R,
    num_tiles,
    tiles_per_prog,
    sw_o,
    sw_i,
    sw_h,
    sw_w,
    KSIZE: tl.constexpr,
    POOL: tl.constexpr,
    STATS: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Programs: axis 0 channel blocks (fastest, so the programs sharing an A tile run together and
    find it in L2), axis 1 chunks of ``tiles_per_prog`` M tiles. R: rows of the output map (pixels of
    the conv output, or of the pooled map when POOL).

    POOL: a tile is BLOCK_M // 4 windows, one accumulator per window position (dy, dx), all four
    multiplying the same B tile; the epilogue pools them element-wise. (One BLOCK_M-row accumulator
    reshaped into windows needed 250+ registers a thread on sm_90 with the layout shuffle, spilling
    on 4 warps: bench/results/kernel_registers.md.)"""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < C_out
    ROWS: tl.constexpr = BLOCK_M // 4 if POOL else BLOCK_M  # output rows per tile
    PAD: tl.constexpr = KSIZE // 2
    ks = tl.arange(0, BLOCK_K)
    # a runtime count: as a constexpr (1, 2 or 10 here) the constant trip count let the compiler
    # unroll the loop, and three CI variants then spilled on sm_90 (8-20 bytes)
    k_blocks = tl.cdiv(C_in, BLOCK_K)
    count = 0.0
    mean = tl.zeros([BLOCK_N], tl.float32)
    m2 = tl.zeros([BLOCK_N], tl.float32)
    first = pid_m * tiles_per_prog
    for t in range(first, tl.minimum(first + tiles_per_prog, num_tiles)):
        rows = t * ROWS + tl.arange(0, ROWS)
        ok = rows < R
        if POOL:  # rows are windows: top-left pixel (2 hw, 2 ww)
            ww = rows % Wo
            q = rows // Wo
            oh = 2 * (q % Ho)
            ow = 2 * ww
            n = q // Ho
        else:
            ow = rows % W
            q = rows // W
            oh = q % H
            n = q // H
        acc0 = tl.zeros([ROWS, BLOCK_N], tl.float32)
        acc1 = tl.zeros([ROWS, BLOCK_N], tl.float32)
        acc2 = tl.zeros([ROWS, BLOCK_N], tl.float32)
        acc3 = tl.zeros([ROWS, BLOCK_N], tl.float32)
        # one loop over K = taps x channel blocks, so the pipeliner overlaps loads across taps (a loop
        # per tap around one over the channels gave it 1-2 iterations at 24 or 64 input channels);
        # not unrolled: 9 copies of a tap's row offsets cost registers
        for step in range(KSIZE * KSIZE * k_blocks):
            tap = step // k_blocks
            dh = tap // KSIZE - PAD
            dw = tap % KSIZE - PAD
            kk = (step % k_blocks) * BLOCK_K + ks
            kmask = kk < C_in
            b_tap = w_ptr + (tap // KSIZE) * sw_h + (tap % KSIZE) * sw_w
            b = tl.load(
                b_tap + kk[:, None] * sw_i + cols[None, :] * sw_o, mask=kmask[:, None] & cmask[None, :], other=0.0
            )
            acc0 = _mma(_a_tile(x_ptr, n, oh, ow, ok, dh, dw, H, W, C_in, kk, kmask), b, acc0, IEEE)
            if POOL:
                acc1 = _mma(_a_tile(x_ptr, n, oh, ow, ok, dh, dw + 1, H, W, C_in, kk, kmask), b, acc1, IEEE)
                acc2 = _mma(_a_tile(x_ptr, n, oh, ow, ok, dh + 1, dw, H, W, C_in, kk, kmask), b, acc2, IEEE)
                acc3 = _mma(_a_tile(x_ptr, n, oh, ow, ok, dh + 1, dw + 1, H, W, C_in, kk, kmask), b, acc3, IEEE)
        # rounded once, as the conv's output is stored; the pool compares the rounded values
        v = acc0.to(out_ptr.dtype.element_ty).to(tl.float32)
        if POOL:
            v, k = _argmax4(
                v,
                acc1.to(out_ptr.dtype.element_ty).to(tl.float32),
                acc2.to(out_ptr.dtype.element_ty).to(tl.float32),
                acc3.to(out_ptr.dtype.element_ty).to(tl.float32),
            )
        mask = ok[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * C_out + cols[None, :]
        tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=mask)
        if POOL:
            tl.store(idx_ptr + offs, k.to(tl.int8), mask=mask)
        if STATS:  # the tile's mean and M2 (two passes over its registers), folded into the program's (Chan et al.)
            nt = tl.sum(ok.to(tl.float32), axis=0)
            tmean = tl.sum(tl.where(mask, v, 0.0), axis=0) / nt
            d = tl.where(mask, v - tmean[None, :], 0.0)
            total = count + nt
            delta = tmean - mean
            mean += delta * (nt / total)
            m2 += tl.sum(d * d, axis=0) + delta * delta * (count * nt / total)
            count = total
    if STATS:
        tl.store(pmean_ptr + pid_m * C_out + cols, mean, mask=cmask)
        tl.store(pm2_ptr + pid_m * C_out + cols, m2, mask=cmask)


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------


def _check_filter(x: torch.Tensor, weight: torch.Tensor) -> int:
    """The filter of a stride-1 "same" conv over ``x``: (C_out, C_in, k, k), k odd, x's dtype and
    device. Returns k."""
    if weight.dim() != 4:
        raise ValueError(f"conv weight must be 4-D (C_out, C_in, k, k), got shape {tuple(weight.shape)}")
    c_out, c_in, kh, kw = weight.shape
    if kh != kw or kh % 2 == 0:
        raise ValueError(f'conv weight must have an odd square kernel ("same" padding k//2), got {kh}x{kw}')
    if c_in != x.shape[1]:
        raise ValueError(f"conv weight takes {c_in} input channels, x has {x.shape[1]}")
    if weight.dtype != x.dtype:
        raise TypeError(f"conv weight must be {x.dtype} like x, got {weight.dtype}")
    if weight.device != x.device:
        raise ValueError(f"conv weight is on {weight.device}, x on {x.device}")
    return kh


def launch_for(dtype: torch.dtype, device: torch.device | None = None) -> ConvLaunch:
    """The tiles for ``dtype`` on ``device``: LAUNCH_FP32's for fp32, and for every dtype below
    capability 8.0 (the 64 x 32 x 16 tiles compile for sm_70 and sm_75 without spills); LAUNCH's
    otherwise, and where the capability is unknown (CPU tensors: the interpreter)."""
    capability = gpu.capability(device) if device is not None else None
    if dtype == torch.float32 or (capability is not None and capability < AMPERE):
        return LAUNCH_FP32
    return LAUNCH


class ConvTiling(NamedTuple):
    block_n: int
    block_k: int
    n_blocks: int  # channel blocks
    num_tiles: int  # M tiles
    tiles_per_prog: int
    chunks: int  # programs per channel block, one statistics partial each
    rows_per_prog: int  # output rows a chunk covers (``Partials.rows_per_prog``)


def conv_tiling(
    c_in: int, c_out: int, rows: int, pool: bool, launch: ConvLaunch, sms: int = gpu.DEFAULT_SMS
) -> ConvTiling:
    """The grid and tiles of one conv on a device of ``sms`` SMs."""
    block_n = max(DOT_MIN, min(launch.block_n, triton.next_power_of_2(c_out)))
    block_k = max(DOT_MIN, min(launch.block_k, triton.next_power_of_2(c_in)))
    n_blocks = triton.cdiv(c_out, block_n)
    tile_rows = launch.block_m // 4 if pool else launch.block_m
    num_tiles = triton.cdiv(rows, tile_rows)
    tiles_per_prog = triton.cdiv(num_tiles, max(1, launch.programs_per_sm * sms // n_blocks))
    return ConvTiling(
        block_n,
        block_k,
        n_blocks,
        num_tiles,
        tiles_per_prog,
        triton.cdiv(num_tiles, tiles_per_prog),
        tiles_per_prog * tile_rows,
    )


def conv_stats_forward(x: torch.Tensor, weight: torch.Tensor, training: bool, pool: str | None = None):
    """The conv of ``x`` (N, C_in, H, W channels-last) with ``weight``, stride 1, padding k//2, no
    bias. Returns (out, idx, partials): ``pool="before"``: out is the 2x2-max-pooled conv output
    (N, C_out, H//2, W//2; floor mode, as ``F.max_pool2d``) and idx its int8 argmax in 0..3 (row-major
    in the window); otherwise out is the conv output and idx None. ``partials`` (training only, else
    None): the batch statistics of ``out`` per chunk, for ``normalize_partials``."""
    if pool not in (None, "before", "after"):
        raise ValueError(f"pool must be None, 'before' or 'after', not {pool!r}")
    check_activation(x)
    k = _check_filter(x, weight)
    n, c_in, h, w = x.shape
    c_out = weight.shape[0]
    pooled = pool == "before"
    if pooled and (h < 2 or w < 2):
        raise ValueError(f"2x2 max-pool needs maps of at least 2x2, got {h}x{w}")
    ho, wo = (h // 2, w // 2) if pooled else (h, w)
    rows = n * ho * wo
    if training and rows < 2:
        raise ValueError(f"expected more than 1 value per channel when training, got input of shape {tuple(x.shape)}")
    dev = x.device
    launch = launch_for(x.dtype, dev)
    tiling = conv_tiling(c_in, c_out, rows, pooled, launch, gpu.sm_count(dev))
    out = _empty((n, c_out, ho, wo), x.dtype, dev, channels_last=True)
    idx = _empty((n, c_out, ho, wo), torch.int8, dev, channels_last=True) if pooled else None
    partials = None
    if training:
        partials = Partials(
            _empty((tiling.chunks, c_out), torch.float32, dev),
            _empty((tiling.chunks, c_out), torch.float32, dev),
            tiling.rows_per_prog,
        )
    _conv_stats_kernel[(tiling.n_blocks, tiling.chunks)](
        x,
        weight,
        out,
        idx if pooled else out,
        partials.pmean if training else out,
        partials.pm2 if training else out,
        h,
        w,
        c_in,
        c_out,
        ho,
        wo,
        rows,
        tiling.num_tiles,
        tiling.tiles_per_prog,
        *weight.stride(),
        KSIZE=k,
        POOL=pooled,
        STATS=training,
        IEEE=x.dtype == torch.float32,
        BLOCK_M=launch.block_m,
        BLOCK_N=tiling.block_n,
        BLOCK_K=tiling.block_k,
        num_warps=launch.warps,
        num_stages=launch.stages,
    )
    return out, idx, partials


# ----------------------------------------------------------------------------------------------
# autograd.Function and module
# ----------------------------------------------------------------------------------------------


class ConvBnActPoolFunction(torch.autograd.Function):
    """conv -> [pool before] -> batchnorm -> activation -> [pool after]: the conv kernel with the
    statistics in its epilogue, the normalize block's stage 2 and apply; backward: the normalize
    block's backward kernels, then cuDNN's (or the CPU's) convolution backward."""

    @staticmethod
    def forward(ctx, x, conv_weight, weight, bias, running_mean, running_var, training, momentum, eps, act, pool):
        out, idx, partials = conv_stats_forward(x, conv_weight, training, pool)
        n, _, h, w = x.shape
        conv_shape = (n, conv_weight.shape[0], h, w)
        y, (src, idx, mean, rstd) = normalize_partials(
            out, idx, partials, conv_shape, weight, bias, running_mean, running_var, momentum, eps, act, pool
        )
        ctx.save_for_backward(x, conv_weight, src, idx, mean, rstd, weight, bias)
        ctx.cfg = (conv_shape, training, act, pool)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, conv_weight, src, idx, mean, rstd, weight, bias = ctx.saved_tensors
        conv_shape, training, act, pool = ctx.cfg
        dy = dy.contiguous(memory_format=torch.channels_last)  # a no-op for the model's gradients
        dconv, dw, db = bn_act_pool_backward(dy, (src, idx, mean, rstd), weight, bias, conv_shape, training, act, pool)
        pad = conv_weight.shape[-1] // 2
        dx, dfilter, _ = torch.ops.aten.convolution_backward(
            dconv,
            x,
            conv_weight,
            None,
            [1, 1],
            [pad, pad],
            [1, 1],
            False,
            [0, 0],
            1,
            [ctx.needs_input_grad[0], ctx.needs_input_grad[1], False],
        )
        return dx, dfilter, dw, db, None, None, None, None, None, None, None


def conv_bn_act_pool(
    x,
    conv_weight,
    weight,
    bias,
    running_mean,
    running_var,
    training: bool,
    momentum: float = 0.1,
    eps: float = 1e-5,
    act: str = "relu",
    pool: str | None = None,
) -> torch.Tensor:
    """Functional form with autograd; same signature as ``conv_bn_act_pool_reference``."""
    return ConvBnActPoolFunction.apply(
        x, conv_weight, weight, bias, running_mean, running_var, training, momentum, eps, act, pool
    )


def fusable(block: torch.nn.Module) -> bool:
    """Whether ``block`` is a ConvBlock this kernel computes exactly: a stride-1, "same", odd square,
    ungrouped, undilated, bias-free conv, and the Triton normalize block, whose kernels the fused
    block runs (not the plain-torch one, not one with statistics per emulated rank, not the custom
    op of --compile)."""
    if not isinstance(block, ConvBlock):
        return False
    conv = block.conv
    k = conv.kernel_size
    return (
        type(block.norm) is TritonNormActPool
        and conv.bias is None
        and conv.groups == 1
        and k[0] == k[1]
        and k[0] % 2 == 1
        and conv.stride == (1, 1)
        and conv.dilation == (1, 1)
        and conv.padding == (k[0] // 2, k[0] // 2)
        and conv.padding_mode == "zeros"
    )


class TritonConvBlock(ConvBlock):
    """``ConvBlock`` computed by the fused kernels: its constructor, state and math, only ``forward``
    differs (``fusable`` says which blocks qualify)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = self.norm
        # as the library's conv, any layout in: a no-op for the blocks' own (channels-last) outputs,
        # a copy for a first conv's input in another layout (ResNet-9's on the images)
        x = x.contiguous(memory_format=torch.channels_last)
        return ConvBnActPoolFunction.apply(
            x,
            self.conv.weight,
            norm.weight,
            norm.bias,
            norm.running_mean,
            norm.running_var,
            norm.training,
            norm.step_momentum(),
            norm.eps,
            norm.act,
            norm.pool,
        )
