"""Gradient averaging over ranks: flat buckets, all-reduced while backward is still running.

Each parameter's ``.grad`` is a view into a flat bucket, laid out with the parameter's own strides
(conv weights are channels-last), so autograd accumulates into the bucket in place and nothing is
copied before or after the collective. Buckets are filled in reverse registration order (the order
backward produces gradients), one dtype per bucket (fp16 weights and fp32 batchnorm parameters on
the GPU); the plan depends only on the parameters' shapes and dtypes, so it is the same on every
rank (distributed.check_same compares the model's shapes at start-up).

A post-accumulate-grad hook per parameter counts what is ready. When a bucket is complete and every
bucket before it has been launched, its all-reduce starts with ``async_op=True``: on the GPU on a
dedicated stream that first waits on the stream backward accumulated on, so the collective overlaps
the rest of backward. Buckets launch in bucket order on every rank (if bucket k+1 completes before
bucket k, it waits for k), because collectives must be issued in the same order everywhere.
``finish()`` launches what is left (buckets holding a parameter the step did not use: its gradient
stays zero and is averaged like the others) and makes the optimizer wait for all of them: on the GPU
the current stream waits on the communication stream (no host sync); with gloo ``work.wait()``.

The average is a sum, then one division: each bucket is all-reduced with SUM in its own dtype and,
once its sum has arrived (in ``finish()``, on the comm stream on the GPU), divided in place by the
rank count. Dividing each rank's fp16 gradient first, as this module did until issue 46, flushed
per-rank values below n x 3e-8 to zero; the sum cannot overflow where one GPU training the global
batch alone would not (numbers at ``_all_reduce_mean``). For 2, 4 or 8 ranks and fp32 the result is
bit for bit the former one. During a CUDA graph capture a launch checks that the collective is
issued on a capturing stream (one outside the capture would be missing from every replay).

The default cap, 2 MiB, splits ResNet-9's 12.5 MiB of fp16 gradients into 6 collectives whose last
(layer2 and earlier, 1.3 MB) is all that waits after backward: a small share of the step on 8
NVLink GPUs in bench/results/allreduce_model_8gpu.md (a model, not a measurement). The only
measurement so far is gloo on 2 shared CPU cores (bench/results/allreduce.md, the bucket-size
rows): small buckets cost a collective each, and the sizes from 1 to 25 MiB tie DDP; overlap
cannot pay on the CPU, where gloo sums on the cores backward uses.

    buckets = GradBuckets(model.parameters(), bucket_mb=2.0)   # after the model, before the optimizer
    loss.backward(); buckets.finish(); opt.step(); opt.zero_grad()   # zero_grad keeps the views
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Each view starts on a 128-byte boundary (16 fp32 or 64 fp16 elements of padding at most): the
# vectorized accumulate kernels and NCCL read aligned memory. Padding stays zero; it costs < 4 KB
# for ResNet-9's 30 tensors.
ALIGN_BYTES = 128


@dataclass
class Bucket:
    index: int  # launch order, the same on every rank
    dtype: torch.dtype
    params: list  # in the order backward produces their gradients
    offsets: list  # element offset of each parameter's view in ``flat``
    numel: int  # elements including alignment padding
    flat: torch.Tensor | None = None
    pending: int = 0  # gradients not yet accumulated this step
    work: object = None  # the in-flight c10d Work, None when not launched


def _span(p: torch.Tensor) -> int:
    """Elements the parameter's strides reach: numel for dense (contiguous or channels-last) tensors."""
    if p.numel() == 0:
        return 0
    span = 1 + sum((size - 1) * stride for size, stride in zip(p.shape, p.stride(), strict=True))
    if span < p.numel():
        raise ValueError(f"a parameter of shape {tuple(p.shape)} and strides {p.stride()} overlaps itself")
    return span


