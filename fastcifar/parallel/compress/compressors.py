"""Gradient compressors: ``compress(x) -> (payload, ctx)`` and ``decompress(payload, ctx) -> x_hat``.

Every compressor takes a flat fp32 vector (one chunk: a layer, a bucket or the whole model, see
``scope``) and returns a list of tensors to send plus a context that stays on this rank. ``kind``
names the transport the payload needs:

- ``"sum"``: payloads of all ranks add up to the payload of the sum (casts, RandomK with
  coordinates shared by all ranks, PowerSGD's P and Q); they go through one all-reduce. These
  compressors scale by 1/world_size *before* the sum, in fp32 before any cast (an fp16 payload
  cannot overflow that way; fastcifar.parallel.comm's plain path sums first, then divides), so
  ``decompress`` of the summed payload is the mean.
- ``"gather"``: each rank's payload holds its own indices or scales; all ranks' payloads are
  all-gathered and each is added into the mean on its own (``accumulate``: sparse ones at their
  own coordinates; TopK, Threshold, per-rank RandomK, TernGrad, QSGD).
  ``fixed_size`` is False for Threshold, whose payload length depends on the data.

Randomness comes from ``rng.CounterRNG`` objects the caller owns (``rng``: this rank's own
stream; ``shared``: the same numbers on every rank), drawn per chunk ``key`` with device ops
only (never ``randperm`` or host values), so fixed-size methods keep the shapes and ops of a
CUDA-graph capture the same at every step.
"""

from __future__ import annotations

import math

import torch

from fastcifar.core.config import CHOICES


class Compressor:
    name = "base"
    kind = "gather"
    fixed_size = True
    rounds = 1  # PowerSGD needs two collectives in a row
    unbiased = False  # E[decompress(compress(x))] = x with variance above |x|^2 for small payloads

    def compress(
        self, x: torch.Tensor, world_size: int = 1, rng=None, shared=None, key: int = 0, rows: int | None = None
    ):
        raise NotImplementedError

    def decompress(self, payload: list, ctx) -> torch.Tensor:
        raise NotImplementedError

    def accumulate(self, out: torch.Tensor, payload: list, ctx, n: int) -> None:
        """``out += decompress(payload, ctx) / n``: one rank's share of the gather transport's mean;
        with n = -1, ``out - decompress(payload, ctx)`` exactly (x / -1 is -x), error feedback's
        residual. Sparse payloads override it to touch their own coordinates alone."""
        out.add_(self.decompress(payload, ctx) / n)

    def reset(self, shared) -> None:
        """State carried across steps back to the first step's (``shared`` already reset to step 0):
        none here; PowerSGD's warm-start Q."""

    def describe(self) -> str:
        return self.name


class Identity(Compressor):
    """fp32 through the compression machinery: the reference every other method is compared with."""

    name, kind = "fp32", "sum"

    def compress(self, x, world_size=1, rng=None, shared=None, key=0, rows=None):
        return [x / world_size], x.numel()

    def decompress(self, payload, ctx):
        return payload[0]


class Cast(Compressor):
    """fp16 or bf16 on the wire (2x fewer bytes than fp32): DDP's fp16/bf16 compression hooks."""

    kind = "sum"

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]

    def compress(self, x, world_size=1, rng=None, shared=None, key=0, rows=None):
        return [(x / world_size).to(self.dtype)], x.numel()

    def decompress(self, payload, ctx):
        return payload[0].float()


def _add_at(out: torch.Tensor, idx: torch.Tensor, values: torch.Tensor, n: int) -> None:
    """``out[idx] += values / n``, ``idx`` without repeats (one rank's payload: each address is added
    once, so the GPU's atomic adds are deterministic here): k reads and writes where decompressing
    first costs a d-long zero fill, scatter, division and add (4 passes over the chunk per rank:
    more than ten times slower for 8 ranks' TopK at K = 1%, d = 2M on one CPU thread: the
    compress_ms rows of bench/results/compress.jsonl; a gather-add-scatter ``index_put_`` sat between
    the two). The same sums, bit for bit,
    but for the sign of a zero (a coordinate every rank sends as -0 comes out +0)."""
    out.index_add_(0, idx, values / n)


def _keep(ratio: float, d: int) -> int:
    """ceil(ratio x d), at least 1 and at most d."""
    return min(d, max(1, math.ceil(ratio * d - 1e-9)))  # 1e-9: 0.3 x 10 is 3.0000000000000004


class TopK(Compressor):
    """The ceil(K x d) largest |x_i| as fp32 values + int32 indices (8 bytes per kept coordinate)."""

    name = "topk"

    def __init__(self, ratio: float):
        self.ratio = ratio

    def compress(self, x, world_size=1, rng=None, shared=None, key=0, rows=None):
        k = _keep(self.ratio, x.numel())
        idx = x.abs().topk(k, sorted=False).indices
        return [x[idx], idx.to(torch.int32)], x.numel()

    def decompress(self, payload, ctx):
        values, idx = payload
        out = torch.zeros(ctx, dtype=values.dtype, device=values.device)
        return out.index_put_((idx.long(),), values)

    def accumulate(self, out, payload, ctx, n):
        values, idx = payload
        _add_at(out, idx.long(), values, n)

    def describe(self):
        return f"topk(K={self.ratio:g})"


