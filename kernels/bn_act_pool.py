"""Fused batchnorm + activation (+ 2x2 max-pool) on channels-last tensors, forward and backward.

Drop-in for ``fastcifar.models.blocks.NormActPool``: ``ResNet9(norm=TritonNormActPool)``. Same constructor,
same state (it subclasses ``nn.BatchNorm2d``), same math as ``fastcifar.ops.norm_act_pool.bn_act_pool_reference``.

Layout. An NCHW-shaped channels-last tensor is a (rows = N*H*W, C) matrix in memory with the channel
contiguous, so every kernel works on (BLOCK_R rows, BLOCK_C channels) tiles: a tile row is one pixel's
channel vector (64 fp16 channels = one 128-byte line). Per-channel reductions run down the rows.

Reductions are two-stage and deterministic (no atomics): stage 1 gives each of about 512 programs
(~4 per SM on a 132-SM H100) a contiguous chunk of rows and writes one partial per (chunk, channel)
-- (mean, M2) for the forward statistics, from sums shifted by a pivot; plain sums for the backward --
and a small stage-2 kernel combines the <= 512 x C fp32 partials, all loaded at once. Atomics would
save that launch but make results depend on the order programs finish, so two runs of training
would not be bit-identical. Stage 1 accumulates element-wise in registers and reduces across its
tile once, at the end: reducing every tile (shared memory and a barrier each time) and stage 2's
loop over the partials had left the statistics kernel at a quarter of the copy bandwidth where it
does not pool and stage 2 several times slower than it is now (bench/results/bn_sweep.md, the
per-kernel rows before and after "2026-11-23: the same sweep after the reductions moved to
registers").

Memory traffic, in units of the *pooled* activation P = N*C*(H/2)*(W/2) elements (a full map is 4P),
per training step, reads + writes, statistics and partial buffers excluded (they are O(C)):

=============  ======================================  =========================================
pool           forward                                 backward
=============  ======================================  =========================================
None (map=P)   stats read x (P); apply read x, write   reduce read x, dy (2P); dx read x, dy,
               y (2P): 3P                              write dx (3P): 5P
"after"        stats read x (4P); apply read x (4P),   reduce read x (4P), dy (P); dx read x,
               write y (P): 9P                         dy, write dx (9P): 14P
"before"       pool+stats read x (4P), write z (P)     reduce read z, dy (2P); dx read z, dy,
               and idx (0.5P); apply read z, write     idx (2.5P), write dx (4P): 8.5P
               y (2P): 7.5P
=============  ======================================  =========================================

What backward keeps. Never the normalized or activated values: xhat = (x - mean) * rstd and the
activation's input are recomputed from the saved input and the per-channel fp32 mean/rstd (two FMAs).
- pool None / "after": the BN input x (autograd would hold it anyway) + mean, rstd (2 x C fp32).
  For "after" the 2x2 argmax is recomputed from x, not stored: backward must read x anyway (every
  element gets a gradient through the batch mean/var), and an int8 index would cost 0.5P written plus
  0.5P read per backward pass while saving no reads of x.
- pool "before": the pooled map z (P) and an int8 argmax in 0..3 (0.5P) instead of x (4P): 1.5P
  held instead of 4P, and backward never touches x (it only scatters into dx).

Numerics. Activations are fp16/bf16/fp32 in and out; everything inside is fp32. The BN output and
the activation output are rounded to the I/O dtype where eager PyTorch would round them (the
activation's input, and the values the max-pool compares), so that the ReLU mask and the pool's
argmax (first maximum in row-major window order, as ``F.max_pool2d``) agree with eager fp16 exactly.
Odd maps follow ``F.max_pool2d(x, 2)``: the last row/column is dropped from the pool.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fastcifar.ops.norm_act_pool import ACTIVATIONS, POOL_PLACES, NormActPool

from .checks import check_activation

ACT_IDS = {"relu": 0, "gelu": 1, "celu": 2, "silu": 3}
MODE_IDS = {None: 0, "before": 1, "after": 2}

BLOCK_C_MAX = 64  # 64 fp16 channels = one 128-byte line per tile row


class Launch(NamedTuple):
    """How one block's kernels launch: elements per tile of the kernels that read one element per
    output (a tile row is BLOCK_C channels of one pixel), of those that work on 2x2 windows (the
    stats and dx of "before", the apply, reduction and dx of "after": 4 elements per row, so fewer
    rows), the warps per program, and the number of stage-1 reduction programs (split over the
    channel blocks)."""

    tile: int
    pool_tile: int
    warps: int
    programs: int


# By where the pool sits, from forward + backward timed as graph replays on an H100 at every preset
# block (bench/sweep_bn_act_pool.py; the rows of bench/results/bn_sweep.md and bn_sweep.jsonl).
# "before": window tiles of 2048 elements, the fastest of the settings swept, before and after the
# statistics moved to register accumulators. No pool and "after": (2048, 1024, 4, 512). Pool-after
# blocks had run 2 warps, faster with the old per-tile reductions and slower with the register
# accumulators; 512 or 1024 programs tie. 4096-element tiles were no faster with the new reductions,
# and the GELU backward reduction spilled on sm_80 with the old ones (tests forbid spills). 8 warps
# were slower everywhere.
LAUNCH = {None: Launch(2048, 1024, 4, 512), "before": Launch(2048, 2048, 4, 512), "after": Launch(2048, 1024, 4, 512)}
# Stage 2 loads all of a channel block's partials at once: chunks x channels <= FINALIZE_TILE fp32
# pairs (while chunks <= 4096; the table launches <= 512) over FINALIZE_WARPS warps, 16 pairs per
# thread (64 x 64 pairs over 4 warps, 32 per thread, spilled on sm_80)
FINALIZE_TILE = 4096
FINALIZE_WARPS = 8


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _act(v, ACT: tl.constexpr):
    if ACT == 0:
        out = tl.maximum(v, 0.0)
    elif ACT == 1:
        out = 0.5 * v * (1.0 + tl.math.erf(v * 0.7071067811865476))
    elif ACT == 2:
        out = tl.where(v > 0.0, v, tl.exp(v) - 1.0)
    else:
        out = v * tl.sigmoid(v)
    return out


@triton.jit
def _act_grad(v, ACT: tl.constexpr):
    if ACT == 0:
        d = tl.where(v > 0.0, 1.0, 0.0)
    elif ACT == 1:
        d = 0.5 * (1.0 + tl.math.erf(v * 0.7071067811865476)) + v * 0.3989422804014327 * tl.exp(-0.5 * v * v)
    elif ACT == 2:
        d = tl.where(v > 0.0, 1.0, tl.exp(v))
    else:  # silu' = s + v s (1 - s), s = sigmoid(v)
        s = tl.sigmoid(v)
        d = s * (1.0 + v * (1.0 - s))
    return d


@triton.jit
def _round_io(v, ptr):
    """Round fp32 ``v`` to the element type behind ``ptr`` and back (a no-op for fp32)."""
    return v.to(ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _bn_act_at(x_ptr, offs, mask, scale, shift, ACT: tl.constexpr):
    """Load x at ``offs``; return (x, activation input, activation output), rounded as eager does."""
    v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    pre = _round_io(v * scale + shift, x_ptr)
    a = _round_io(_act(pre, ACT), x_ptr)
    return v, pre, a


@triton.jit
def _argmax4(a0, a1, a2, a3):
    """First maximum of a 2x2 window in row-major order (ties go to the earlier element)."""
    best = a0
    idx = tl.zeros(a0.shape, tl.int32)
    u = a1 > best
    best = tl.where(u, a1, best)
    idx = tl.where(u, 1, idx)
    u = a2 > best
    best = tl.where(u, a2, best)
    idx = tl.where(u, 2, idx)
    u = a3 > best
    best = tl.where(u, a3, best)
    idx = tl.where(u, 3, idx)
    return best, idx


@triton.jit
def _window_base(rows, H, W, Hw, Ww):
    """Element offset (/C) of the top-left pixel of window ``rows`` on an (N, Hw, Ww) window grid."""
    ww = rows % Ww
    t = rows // Ww
    hw = t % Hw
    n = t // Hw
    return (n * H + 2 * hw) * W + 2 * ww, hw, ww


@triton.jit
def _stats_kernel(
    x_ptr,
    z_ptr,
    idx_ptr,
    pmean_ptr,
    pm2_ptr,
    R,
    C,
    H,
    W,
    Ho,
    Wo,
    rows_per_prog,
    POOL: tl.constexpr,
    STATS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Stage 1 of the batch statistics: the (mean, M2) partial of a chunk of rows.

    POOL: rows are 2x2 windows of x; the window max goes to z, its position (0..3) to idx, and the
    statistics are those of z. STATS=False only pools (eval mode).

    Sums of x - pivot and of its square accumulate element-wise in registers, one tile's worth, and
    are reduced across the tile once at the end: no cross-warp reduction (shared memory and a
    barrier) per tile, so a warp's next loads issue without waiting on the others. The pivot is a
    value of the chunk itself (its first row's, unpooled); for a pivot k standard deviations from the
    chunk's mean, M2 = S2 - S1^2/n carries a relative error of about fp32's 6e-8 x (1 + k^2), where
    unshifted sums lost 4% of the variance of channels at 1500 +- 4 in fp16 (the tests' case).
    """
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    start = pid_r * rows_per_prog
    end = tl.minimum(start + rows_per_prog, R)
    if POOL:
        first, _, _ = _window_base(start, H, W, Ho, Wo)
    else:
        first = start
    pivot = tl.load(x_ptr + first.to(tl.int64) * C + cols, mask=cmask, other=0.0).to(tl.float32)
    s1 = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    s2 = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        rmask = rows < end
        mask = rmask[:, None] & cmask[None, :]
        out_offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
        if POOL:
            base, hw, ww = _window_base(rows, H, W, Ho, Wo)
            offs = base.to(tl.int64)[:, None] * C + cols[None, :]
            v0 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            v1 = tl.load(x_ptr + offs + C, mask=mask, other=0.0).to(tl.float32)
            v2 = tl.load(x_ptr + offs + W * C, mask=mask, other=0.0).to(tl.float32)
            v3 = tl.load(x_ptr + offs + (W + 1) * C, mask=mask, other=0.0).to(tl.float32)
            v, idx = _argmax4(v0, v1, v2, v3)
            tl.store(z_ptr + out_offs, v.to(z_ptr.dtype.element_ty), mask=mask)
            tl.store(idx_ptr + out_offs, idx.to(tl.int8), mask=mask)
        else:
            v = tl.load(x_ptr + out_offs, mask=mask, other=0.0).to(tl.float32)
        if STATS:
            d = tl.where(mask, v - pivot[None, :], 0.0)
            s1 += d
            s2 += d * d
    if STATS:
        n = (end - start).to(tl.float32)
        t1 = tl.sum(s1, axis=0)
        t2 = tl.sum(s2, axis=0)
        tl.store(pmean_ptr + pid_r * C + cols, pivot + t1 / n, mask=cmask)
        tl.store(pm2_ptr + pid_r * C + cols, tl.maximum(t2 - t1 * t1 / n, 0.0), mask=cmask)