def plan_buckets(params, bucket_bytes: int) -> list[Bucket]:
    """Group ``params`` (registration order) into buckets of at most ``bucket_bytes`` per dtype, taking
    them in reverse order; a tensor bigger than the cap gets a bucket of its own. Buckets are ordered
    by when their last gradient arrives in backward, which is the order they can launch in."""
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters")
    if len({p.device for p in params}) != 1:
        raise ValueError("all parameters must live on one device (one process per device)")
    open_by_dtype: dict[torch.dtype, list] = {}  # dtype -> [members, bytes used, position of last]
    closed: list[tuple[int, list]] = []  # (position in backward order of the last member, members)
    for position, p in enumerate(reversed(params)):
        nbytes = _span(p) * p.element_size()
        current = open_by_dtype.get(p.dtype)
        if current and current[1] + nbytes > bucket_bytes:
            closed.append((current[2], current[0]))
            current = None
        if current is None:
            current = open_by_dtype[p.dtype] = [[], 0, position]
        current[0].append(p)
        current[1] += nbytes
        current[2] = position
    closed += [(last, members) for members, _, last in open_by_dtype.values()]
    closed.sort(key=lambda item: item[0])

    align = {}
    buckets = []
    for index, (_, members) in enumerate(closed):
        dtype = members[0].dtype
        step = align.setdefault(dtype, max(1, ALIGN_BYTES // members[0].element_size()))
        offsets, numel = [], 0
        for p in members:
            offsets.append(numel)
            numel += math.ceil(_span(p) / step) * step
        buckets.append(Bucket(index, dtype, members, offsets, numel))
    return buckets


class SumThenDivide:
    """The handle of one bucket's all-reduce (a c10d Work's ``wait``): waits for the sum over ranks,
    then divides it by the rank count in place, on the caller's stream (``finish`` calls it on the
    comm stream, so a captured graph replays the division after each bucket's sum)."""

    def __init__(self, work, flat: torch.Tensor, world_size: int):
        self.work, self.flat, self.world_size = work, flat, world_size

    def wait(self) -> None:
        self.work.wait()
        if self.world_size > 1:  # one rank: the sum is the mean, no kernel
            self.flat.div_(self.world_size)


class GradBuckets:
    """Own the gradients of ``params`` in flat buckets and average them over ``group``'s ranks.

    ``communicate=False`` keeps the buckets, hooks and readiness counting but issues no collective:
    the same step with communication skipped, which the benchmark subtracts to get the exposed
    communication time (an attribute: the benchmark flips it between steps, never inside one).
    ``trace``, when a list, receives ("grad", name) and ("launch", bucket index) events in the
    order they happen (the overlap test reads it).
    ``compression`` (a ``fastcifar.parallel.compress.Compression``), when given, replaces each bucket's
    all-reduce by its compress -> transport -> decompress, launched at the same moment on the same
    stream; scope ``model`` makes one bucket per dtype (the whole gradient as one vector).
    """

    def __init__(
        self,
        params,
        bucket_mb: float = 2.0,
        group=None,
        communicate: bool = True,
        names: dict | None = None,
        trace: list | None = None,
        compression=None,
    ):
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be positive, not {bucket_mb}")
        self.compression = compression
        whole = compression is not None and compression.scope == "model"
        self.buckets = plan_buckets(params, 2**62 if whole else int(bucket_mb * 2**20))
        self.params = [p for b in self.buckets for p in b.params]
        self.device = self.params[0].device
        self.group = group
        self.communicate = communicate
        if communicate and not dist.is_initialized():
            raise RuntimeError("GradBuckets needs an initialized process group (or communicate=False)")
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.trace = trace
        self._names = names or {}
        self._next = 0  # index of the next bucket to launch
        self._bucket_of = {}
        self._ptr = {}
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        with torch.no_grad():
            for b in self.buckets:
                b.flat = torch.zeros(b.numel, dtype=b.dtype, device=self.device)
                for p, offset in zip(b.params, b.offsets, strict=True):
                    view = b.flat.as_strided(p.shape, p.stride(), offset)
                    if p.grad is not None:
                        view.copy_(p.grad)
                    p.grad = view
                    self._bucket_of[p] = b
                    self._ptr[p] = view.data_ptr()
                b.pending = len(b.params)
        if compression is not None:
            compression.plan(self.buckets, group, self.device)  # one group and device for both
        if communicate:
            self._broadcast_from_rank0()
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    def __len__(self) -> int:
        return len(self.buckets)

    @torch.no_grad()
    def _broadcast_from_rank0(self) -> None:
        """Start every rank from rank 0's weights, as DDP does: the same seed gives the same weights
        on the same software, but nodes with different library versions need not agree."""
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        for p in self.params:
            dist.broadcast(p.data, src=src, group=self.group)

    def _on_grad(self, p: torch.Tensor) -> None:
        if p.grad is None or p.grad.data_ptr() != self._ptr[p]:
            raise RuntimeError(
                f"the gradient of {self._name(p)} no longer lives in its bucket: was .grad "
                "replaced or set to None (zero_grad(set_to_none=True))? Zero it in place"
            )
        b = self._bucket_of[p]
        if b.pending <= 0:
            raise RuntimeError(
                f"the gradient of {self._name(p)} was accumulated twice before finish(): "
                "call finish() after every backward"
            )
        if self.trace is not None:
            self.trace.append(("grad", self._name(p)))
        b.pending -= 1
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._launch(self.buckets[self._next])
            self._next += 1

    def _name(self, p) -> str:
        return self._names.get(p, f"parameter of shape {tuple(p.shape)}")

    @torch.no_grad()
    def _launch(self, b: Bucket) -> None:
        if self.trace is not None:
            self.trace.append(("launch", b.index))
        b.pending = -1  # launched; finish() resets it
        if not self.communicate:
            return
        if self.stream is not None:
            # The comm stream waits for everything queued so far on the stream backward accumulated
            # this bucket's gradients on; the collective then runs beside the rest of backward.
            # During a CUDA graph capture that wait is also what pulls the comm stream into the
            # capture: a collective issued on a stream outside it would run once, now, and be
            # missing from every replay (ranks training apart, silently), so it is refused.
            capturing = torch.cuda.is_current_stream_capturing()
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                if capturing and not torch.cuda.is_current_stream_capturing():
                    raise RuntimeError(
                        f"gradient bucket {b.index}'s all-reduce would be issued outside the CUDA "
                        "graph being captured: the comm stream did not join the capture"
                    )
                b.work = self._average(b)
        else:
            b.work = self._average(b)

    def _average(self, b: Bucket):
        if self.compression is not None:
            return self.compression.launch(b, self._all_reduce_mean)
        return self._all_reduce_mean(b.flat)

    def _all_reduce_mean(self, flat: torch.Tensor) -> SumThenDivide:
        # Sum, then divide once, in wait() (on the GPU on the comm stream, after the sum arrives).
        # fp16 keeps 11 significant bits down to 6.1e-5 and a fixed spacing of 6.0e-8 (2^-24)
        # below: dividing each rank's gradient by n first rounded n times on that grid and
        # flushed every per-rank value up to n x 3.0e-8 to zero (2.4e-7 on 8 ranks); the sum
        # keeps them and the division rounds once (in fp32 arithmetic, one rounding to fp16).
        # For the default preset on 8 ranks, dividing first put 1.5% of each rank's elements on
        # that grid; 0.3% of the means lie there (bench/results/fp16_grad_range.md).
        # Overflow: the sum over ranks of each rank's summed-loss gradient is the gradient of the
        # loss summed over the global batch, which one GPU training that batch alone holds in
        # fp16 already. Measured there (first epoch, 8 x 250 images): the largest |sum| and the
        # largest sum of |rank's gradient|, which bounds every partial sum of a ring or tree,
        # were both 45, 1450x below fp16's 65504.
        # fp32: for 2, 4 or 8 ranks dividing by a power of two is exact, so these are the bits
        # dividing first gave. Folding 1/n into the step's rate instead would keep the n-times
        # larger sum in the bucket, but the optimizer's first fp16 op adds weight decay x w
        # (rounding at that term's spacing), and DDP, compression, Muon's rate ratio and
        # checkpointed momentum would need a second gradient convention.
        work = dist.all_reduce(flat, group=self.group, async_op=True)
        return SumThenDivide(work, flat, self.world_size)

    @torch.no_grad()
    def finish(self) -> None:
        """Launch the buckets backward did not complete, then make the caller's stream wait for
        every all-reduce. Call it between backward and the optimizer step, once per backward."""
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
            self._next += 1
        if self.communicate and self.stream is not None:
            with torch.cuda.stream(self.stream):
                for b in self.buckets:
                    b.work.wait()  # the comm stream waits on NCCL's (no host sync), then divides
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        elif self.communicate:
            for b in self.buckets:
                b.work.wait()  # gloo: blocks until this bucket's sum is in place, then divides it
        for b in self.buckets:
            b.work = None
            b.pending = len(b.params)
        self._next = 0
        if self.communicate and self.compression is not None:
            self.compression.end_step()

    @torch.no_grad()
    def zero_grad(self) -> None:
        """Zero every bucket (one fill per bucket; the views and their storage stay)."""
        for b in self.buckets:
            b.flat.zero_()

    def reset(self) -> None:
        """Compression state (error-feedback residuals, RNG step, warm start, counts) back to
        before the first step; nothing to do without compression."""
        if self.compression is not None:
            self.compression.reset()

    def remove(self) -> None:
        """Detach the hooks; the gradients stay (as views) until the caller drops them."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def describe(self) -> str:
        sizes = ", ".join(f"{b.numel * b.flat.element_size() / 2**20:.2f}" for b in self.buckets)
        return f"{len(self.buckets)} gradient buckets (MB, launch order): {sizes}"