class RandomK(Compressor):
    """k = ceil(K x d) coordinates chosen uniformly without replacement (the k largest of d uniform
    keys). ``shared=True``: every rank draws the same coordinates from the shared generator, so the
    values alone sum through an all-reduce; else each rank draws its own and sends values + int32
    indices through all-gather. ``unbiased``: values x d/k (= 1/K when K x d is whole), so
    E[x_hat] = x; the seed's biased form sends them unscaled."""

    name = "randomk"

    def __init__(self, ratio: float, unbiased: bool = True, shared: bool = True):
        self.ratio, self.unbiased, self.shared = ratio, unbiased and ratio < 1, shared
        self.kind = "sum" if shared else "gather"

    def compress(self, x, world_size=1, rng=None, shared=None, key=0, rows=None):
        d = x.numel()
        k = _keep(self.ratio, d)
        keys = (shared if self.shared else rng).uniform(d, key)
        idx = keys.topk(k, sorted=False).indices
        values = x[idx] * (d / k) if self.unbiased else x[idx]
        if self.shared:
            return [values / world_size], (d, idx)
        return [values, idx.to(torch.int32)], (d, None)

    def decompress(self, payload, ctx):
        d, idx = ctx
        values = payload[0]
        idx = idx if idx is not None else payload[1].long()
        return torch.zeros(d, dtype=values.dtype, device=values.device).index_put_((idx,), values)

    def accumulate(self, out, payload, ctx, n):
        _add_at(out, ctx[1] if ctx[1] is not None else payload[1].long(), payload[0], n)

    def describe(self):
        return (
            f"randomk(K={self.ratio:g}, {'unbiased' if self.unbiased else 'biased'}, "
            f"{'shared' if self.shared else 'per-rank'} coordinates)"
        )


class Threshold(Compressor):
    """Every coordinate with |x_i| >= V, as fp32 values + int32 indices; the count varies per step,
    so the transport gathers the counts first and pads to the largest."""

    name, fixed_size = "threshold", False

    def __init__(self, threshold: float):
        self.threshold = threshold

    def compress(self, x, world_size=1, rng=None, shared=None, key=0, rows=None):
        idx = (x.abs() >= self.threshold).nonzero().flatten()
        return [x[idx], idx.to(torch.int32)], x.numel()

    decompress, accumulate = TopK.decompress, TopK.accumulate

    def describe(self):
        return f"threshold(V={self.threshold:g})"