@triton.jit
def _stats_finalize_kernel(
    pmean_ptr,
    pm2_ptr,
    mean_ptr,
    rstd_ptr,
    rmean_ptr,
    rvar_ptr,
    R,
    C,
    rows_per_prog,
    num_chunks,
    momentum,
    eps,
    CHUNKS: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Stage 2: combine the chunk partials (mean = sum n_k m_k / R, M2 = sum M2_k + n_k (m_k - mean)^2),
    write mean and 1/sqrt(var + eps) (biased var), update the running stats (unbiased var).
    All CHUNKS (>= num_chunks, a power of 2) partials of BLOCK_C channels load at once: a loop over
    them waited one load latency per step (bench/results/bn_sweep.md, the stage-2 rows)."""
    pid_c = tl.program_id(0)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    ks = tl.arange(0, CHUNKS)
    kmask = ks < num_chunks
    nk = tl.where(kmask, tl.minimum(rows_per_prog, R - ks * rows_per_prog), 0).to(tl.float32)[:, None]
    mask = kmask[:, None] & cmask[None, :]
    offs = ks[:, None] * C + cols[None, :]
    m = tl.load(pmean_ptr + offs, mask=mask, other=0.0)
    q = tl.load(pm2_ptr + offs, mask=mask, other=0.0)
    total = R.to(tl.float32)
    mean = tl.sum(m * nk, axis=0) / total
    d = m - mean[None, :]
    m2 = tl.sum(q + nk * d * d, axis=0)
    tl.store(mean_ptr + cols, mean, mask=cmask)
    tl.store(rstd_ptr + cols, 1.0 / tl.sqrt(m2 / total + eps), mask=cmask)
    rm = tl.load(rmean_ptr + cols, mask=cmask, other=0.0)
    rv = tl.load(rvar_ptr + cols, mask=cmask, other=0.0)
    tl.store(rmean_ptr + cols, (1.0 - momentum) * rm + momentum * mean, mask=cmask)
    tl.store(rvar_ptr + cols, (1.0 - momentum) * rv + momentum * (m2 / (total - 1.0)), mask=cmask)


@triton.jit
def _apply_kernel(
    x_ptr,
    y_ptr,
    mean_ptr,
    rstd_ptr,
    w_ptr,
    b_ptr,
    R_out,
    C,
    H,
    W,
    Ho,
    Wo,
    ACT: tl.constexpr,
    POOL_AFTER: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """y = act(x * scale + shift), scale = w * rstd, shift = b - mean * scale; POOL_AFTER: then 2x2 max."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    mask = (rows < R_out)[:, None] & cmask[None, :]
    rstd = tl.load(rstd_ptr + cols, mask=cmask, other=0.0)
    scale = tl.load(w_ptr + cols, mask=cmask, other=0.0) * rstd
    shift = tl.load(b_ptr + cols, mask=cmask, other=0.0) - tl.load(mean_ptr + cols, mask=cmask, other=0.0) * scale
    scale = scale[None, :]
    shift = shift[None, :]
    out_offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
    if POOL_AFTER:
        base, hw, ww = _window_base(rows, H, W, Ho, Wo)
        offs = base.to(tl.int64)[:, None] * C + cols[None, :]
        _, _, a0 = _bn_act_at(x_ptr, offs, mask, scale, shift, ACT)
        _, _, a1 = _bn_act_at(x_ptr, offs + C, mask, scale, shift, ACT)
        _, _, a2 = _bn_act_at(x_ptr, offs + W * C, mask, scale, shift, ACT)
        _, _, a3 = _bn_act_at(x_ptr, offs + (W + 1) * C, mask, scale, shift, ACT)
        y, _ = _argmax4(a0, a1, a2, a3)
    else:
        _, _, y = _bn_act_at(x_ptr, out_offs, mask, scale, shift, ACT)
    tl.store(y_ptr + out_offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_reduce_kernel(
    x_ptr,
    dy_ptr,
    mean_ptr,
    rstd_ptr,
    w_ptr,
    b_ptr,
    psum_g_ptr,
    psum_gx_ptr,
    R,
    C,
    H,
    W,
    Ho,
    Wo,
    rows_per_prog,
    ACT: tl.constexpr,
    POOL_AFTER: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Stage 1 of backward: per-chunk sums of g = dy * act'(pre) and g * xhat (db and dw partials).

    Rows are rows of dy: BN-input rows, or (POOL_AFTER) 2x2 windows of x whose argmax is recomputed.
    """
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    mean = tl.load(mean_ptr + cols, mask=cmask, other=0.0)[None, :]
    rstd = tl.load(rstd_ptr + cols, mask=cmask, other=0.0)[None, :]
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0)[None, :]
    scale = w * rstd
    shift = tl.load(b_ptr + cols, mask=cmask, other=0.0)[None, :] - mean * scale
    start = pid_r * rows_per_prog
    end = tl.minimum(start + rows_per_prog, R)
    acc_g = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)  # element-wise, reduced once at the end (as stats)
    acc_gx = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        mask = (rows < end)[:, None] & cmask[None, :]
        dy_offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
        dy = tl.load(dy_ptr + dy_offs, mask=mask, other=0.0).to(tl.float32)
        if POOL_AFTER:
            base, hw, ww = _window_base(rows, H, W, Ho, Wo)
            offs = base.to(tl.int64)[:, None] * C + cols[None, :]
            v0, p0, a0 = _bn_act_at(x_ptr, offs, mask, scale, shift, ACT)
            v1, p1, a1 = _bn_act_at(x_ptr, offs + C, mask, scale, shift, ACT)
            v2, p2, a2 = _bn_act_at(x_ptr, offs + W * C, mask, scale, shift, ACT)
            v3, p3, a3 = _bn_act_at(x_ptr, offs + (W + 1) * C, mask, scale, shift, ACT)
            _, k = _argmax4(a0, a1, a2, a3)
            v = tl.where(k == 0, v0, tl.where(k == 1, v1, tl.where(k == 2, v2, v3)))
            pre = tl.where(k == 0, p0, tl.where(k == 1, p1, tl.where(k == 2, p2, p3)))
        else:
            v, pre, _ = _bn_act_at(x_ptr, dy_offs, mask, scale, shift, ACT)
        g = tl.where(mask, dy * _act_grad(pre, ACT), 0.0)
        acc_g += g
        acc_gx += g * ((v - mean) * rstd)
    tl.store(psum_g_ptr + pid_r * C + cols, tl.sum(acc_g, axis=0), mask=cmask)
    tl.store(psum_gx_ptr + pid_r * C + cols, tl.sum(acc_gx, axis=0), mask=cmask)


@triton.jit
def _bwd_finalize_kernel(
    psum_g_ptr, psum_gx_ptr, db_ptr, dw_ptr, C, num_chunks, CHUNKS: tl.constexpr, BLOCK_C: tl.constexpr
):
    """Stage 2 of backward: db = sum g, dw = sum g * xhat over all chunks, loaded at once (as the
    forward's stage 2)."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    ks = tl.arange(0, CHUNKS)
    mask = (ks < num_chunks)[:, None] & cmask[None, :]
    offs = ks[:, None] * C + cols[None, :]
    tl.store(db_ptr + cols, tl.sum(tl.load(psum_g_ptr + offs, mask=mask, other=0.0), axis=0), mask=cmask)
    tl.store(dw_ptr + cols, tl.sum(tl.load(psum_gx_ptr + offs, mask=mask, other=0.0), axis=0), mask=cmask)


@triton.jit
def _dx_value(v, pre, g_on, dy, mean, rstd, coef, c1, c2, ACT: tl.constexpr):
    """dx = w * rstd * (g - db/M - xhat * dw/M), g = dy * act'(pre) where ``g_on`` else 0."""
    g = tl.where(g_on, dy * _act_grad(pre, ACT), 0.0)
    return coef * (g - c1 - (v - mean) * rstd * c2)


@triton.jit
def _bwd_dx_kernel(
    x_ptr,
    dy_ptr,
    idx_ptr,
    dx_ptr,
    mean_ptr,
    rstd_ptr,
    w_ptr,
    b_ptr,
    db_ptr,
    dw_ptr,
    R,
    C,
    H,
    W,
    Ho,
    Wo,
    Hw,
    Ww,
    inv_count,
    ACT: tl.constexpr,
    MODE: tl.constexpr,
    TRAINING: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Input gradient. MODE 0: rows of x. MODE 1 (pool before) and 2 (pool after): rows are 2x2 windows
    on a ceil(H/2) x ceil(W/2) grid, so the row/column a floor-mode pool drops is written too.
    MODE 1: x_ptr is the pooled z, idx the saved argmax; dx is dz at the argmax, 0 elsewhere.
    MODE 2: x_ptr is x; every element gets the mean/var terms, the recomputed argmax also g."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    rmask = rows < R
    mask = rmask[:, None] & cmask[None, :]
    mean = tl.load(mean_ptr + cols, mask=cmask, other=0.0)[None, :]
    rstd = tl.load(rstd_ptr + cols, mask=cmask, other=0.0)[None, :]
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0)[None, :]
    scale = w * rstd
    shift = tl.load(b_ptr + cols, mask=cmask, other=0.0)[None, :] - mean * scale
    coef = scale
    if TRAINING:
        c1 = tl.load(db_ptr + cols, mask=cmask, other=0.0)[None, :] * inv_count
        c2 = tl.load(dw_ptr + cols, mask=cmask, other=0.0)[None, :] * inv_count
    else:  # running stats are constants: no gradient through the mean and variance
        c1 = tl.zeros([1, BLOCK_C], tl.float32)
        c2 = tl.zeros([1, BLOCK_C], tl.float32)
    if MODE == 0:
        offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        v, pre, _ = _bn_act_at(x_ptr, offs, mask, scale, shift, ACT)
        dx = _dx_value(v, pre, mask, dy, mean, rstd, coef, c1, c2, ACT)
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    else:
        base, hw, ww = _window_base(rows, H, W, Hw, Ww)
        offs = base.to(tl.int64)[:, None] * C + cols[None, :]
        in_w1 = (2 * ww + 1 < W)[:, None]
        in_h1 = (2 * hw + 1 < H)[:, None]
        valid = ((hw < Ho) & (ww < Wo))[:, None] & mask  # window has a pooled output
        prow = ((rows // (Hw * Ww)) * Ho + hw) * Wo + ww
        p_offs = prow.to(tl.int64)[:, None] * C + cols[None, :]
        dy = tl.load(dy_ptr + p_offs, mask=valid, other=0.0).to(tl.float32)
        if MODE == 1:
            v, pre, _ = _bn_act_at(x_ptr, p_offs, valid, scale, shift, ACT)
            dz = _dx_value(v, pre, valid, dy, mean, rstd, coef, c1, c2, ACT)
            k = tl.load(idx_ptr + p_offs, mask=valid, other=-1).to(tl.int32)
            zero = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
            tl.store(dx_ptr + offs, tl.where(valid & (k == 0), dz, zero).to(dx_ptr.dtype.element_ty), mask=mask)
            tl.store(
                dx_ptr + offs + C, tl.where(valid & (k == 1), dz, zero).to(dx_ptr.dtype.element_ty), mask=mask & in_w1
            )
            tl.store(
                dx_ptr + offs + W * C,
                tl.where(valid & (k == 2), dz, zero).to(dx_ptr.dtype.element_ty),
                mask=mask & in_h1,
            )
            tl.store(
                dx_ptr + offs + (W + 1) * C,
                tl.where(valid & (k == 3), dz, zero).to(dx_ptr.dtype.element_ty),
                mask=mask & in_w1 & in_h1,
            )
        else:
            v0, p0, a0 = _bn_act_at(x_ptr, offs, mask, scale, shift, ACT)
            v1, p1, a1 = _bn_act_at(x_ptr, offs + C, mask & in_w1, scale, shift, ACT)
            v2, p2, a2 = _bn_act_at(x_ptr, offs + W * C, mask & in_h1, scale, shift, ACT)
            v3, p3, a3 = _bn_act_at(x_ptr, offs + (W + 1) * C, mask & in_w1 & in_h1, scale, shift, ACT)
            _, k = _argmax4(a0, a1, a2, a3)
            d0 = _dx_value(v0, p0, valid & (k == 0), dy, mean, rstd, coef, c1, c2, ACT)
            d1 = _dx_value(v1, p1, valid & (k == 1), dy, mean, rstd, coef, c1, c2, ACT)
            d2 = _dx_value(v2, p2, valid & (k == 2), dy, mean, rstd, coef, c1, c2, ACT)
            d3 = _dx_value(v3, p3, valid & (k == 3), dy, mean, rstd, coef, c1, c2, ACT)
            tl.store(dx_ptr + offs, d0.to(dx_ptr.dtype.element_ty), mask=mask)
            tl.store(dx_ptr + offs + C, d1.to(dx_ptr.dtype.element_ty), mask=mask & in_w1)
            tl.store(dx_ptr + offs + W * C, d2.to(dx_ptr.dtype.element_ty), mask=mask & in_h1)
            tl.store(dx_ptr + offs + (W + 1) * C, d3.to(dx_ptr.dtype.element_ty), mask=mask & in_w1 & in_h1)


# ----------------------------------------------------------------------------------------------
# Launchers: check shape / dtype / layout, pick block sizes, allocate, launch
# ----------------------------------------------------------------------------------------------


def _empty(shape, dtype, device, channels_last: bool = False) -> torch.Tensor:
    """Every buffer the launchers allocate comes from here (tests replace it with NaN-filled ones)."""
    if channels_last:
        return torch.empty(shape, dtype=dtype, device=device, memory_format=torch.channels_last)
    return torch.empty(shape, dtype=dtype, device=device)


def _check_channel_vector(t: torch.Tensor | None, name: str, c: int, device) -> None:
    if t is None:
        raise ValueError(f"{name} is required (affine batchnorm with running statistics)")
    if t.shape != (c,) or t.dtype != torch.float32 or not t.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous fp32 tensor of shape ({c},), got "
            f"{t.dtype} {tuple(t.shape)} strides {t.stride()}"
        )
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the activations on {device}")


def _tiling(c: int, pool: str | None):
    """A block's launch geometry from its ``LAUNCH`` entry: rows per tile of the one-element and of
    the 2x2-window kernels, channels per tile, channel blocks, warps and stage-1 programs."""
    launch = LAUNCH[pool]
    block_c = min(BLOCK_C_MAX, triton.next_power_of_2(c))
    return (
        max(1, launch.tile // block_c),
        max(1, launch.pool_tile // block_c),
        block_c,
        triton.cdiv(c, block_c),
        launch.warps,
        launch.programs,
    )


def _chunking(rows: int, c_blocks: int, block_r: int, programs: int):
    """Rows per stage-1 program (a multiple of block_r) and the number of chunks."""
    wanted = max(1, programs // c_blocks)
    rows_per_prog = triton.cdiv(triton.cdiv(rows, wanted), block_r) * block_r
    return rows_per_prog, triton.cdiv(rows, rows_per_prog)


def _finalize_tiling(chunks: int, c: int):
    """Stage 2's partials per program (a power of 2 >= chunks), its channels per program, programs."""
    chunks_p2 = triton.next_power_of_2(chunks)
    block_c = max(1, min(BLOCK_C_MAX, triton.next_power_of_2(c), FINALIZE_TILE // chunks_p2))
    return chunks_p2, block_c, triton.cdiv(c, block_c)


def _check_args(act, pool):
    if act not in ACT_IDS:
        raise ValueError(f"unknown activation {act!r}; choose from {ACTIVATIONS}")
    if pool not in MODE_IDS:
        raise ValueError(f"pool must be one of {POOL_PLACES}, not {pool!r}")


def bn_act_pool_forward(
    x,
    weight,
    bias,
    running_mean,
    running_var,
    training: bool,
    momentum: float,
    eps: float,
    act: str = "relu",
    pool: str | None = None,
):
    """Forward launcher. Returns (y, saved) with saved = (src, idx, mean, rstd) for the backward
    launcher: src is x (pool None/"after") or the pooled z ("before"), idx the int8 argmax or None.
    In training mode it updates running_mean/running_var in place (momentum as F.batch_norm's)."""
    _check_args(act, pool)
    check_activation(x)
    n, c, h, w = x.shape  # weight, bias and the running statistics: checked by normalize_partials
    if pool is not None and (h < 2 or w < 2):
        raise ValueError(f"2x2 max-pool needs maps of at least 2x2, got {h}x{w}")
    ho, wo = (h // 2, w // 2) if pool else (h, w)
    dev = x.device
    block_r, pblock_r, block_c, c_blocks, warps, programs = _tiling(c, pool)

    src, idx = x, None
    if pool == "before":  # pool first: 4x fewer elements normalized; z and idx are all backward needs
        src = _empty((n, c, ho, wo), x.dtype, dev, channels_last=True)
        idx = _empty((n, c, ho, wo), torch.int8, dev, channels_last=True)
    bn_rows = src.numel() // c
    partials = None
    if training:
        if bn_rows < 2:
            raise ValueError(
                f"expected more than 1 value per channel when training, got input of shape {tuple(x.shape)}"
            )
        br = pblock_r if pool == "before" else block_r
        rows_per_prog, chunks = _chunking(bn_rows, c_blocks, br, programs)
        pmean = _empty((chunks, c), torch.float32, dev)
        pm2 = _empty((chunks, c), torch.float32, dev)
        _stats_kernel[(chunks, c_blocks)](
            x,
            src,
            idx,
            pmean,
            pm2,
            bn_rows,
            c,
            h,
            w,
            ho,
            wo,
            rows_per_prog,
            POOL=pool == "before",
            STATS=True,
            BLOCK_R=br,
            BLOCK_C=block_c,
            num_warps=warps,
        )
        partials = Partials(pmean, pm2, rows_per_prog)
    elif pool == "before":
        rows_per_prog, chunks = _chunking(bn_rows, c_blocks, pblock_r, programs)
        _stats_kernel[(chunks, c_blocks)](
            x,
            src,
            idx,
            src,
            src,
            bn_rows,
            c,
            h,
            w,
            ho,
            wo,
            rows_per_prog,
            POOL=True,
            STATS=False,
            BLOCK_R=pblock_r,
            BLOCK_C=block_c,
            num_warps=warps,
        )
    return normalize_partials(
        src, idx, partials, (n, c, h, w), weight, bias, running_mean, running_var, momentum, eps, act, pool
    )


class Partials(NamedTuple):
    """Stage 1's output, the batch statistics in (chunk, channel) pieces: each chunk's mean and M2
    (sum of squared deviations from its mean) over ``rows_per_prog`` consecutive rows of the map the
    batchnorm normalizes (the last chunk: what is left). ``_stats_kernel`` writes them, and so does
    a producer of that map that sees its values anyway (``kernels/conv_stats.py``, the conv)."""

    pmean: torch.Tensor
    pm2: torch.Tensor
    rows_per_prog: int


def normalize_partials(
    src,
    idx,
    partials: Partials | None,
    x_shape,
    weight,
    bias,
    running_mean,
    running_var,
    momentum: float,
    eps: float,
    act: str = "relu",
    pool: str | None = None,
):
    """Stage 2 and the apply, from stage 1's ``partials`` (training) or the running statistics
    (``partials`` None: eval mode). ``src``: the map the batchnorm normalizes (x, or for "before" the
    pooled z with its int8 argmax ``idx``), channels-last; ``x_shape``: the block's input shape.
    Returns (y, saved) as ``bn_act_pool_forward``."""
    _check_args(act, pool)
    check_activation(src, "src")
    n, c, h, w = x_shape
    ho, wo = (h // 2, w // 2) if pool else (h, w)
    expected = (n, c, ho, wo) if pool == "before" else (n, c, h, w)
    if tuple(src.shape) != expected:
        raise ValueError(
            f"src must have shape {expected} for pool={pool!r} on input {tuple(x_shape)}, got {tuple(src.shape)}"
        )
    dev = src.device
    for name, t in (("weight", weight), ("bias", bias), ("running_mean", running_mean), ("running_var", running_var)):
        _check_channel_vector(t, name, c, dev)
    block_r, pblock_r, block_c, c_blocks, warps, _ = _tiling(c, pool)
    bn_rows = src.numel() // c
    mean = _empty((c,), torch.float32, dev)
    rstd = _empty((c,), torch.float32, dev)
    if partials is not None:
        chunks = partials.pmean.shape[0]
        if (
            partials.pmean.shape != (chunks, c)
            or partials.pm2.shape != (chunks, c)
            or chunks != triton.cdiv(bn_rows, partials.rows_per_prog)
        ):
            raise ValueError(
                f"partials of shape {tuple(partials.pmean.shape)}/{tuple(partials.pm2.shape)} do not "
                f"cover {bn_rows} rows of {c} channels in chunks of {partials.rows_per_prog}"
            )
        chunks_p2, fin_c, fin_programs = _finalize_tiling(chunks, c)
        _stats_finalize_kernel[(fin_programs,)](
            partials.pmean,
            partials.pm2,
            mean,
            rstd,
            running_mean,
            running_var,
            bn_rows,
            c,
            partials.rows_per_prog,
            chunks,
            float(momentum),
            float(eps),
            CHUNKS=chunks_p2,
            BLOCK_C=fin_c,
            num_warps=FINALIZE_WARPS,
        )
    else:
        mean.copy_(running_mean)  # a copy: backward must see the statistics this forward used
        torch.rsqrt(running_var + eps, out=rstd)

    y = _empty((n, c, ho, wo), src.dtype, dev, channels_last=True)
    out_rows = n * ho * wo
    pool_after = pool == "after"  # the 2x2-window kernel, with its own rows per tile
    rows = pblock_r if pool_after else block_r
    _apply_kernel[(triton.cdiv(out_rows, rows), c_blocks)](
        src,
        y,
        mean,
        rstd,
        weight,
        bias,
        out_rows,
        c,
        h,
        w,
        ho,
        wo,
        ACT=ACT_IDS[act],
        POOL_AFTER=pool_after,
        BLOCK_R=rows,
        BLOCK_C=block_c,
        num_warps=warps,
    )
    return y, (src, idx, mean, rstd)


def bn_act_pool_backward(dy, saved, weight, bias, x_shape, training: bool, act: str = "relu", pool: str | None = None):
    """Backward launcher: (dx, dweight, dbias) from dy and the forward's ``saved``."""
    _check_args(act, pool)
    src, idx, mean, rstd = saved
    n, c, h, w = x_shape
    ho, wo = (h // 2, w // 2) if pool else (h, w)
    if tuple(dy.shape) != (n, c, ho, wo):
        raise ValueError(f"dy must have shape {(n, c, ho, wo)}, got {tuple(dy.shape)}")
    if dy.dtype != src.dtype:
        raise TypeError(f"dy must be {src.dtype} like the forward's input, got {dy.dtype}")
    check_activation(dy, "dy")
    check_activation(src, "saved input")
    dev = dy.device
    block_r, pblock_r, block_c, c_blocks, warps, programs = _tiling(c, pool)

    dy_rows = n * ho * wo
    br = pblock_r if pool == "after" else block_r
    rows_per_prog, chunks = _chunking(dy_rows, c_blocks, br, programs)
    psum_g = _empty((chunks, c), torch.float32, dev)
    psum_gx = _empty((chunks, c), torch.float32, dev)
    _bwd_reduce_kernel[(chunks, c_blocks)](
        src,
        dy,
        mean,
        rstd,
        weight,
        bias,
        psum_g,
        psum_gx,
        dy_rows,
        c,
        h,
        w,
        ho,
        wo,
        rows_per_prog,
        ACT=ACT_IDS[act],
        POOL_AFTER=pool == "after",
        BLOCK_R=br,
        BLOCK_C=block_c,
        num_warps=warps,
    )
    db = _empty((c,), torch.float32, dev)
    dw = _empty((c,), torch.float32, dev)
    chunks_p2, fin_c, fin_programs = _finalize_tiling(chunks, c)
    _bwd_finalize_kernel[(fin_programs,)](
        psum_g, psum_gx, db, dw, c, chunks, CHUNKS=chunks_p2, BLOCK_C=fin_c, num_warps=FINALIZE_WARPS
    )

    dx = _empty((n, c, h, w), dy.dtype, dev, channels_last=True)
    bn_count = src.numel() // c  # elements per channel the statistics were taken over
    if pool is None:
        rows, br = n * h * w, block_r
    else:
        rows, br = n * triton.cdiv(h, 2) * triton.cdiv(w, 2), pblock_r
    _bwd_dx_kernel[(triton.cdiv(rows, br), c_blocks)](
        src,
        dy,
        idx if idx is not None else src,
        dx,
        mean,
        rstd,
        weight,
        bias,
        db,
        dw,
        rows,
        c,
        h,
        w,
        ho,
        wo,
        triton.cdiv(h, 2),
        triton.cdiv(w, 2),
        1.0 / bn_count,
        ACT=ACT_IDS[act],
        MODE=MODE_IDS[pool],
        TRAINING=training,
        BLOCK_R=br,
        BLOCK_C=block_c,
        num_warps=warps,
    )
    return dx, dw, db


# ----------------------------------------------------------------------------------------------
# autograd.Function and module
# ----------------------------------------------------------------------------------------------


class BnActPoolFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, training, momentum, eps, act, pool):
        y, (src, idx, mean, rstd) = bn_act_pool_forward(
            x, weight, bias, running_mean, running_var, training, momentum, eps, act, pool
        )
        ctx.save_for_backward(src, idx, mean, rstd, weight, bias)
        ctx.cfg = (tuple(x.shape), training, act, pool)
        return y

    @staticmethod
    def backward(ctx, dy):
        src, idx, mean, rstd, weight, bias = ctx.saved_tensors
        x_shape, training, act, pool = ctx.cfg
        # a no-op for the model's channels-last gradients; copies only a foreign layout (e.g. the
        # expanded gradient of a test's .sum())
        dy = dy.contiguous(memory_format=torch.channels_last)
        dx, dw, db = bn_act_pool_backward(dy, (src, idx, mean, rstd), weight, bias, x_shape, training, act, pool)
        return dx, dw, db, None, None, None, None, None, None, None


def bn_act_pool(
    x,
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
    """Functional form with autograd; same signature as ``bn_act_pool_reference``."""
    return BnActPoolFunction.apply(x, weight, bias, running_mean, running_var, training, momentum, eps, act, pool)


class TritonNormActPool(NormActPool):
    """``NormActPool`` computed by the fused Triton kernels: its constructor, state and math, only
    ``normalize`` differs."""

    def normalize(
        self, x: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor, momentum: float
    ) -> torch.Tensor:
        return BnActPoolFunction.apply(
            x, self.weight, self.bias, running_mean, running_var, self.training, momentum, self.eps, self.act, self.pool
        )
