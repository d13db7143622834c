"""Compressed averaging of one gradient bucket: split into chunks, compress, transport, decompress.

``Compression.launch(bucket)`` is what ``fastcifar.parallel.comm.GradBuckets`` calls instead of its plain
all-reduce when backward has filled a bucket (on the GPU inside the comm stream, so it overlaps
the rest of backward). It returns an object with ``wait()``, like the c10d Work it replaces;
``GradBuckets.finish()`` waits on it, and then the bucket holds the mean of the ranks'
reconstructed gradients (in place, in the bucket's dtype).

Chunks (``scope``): ``layer`` one per parameter (its view's span in the bucket), ``bucket`` the
whole bucket, ``model`` the whole bucket too, GradBuckets then making one bucket per dtype
(fp32 on the CPU: the whole model; fp16 weights and fp32 batchnorm on the GPU: two vectors).

Transports (``transport``):
- ``sparse``: what the compressor's payload needs. Summable payloads of all chunks are
  concatenated into one all-reduce; per-rank payloads are packed into one byte buffer (each piece
  8-byte aligned) and all-gathered, then each rank's part is added into the mean in rank order
  (``Compressor.accumulate``; sparse parts at their own coordinates, and this rank's own part taken
  off its error-feedback residual the same way). Threshold (variable size) first all-gathers the
  per-chunk counts (a blocking collective: the sizes go to the host), pads every chunk to the
  largest count and gathers that; when every count is zero nothing more is sent (no zero-size
  collective to hang on).
- ``dense``: the seed's way: each rank's own reconstruction D(C(g)), zeros included, is
  all-reduced at full size. Same result, no bytes saved; for side-by-side comparison.

Bytes counted are the payload bytes this rank contributes per step (counts included), and the
dense baseline is the bucket's size (what ``--compress none`` all-reduces): the ratio is the
reduction in what each rank puts on the wire. A ring all-reduce moves ~2(n-1)/n of its buffer
per rank and an all-gather (n-1) times the payload: bench/bench_compress.py models both.
Compress time is host time around compress + decompress (on the GPU: launch time only, the
kernels run asynchronously on the comm stream), without the blocking collectives inside it
(Threshold's count all-gather, PowerSGD's second all-reduce): their time is waiting for peers and
the wire, which bench/bench_compress.py models apart (counting it here would count it twice).

Steps are counted on the device: ``end_step`` advances the RNGs' step counter with a device op, so
a captured CUDA graph's replays count too (they run no Python); ``summary()`` reads it once, at
the end of a run. Bytes and compress time are summed by the host over the steps whose Python ran.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fastcifar.core.config import CHOICES
from fastcifar.parallel.compress.compressors import Compressor
from fastcifar.parallel.compress.memory import ErrorFeedback
from fastcifar.parallel.compress.rng import SHARED_STREAM, CounterRNG

SCOPES = CHOICES["compress_scope"]
TRANSPORTS = CHOICES["compress_transport"]


@dataclass
class Chunk:
    key: int  # unique over the model; the RNG and the memory are keyed by it
    start: int  # element offset in the bucket's flat tensor
    length: int
    rows: int | None  # a matrix view for PowerSGD (a parameter's first dimension), None: flat


@dataclass
class Stats:
    """Sums over the steps whose Python ran (``Compression.step`` of them; graph replays add none)."""

    payload_bytes: int = 0  # bytes this rank sent
    dense_bytes: int = 0  # bytes --compress none would have sent
    compress_s: float = 0.0  # host seconds in compress + decompress (+ error feedback), collectives excluded


def _aligned(nbytes: int) -> int:
    return (nbytes + 7) // 8 * 8


def pack(tensors: list) -> tuple[torch.Tensor, list]:
    """Tensors of any dtypes in one uint8 buffer (each 8-byte aligned, so views back are legal)."""
    layout, offset = [], 0
    for t in tensors:
        layout.append((offset, t.dtype, tuple(t.shape), t.numel() * t.element_size()))
        offset += _aligned(t.numel() * t.element_size())
    device = tensors[0].device if tensors else "cpu"
    buf = torch.zeros(max(offset, 8), dtype=torch.uint8, device=device)
    for t, (o, _, _, nb) in zip(tensors, layout, strict=True):
        if nb:
            buf[o : o + nb].copy_(t.contiguous().reshape(-1).view(torch.uint8))
    return buf, layout


def unpack(buf: torch.Tensor, layout: list) -> list:
    return [buf[o : o + nb].view(dtype).reshape(shape) for o, dtype, shape, nb in layout]


def _flatten(groups: list) -> torch.Tensor:
    """The tensors of ``groups`` (a list of lists, one per chunk) in one flat vector, for one all-reduce."""
    return torch.cat([t.reshape(-1) for group in groups for t in group])


def _unflatten(flat: torch.Tensor, groups: list) -> list:
    """Views of ``flat`` shaped like the tensors of ``groups`` and grouped the same way (``_flatten``'s inverse)."""
    out, o = [], 0
    for group in groups:
        views = []
        for t in group:
            views.append(flat[o : o + t.numel()].reshape(t.shape))
            o += t.numel()
        out.append(views)
    return out


class _Pending:
    """The Work-like handle of one bucket: ``wait()`` waits for its collectives, then finishes."""

    def __init__(self, works: list, finish):
        self.works, self.finish = works, finish

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.finish()


class Compression:
    """One compressor applied to every bucket of a GradBuckets, with its memory, RNGs and stats."""

    def __init__(
        self,
        compressor: Compressor,
        scope: str = "bucket",
        error_feedback: bool = False,
        warmup_steps: int = 0,
        transport: str = "sparse",
        seed: int = 0,
    ):
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, not {scope!r}")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, not {transport!r}")
        if transport == "dense" and compressor.rounds > 1:
            raise ValueError(f"{compressor.name} has no dense transport (its two rounds are the method)")
        self.compressor, self.scope, self.transport = compressor, scope, transport
        self.warmup_steps, self.seed = warmup_steps, seed
        self.memory = ErrorFeedback() if error_feedback else None
        self.group, self.world_size, self.rank = None, 1, 0  # plan() takes GradBuckets' group and device
        self.rng = self.shared = None
        # Host count of the steps whose Python ran since reset(): the dense warm-up's switch and the
        # divisor of Stats' sums. The steps averaged, replays included, are the RNG's device counter.
        self.step = 0
        self.stats = Stats()
        self._chunks: dict = {}  # bucket index -> [Chunk]
        self._step_bytes = [0, 0]  # this step: payload, dense
        # the last finished step's (payload, dense), kept through reset(): after it, a captured
        # step's replays run no Python, and the step captured before it is what they send
        self._last_bytes = None

    # -- set-up --------------------------------------------------------------------------------
    def plan(self, buckets, group=None, device: torch.device | str = "cpu") -> None:
        """Chunks of every bucket (GradBuckets calls this once its buckets exist, with its own group
        and device: the ranks to average over and where the RNG counters live are the buckets')."""
        from fastcifar.parallel.comm import _span

        self.group = group
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.rng = CounterRNG(self.seed, self.rank, device)  # this rank's own draws
        self.shared = CounterRNG(self.seed, SHARED_STREAM, device)  # the same draws on every rank
        key = 0
        for b in buckets:
            if self.scope == "layer":
                chunks = []
                for p, offset in zip(b.params, b.offsets, strict=True):
                    chunks.append(Chunk(key, offset, _span(p), p.shape[0] if p.dim() > 1 else None))
                    key += 1
            else:
                chunks = [Chunk(key, 0, b.numel, None)]
                key += 1
            self._chunks[b.index] = chunks

    def describe(self) -> str:
        ef = "error feedback" if self.memory is not None else "no error feedback"
        warm = f", dense for the first {self.warmup_steps} steps" if self.warmup_steps else ""
        note = ""
        if self.memory is not None and self.compressor.unbiased:
            note = " (note: error feedback with an unbiased compressor can diverge, see docs/compression.md)"
        return (
            f"compression: {self.compressor.describe()}, scope {self.scope}, {self.transport} transport, "
            f"{ef}{warm}{note}"
        )

    # -- per step ------------------------------------------------------------------------------
    def launch(self, b, dense_all_reduce):
        """Start averaging bucket ``b``; ``dense_all_reduce(flat)`` is GradBuckets' own (uncompressed) path."""
        dense_bytes = b.flat.numel() * b.flat.element_size()
        self._step_bytes[1] += dense_bytes
        if self.step < self.warmup_steps:
            self._step_bytes[0] += dense_bytes
            return dense_all_reduce(b.flat)
        t0 = time.perf_counter()
        n, comp = self.world_size, self.compressor
        items = []  # (chunk, compensated fp32, payload, ctx)
        for c in self._chunks[b.index]:
            g = b.flat[c.start : c.start + c.length].to(torch.float32, copy=True)
            if self.memory is not None:
                g = self.memory.compensate(c.key, g)
            scale = 1 if self.transport == "dense" else n  # dense: the whole reconstruction is summed
            payload, ctx = comp.compress(g, scale, self.rng, self.shared, key=c.key, rows=c.rows)
            items.append((c, g, payload, ctx))
        if self.transport == "dense":
            pending = self._launch_dense(b, items)
        elif comp.kind == "sum":
            pending = self._launch_sum(b, items)
        else:
            pending = self._launch_gather(b, items)
        self.stats.compress_s += time.perf_counter() - t0
        return pending

    def end_step(self) -> None:
        """After every bucket of a step was waited for (GradBuckets.finish)."""
        self.step += 1
        self.stats.payload_bytes += self._step_bytes[0]
        self.stats.dense_bytes += self._step_bytes[1]
        self._last_bytes = tuple(self._step_bytes)
        self._step_bytes = [0, 0]
        self.rng.advance()  # a device op: a captured step's replays advance (and count) it too
        self.shared.advance()

    def steps_run(self) -> int:
        """Steps averaged since reset(), graph replays included: the RNG's device step counter.
        A host read (a sync on the GPU): for the end of a run, never inside a step."""
        return int(self.rng.step)

    def summary(self) -> dict:
        """The run's record: steps (dense warm-up included), bytes per step, ratio, compress time."""
        steps = self.steps_run()
        out = {"steps": steps, "compressed_steps": max(0, steps - self.warmup_steps)}
        if self.step == 0 and steps and self._last_bytes is not None:
            # Graph replays run no Python: the captured step's byte counts are every step's (fixed
            # sizes), and no host time was measured.
            (payload, dense), ms = self._last_bytes, None
            out["source"] = "the captured step (graph replays are not counted one by one)"
        else:
            host = max(self.step, 1)
            payload, dense = self.stats.payload_bytes / host, self.stats.dense_bytes / host
            ms = 1e3 * self.stats.compress_s / host
        return {
            **out,
            "bytes_per_step": payload,
            "dense_bytes_per_step": dense,
            "ratio": dense / payload if payload else float("inf"),
            "compress_ms_per_step": ms,
        }

    def reset(self) -> None:
        """Back to the state before the first step (after the trainer's untimed warm-up steps)."""
        self.step = 0
        self.stats = Stats()
        self._step_bytes = [0, 0]
        self.rng.reset()
        self.shared.reset()
        if self.memory is not None:
            self.memory.reset()
        self.compressor.reset(self.shared)

    # -- transports ----------------------------------------------------------------------------
    def _write(self, b, c: Chunk, mean: torch.Tensor) -> None:
        b.flat[c.start : c.start + c.length].copy_(mean)

    def _timed(self, fn):
        def run():
            t0 = time.perf_counter()
            fn()
            self.stats.compress_s += time.perf_counter() - t0

        return run

    @contextlib.contextmanager
    def _off_clock(self):
        """Around a blocking collective inside a timed section: its time (waiting for the slowest
        peer, then the wire) is taken back out of compress_s. With a peer 50 ms late, PowerSGD's
        and Threshold's compress time read ~50 ms a step when it was counted."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.stats.compress_s -= time.perf_counter() - t0

    def _launch_dense(self, b, items):
        """The seed: write each rank's reconstruction / n into the bucket, all-reduce it whole.
        Divided in fp32 before the bucket's dtype rounds it, not through GradBuckets' plain path
        (which sums in the bucket, then divides): an unbiased reconstruction is up to d/k times the
        gradient (100x at K = 1%), and an fp16 bucket (max 65504) needs the n-fold headroom of
        dividing first."""
        comp, n = self.compressor, self.world_size
        for c, g, payload, ctx in items:
            own = comp.decompress(payload, ctx)
            if self.memory is not None:
                self.memory.update(c.key, g, own)
            self._write(b, c, own / n)
        self._step_bytes[0] += b.flat.numel() * b.flat.element_size()
        return _Pending([dist.all_reduce(b.flat, group=self.group, async_op=True)], lambda: None)

    def _launch_sum(self, b, items):
        comp, n = self.compressor, self.world_size
        payloads = [payload for _, _, payload, _ in items]
        buf = _flatten(payloads)
        self._step_bytes[0] += buf.numel() * buf.element_size()
        work = dist.all_reduce(buf, group=self.group, async_op=True)

        def finish():
            per_item = _unflatten(buf, payloads)
            if comp.rounds > 1:  # PowerSGD: the second collective (Q) needs the first's result (P)
                second = [comp.next_round(s, ctx, n) for s, (_, _, _, ctx) in zip(per_item, items, strict=True)]
                if any(second):  # chunks sent whole have no second round
                    buf2 = _flatten(second)
                    self._step_bytes[0] += buf2.numel() * buf2.element_size()
                    with self._off_clock():
                        dist.all_reduce(buf2, group=self.group)
                    second = _unflatten(buf2, second)
                for s2, (_, _, _, ctx) in zip(second, items, strict=True):
                    comp.finish_round(s2, ctx)
                per_item = [s + s2 for s, s2 in zip(per_item, second, strict=True)]
            for s, (c, g, payload, ctx) in zip(per_item, items, strict=True):
                mean = comp.decompress(s, ctx)
                if self.memory is not None:  # own payload's decompression: only the residual needs it
                    if comp.rounds > 1:
                        own = mean  # PowerSGD's residual is against the shared approximation
                    else:
                        own = comp.decompress(payload, ctx) * n  # what this rank sent, unscaled
                    self.memory.update(c.key, g, own)
                self._write(b, c, mean)

        return _Pending([work], self._timed(finish))

    def _launch_gather(self, b, items):
        comp, n = self.compressor, self.world_size
        payloads = [payload for _, _, payload, _ in items]
        counts = None
        if not comp.fixed_size:
            # Variable sizes: every rank learns every chunk's count, then pads to the largest.
            mine = torch.tensor([p[0].numel() for p in payloads], dtype=torch.int64, device=b.flat.device)
            gathered = [torch.empty_like(mine) for _ in range(n)]
            with self._off_clock():  # blocking, and .cpu() waits for it on the GPU
                dist.all_gather(gathered, mine, group=self.group)
                counts = torch.stack(gathered).cpu()  # (ranks, chunks): the host needs the sizes
            self._step_bytes[0] += mine.numel() * mine.element_size()
            largest = counts.amax(0).tolist()
            payloads = [
                [torch.nn.functional.pad(t, (0, k - t.numel())) for t in p]
                for p, k in zip(payloads, largest, strict=True)
            ]
        buf, layout = pack([t for p in payloads for t in p])
        if counts is not None and int(counts.sum()) == 0:
            out, work = [buf] * n, None  # nothing selected anywhere: no data collective at all
        else:
            self._step_bytes[0] += buf.numel()
            out = [torch.empty_like(buf) for _ in range(n)]
            work = dist.all_gather(out, buf, group=self.group, async_op=True)

        def finish():
            per_rank = [unpack(o, layout) for o in out]
            for i, (c, g, payload, ctx) in enumerate(items):
                k = len(payload)
                mean = torch.zeros_like(g)
                for r in range(n):  # rank order: the same sum on every rank
                    part = per_rank[r][i * k : (i + 1) * k]
                    if counts is not None:
                        part = [t[: int(counts[r, i])] for t in part]
                    if r == self.rank and self.memory is not None:
                        # this rank's own part came back bit for bit: it is what was sent
                        self.memory.update_from_payload(c.key, g, comp, part, ctx)
                    comp.accumulate(mean, part, ctx, n)
                self._write(b, c, mean)

        return _Pending([work] if work is not None else [], self._timed(finish))