def _stochastic_round(r: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """floor(r) + Bernoulli(r - floor(r)) with ``u`` uniform in [0, 1): an integer whose mean is r."""
    low = r.floor()
    return low + (u < (r - low)).to(r.dtype)


class TernGrad(Compressor):
    """s = max|x|, x_i -> s x sign(x_i) x Bernoulli(|x_i| / s): int8 levels in {-1, 0, 1} and one
    fp32 scale (1 byte per coordinate). ``clip``: first clip x to +-2.5 standard deviations (then
    the scale is the clipped max; biased, lower variance, as the TernGrad paper does)."""

    name, unbiased = "terngrad", True

    def __init__(self, clip: bool = False):
        self.clip = clip

    def compress(self, x, world_size=1, rng=None, shared=None, key=0, rows=None):
        if self.clip:
            bound = 2.5 * x.std()
            x = torch.maximum(torch.minimum(x, bound), -bound)
        s = x.abs().amax().reshape(1)
        prob = x.abs() / torch.where(s > 0, s, torch.ones_like(s))  # all-zero x: all levels 0
        keep = rng.uniform(x.numel(), key) < prob
        levels = (x.sign() * keep).to(torch.int8)
        return [levels, s], x.numel()

    def decompress(self, payload, ctx):
        levels, s = payload
        return levels.float() * s

    def describe(self):
        return "terngrad" + (" (2.5 sigma clip)" if self.clip else "")


class QSGD(Compressor):
    """s levels: x_i -> ||x||_2 x sign(x_i) x xi_i / s, xi_i the stochastic rounding of
    s |x_i| / ||x||_2 (an integer in 0..s); levels as int8 (s <= 127) or int16, and one fp32 norm
    per chunk."""

    name, unbiased = "qsgd", True

    def __init__(self, levels: int):
        if not 1 <= levels <= 32767:
            raise ValueError(f"QSGD needs 1..32767 levels, not {levels}")
        self.levels = levels
        self.level_dtype = torch.int8 if levels <= 127 else torch.int16

    def compress(self, x, world_size=1, rng=None, shared=None, key=0, rows=None):
        norm = x.norm().reshape(1)
        r = self.levels * x.abs() / torch.where(norm > 0, norm, torch.ones_like(norm))
        xi = _stochastic_round(r, rng.uniform(x.numel(), key))
        return [(x.sign() * xi).to(self.level_dtype), norm], x.numel()

    def decompress(self, payload, ctx):
        levels, norm = payload
        return levels.float() * (norm / self.levels)

    def describe(self):
        return f"qsgd(s={self.levels})"


def _orthonormalize(m: torch.Tensor) -> torch.Tensor:
    """Columns of m made orthonormal (Gram-Schmidt, as PowerSGD does; r is small)."""
    cols = []
    for i in range(m.shape[1]):
        c = m[:, i]
        for q in cols:
            c = c - (q @ c) * q
        cols.append(c / (c.norm() + 1e-8))  # 1e-8: a zero column stays finite
    return torch.stack(cols, dim=1)


class PowerSGD(Compressor):
    """Rank-r approximation M ~ P Q^T of a chunk seen as a matrix (``shape``: rows x cols; a flat
    chunk is padded to a near-square one). One power iteration per step, warm-started from the last
    step's Q: P = M Q, all-reduce P, orthonormalize, Q = M^T P, all-reduce Q. Both sums are means
    (1/world_size before the sum), so P Q^T is the rank-r approximation of the mean gradient.
    Error feedback is part of the method (the trainer turns it on): the residual is M minus that
    approximation. Sends r x (rows + cols) numbers instead of rows x cols; a chunk where that does
    not save anything is sent whole (the ``dense`` flag in the context)."""

    name, kind, rounds = "powersgd", "sum", 2

    def __init__(self, rank: int):
        self.rank = rank
        self.q: dict = {}  # chunk key -> warm-start Q (the same on every rank: it is a mean)

    @staticmethod
    def matrix_shape(d: int, rows: int | None = None) -> tuple[int, int]:
        if rows and d % rows == 0:
            return rows, d // rows
        cols = math.ceil(math.sqrt(d))
        return math.ceil(d / cols), cols

    def compress(self, x, world_size=1, rng=None, shared=None, key=0, rows=None):
        d = x.numel()
        n, m = self.matrix_shape(d, rows)
        r = min(self.rank, n, m)
        if r * (n + m) >= d:
            return [x / world_size], (d, None, None, True)
        mat = torch.nn.functional.pad(x, (0, n * m - d)).reshape(n, m)
        q = self.q.get(key)
        if q is None or q.shape != (m, r):
            q = self.q[key] = self._initial_q(shared, m, r, key)
        p = mat @ q
        return [p / world_size], (d, mat, key, False)

    def next_round(self, summed: list, ctx, world_size: int = 1) -> list:
        d, mat, key, dense = ctx
        if dense:
            return []
        p = _orthonormalize(summed[0])
        summed[0].copy_(p)  # decompress reads the orthonormal P
        return [mat.t() @ p / world_size]

    @staticmethod
    def _initial_q(shared, m: int, r: int, key: int) -> torch.Tensor:
        return _orthonormalize(shared.normal(m * r, key).reshape(m, r))  # shared: alike on every rank

    def finish_round(self, second: list, ctx) -> None:
        """Keep the mean Q as next step's warm start (in place: a captured graph keeps its storage)."""
        d, mat, key, dense = ctx
        if not dense:
            self.q[key].copy_(second[0])

    def reset(self, shared) -> None:
        """The first step's Q again (``shared`` already reset to step 0)."""
        for key, q in self.q.items():
            q.copy_(self._initial_q(shared, q.shape[0], q.shape[1], key))

    def decompress(self, payload, ctx):
        d, mat, key, dense = ctx
        if dense:
            return payload[0]
        p, q = payload
        return (p @ q.t()).flatten()[:d]

    def describe(self):
        return f"powersgd(r={self.rank})"


METHODS = CHOICES["compress"]


def make(
    method: str,
    ratio: float = 0.01,
    threshold: float = 1e-3,
    levels: int = 127,
    rank: int = 4,
    randomk_unbiased: bool = True,
    randomk_shared: bool = True,
    terngrad_clip: bool = False,
) -> Compressor | None:
    """The compressor named by ``--compress`` (None for ``none``; ``fp32`` = Identity, for tests)."""
    if method == "none":
        return None
    table = {
        "fp32": lambda: Identity(),
        "fp16": lambda: Cast(torch.float16),
        "bf16": lambda: Cast(torch.bfloat16),
        "topk": lambda: TopK(ratio),
        "randomk": lambda: RandomK(ratio, randomk_unbiased, randomk_shared),
        "threshold": lambda: Threshold(threshold),
        "terngrad": lambda: TernGrad(terngrad_clip),
        "qsgd": lambda: QSGD(levels),
        "powersgd": lambda: PowerSGD(rank),
    }
    if method not in table:
        raise ValueError(f"unknown compression method {method!r}; choose from {', '.join(METHODS)}")
    return table[method]()
