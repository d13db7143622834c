"""Gradient averaging over ranks: flat buckets, all-reduced while backward is still running.

Each parameter's ``.grad`` is a view into a flat bucket, laid out with the parameter's own strides
(conv weights are channels-last), so autograd accumulates into the bucket in place and nothing is
copied before or after the collective. Buckets hold parameters in reverse registration order (the
order backward produces gradients), one dtype per bucket (fp16 weights and fp32 batchnorm parameters
on the GPU), and are filled from the end of backward, so the one that can only start when backward
ends is small (``LAST_BUCKET_BYTES``); the plan depends only on the parameters' shapes, dtypes and
which of them require grad, so it is the same on every rank (distributed.check_same compares the
model's shapes at start-up). A parameter frozen part-way (the recipe's whitening bias) leaves the
buckets at the next step's ``begin()``: each trainable set has its own plan, made once, in an eager
step before any capture of it.

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
rank count. Dividing each rank's fp16 gradient first would flush per-rank values below n x 3e-8 to
zero; the sum cannot overflow where one GPU training the global batch alone would not (numbers at
``_all_reduce_mean``). For 2, 4 or 8 ranks and fp32 the two orders agree bit for bit. During a CUDA
graph capture a launch checks that the collective is issued on a capturing stream (one outside the
capture would be missing from every replay).

The default cap, 2 MiB, splits the default preset's 3.95 MB of fp16 gradients into 4 collectives
(and one of 4.6 KB of fp32 batchnorm shifts) whose last, blocks.0 and the whitening bias (101 KB),
is all that waits after backward; filled from the start instead, the last would be the largest,
1.58 MB. Exposed time of both fills on 8 GPUs: bench/results/allreduce_model_8gpu.md (a model, not
a measurement). The only measurement so far is gloo on 2 shared CPU cores (bench/results/allreduce.md,
the bucket-size rows): small buckets cost a collective each, and the sizes from 1 to 25 MiB tie DDP;
overlap cannot pay on the CPU, where gloo sums on the cores backward uses.

    buckets = GradBuckets(model.parameters(), bucket_mb=2.0)   # after the model, before the optimizer
    buckets.begin(); loss = ...   # begin: a parameter frozen since the last step leaves the buckets
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
# The cap of the bucket backward completes last: its all-reduce starts only when backward ends, so
# all of it is exposed. 256 KiB is ~1 us on the wire of 8 NVLink H100s (ring: 2 x 7/8 x 256 KiB at
# the model's 400 GB/s bus bandwidth), far below one collective's latency there (~20 us), and 44 us
# on two nodes at 100 Gb/s (11.25 GB/s; bench/results/allreduce_model_8gpu.md, its assumptions);
# the default preset's last bucket holds 101 KB (blocks.0 and the whitening bias).
LAST_BUCKET_BYTES = 256 * 1024


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


def plan_buckets(params, bucket_bytes: int, last_bytes: int | None = None) -> list[Bucket]:
    """Group ``params`` (registration order) into buckets of one dtype, filled from the end of
    backward: the gradients backward produces last (the first layers') fill a bucket of at most
    ``last_bytes`` (default: ``LAST_BUCKET_BYTES``, or ``bucket_bytes`` when smaller), the earlier
    ones buckets of at most ``bucket_bytes``; a tensor bigger than its cap gets a bucket of its own.
    Buckets are ordered by when their last gradient arrives in backward, which is the order they
    can launch in. Parameters that do not require grad are left out."""
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters")
    if len({p.device for p in params}) != 1:
        raise ValueError("all parameters must live on one device (one process per device)")
    if last_bytes is None:
        last_bytes = min(bucket_bytes, LAST_BUCKET_BYTES)
    # Filled from the end: the bucket that can only launch when backward ends is the small one, and
    # what is left over lands in the first bucket, which overlaps the most backward. (Filled from
    # the start, the default preset's last bucket would be its largest: 1.58 MB of 3.95, the first
    # block, blocks.1 and the whitening bias, all sent after backward.)
    # dtype -> its open bucket: [members, bytes used, cap, position in backward order of its last member]
    open_by_dtype: dict[torch.dtype, list] = {}
    closed: list[tuple[int, list]] = []  # (position in backward order of the last member, members)
    for i, p in enumerate(params):
        position = len(params) - 1 - i  # backward order is reversed registration order
        nbytes = _span(p) * p.element_size()
        current = open_by_dtype.get(p.dtype)
        if current and current[1] + nbytes > current[2]:
            closed.append((current[3], current[0]))
            current = None
        if current is None:
            cap = bucket_bytes if p.dtype in open_by_dtype else last_bytes  # a dtype's first bucket arrives last
            current = open_by_dtype[p.dtype] = [[], 0, cap, position]  # the first member taken arrives last
        current[0].insert(0, p)  # members in backward order
        current[1] += nbytes
    closed += [(last, members) for members, _, _, last in open_by_dtype.values()]
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


class _Plan:
    """One trainable set's buckets (``key``: which of ``GradBuckets.all_params`` require grad), with
    each parameter's gradient view (``ptr``: its address, which ``_on_grad`` checks) and bucket."""

    def __init__(self, key: tuple, buckets: list[Bucket]):
        self.key, self.buckets = key, buckets
        self.params = [p for b in buckets for p in b.params]
        self.views, self.ptr, self.bucket_of = {}, {}, {}
        device = self.params[0].device
        for b in buckets:
            b.flat = torch.zeros(b.numel, dtype=b.dtype, device=device)
            for p, offset in zip(b.params, b.offsets, strict=True):
                view = b.flat.as_strided(p.shape, p.stride(), offset)
                self.views[p], self.ptr[p], self.bucket_of[p] = view, view.data_ptr(), b
            b.pending = len(b.params)


class GradBuckets:
    """Own the gradients of ``params`` in flat buckets and average them over ``group``'s ranks.

    ``communicate=False`` keeps the buckets, hooks and readiness counting but issues no collective:
    the same step with communication skipped, which the benchmark subtracts to get the exposed
    communication time (an attribute: the benchmark flips it between steps, never inside one).
    ``trace``, when a list, receives ("grad", name), ("launch", bucket index) and ("finish", None)
    events in the order they happen (the overlap and last-bucket tests read it).
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
        self._caps = (2**62, 2**62) if whole else (int(bucket_mb * 2**20), None)
        self.all_params = [p for p in params if p.requires_grad]  # the trainable set at construction
        self.group = group
        self.communicate = communicate
        if communicate and not dist.is_initialized():
            raise RuntimeError("GradBuckets needs an initialized process group (or communicate=False)")
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.trace = trace
        self._names = names or {}
        self._next = 0  # index of the next bucket to launch
        self._plans: dict[tuple, _Plan] = {}  # which of all_params require grad -> their plan
        self._loose: dict = {}  # a parameter -> its gradient while it is frozen (in no bucket)
        self._use(tuple(True for _ in self.all_params))
        self.device = self.params[0].device
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        if compression is not None:
            compression.plan(self.buckets, group, self.device)  # one group and device for both
        if communicate:
            self._broadcast_from_rank0()
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.all_params]

    @torch.no_grad()
    def _use(self, key: tuple) -> None:
        """Make the plan of the parameters flagged in ``key`` current: each one's ``.grad`` its view
        in that plan's buckets, each other one's its own tensor outside every bucket (what it held
        is copied over, so a switch between steps keeps the gradients)."""
        # a switch copies gradients and repoints .grad: inside a capture it would be recorded and
        # replayed, so every switch, to a new plan or a known one, belongs to an eager step
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "the trainable parameters changed inside a CUDA graph capture: the gradient "
                "buckets are planned in the eager steps before it (warm up the variant first)"
            )
        if key not in self._plans:
            trainable = [p for p, on in zip(self.all_params, key, strict=True) if on]
            self._plans[key] = _Plan(key, plan_buckets(trainable, *self._caps))
        plan = self._plans[key]
        for p in self.all_params:
            target = plan.views.get(p)
            if target is None:
                target = self._loose.get(p)
                if target is None:
                    target = self._loose[p] = torch.zeros_like(p)  # keeps channels-last strides
            if p.grad is not None and p.grad.data_ptr() != target.data_ptr():
                target.copy_(p.grad)
            p.grad = target
        self._plan = plan

    @property
    def buckets(self) -> list[Bucket]:
        """The current plan's buckets, in launch order."""
        return self._plan.buckets

    @property
    def params(self) -> list:
        """The current plan's parameters (those that require grad), bucket by bucket."""
        return self._plan.params

    def begin(self) -> None:
        """Before each step's forward: when the set of parameters that require grad changed since
        the last step (the recipe freezes the whitening bias after a few epochs), switch to that
        set's bucket plan, so a frozen parameter is in no bucket (its bucket no longer waits for a
        gradient that never comes, to be sent from ``finish()`` after backward). Each set's plan
        is made once, in an eager step: a captured step replays its own plan's buckets. With
        compression the plan stays the first one (its error-feedback memory is per bucket)."""
        if self.compression is not None:
            return
        key = tuple(p.requires_grad for p in self.all_params)
        if key != self._plan.key:
            self._use(key)

    def __len__(self) -> int:
        return len(self.buckets)

    @torch.no_grad()
    def _broadcast_from_rank0(self) -> None:
        """Start every rank from rank 0's weights, as DDP does: the same seed gives the same weights
        on the same software, but nodes with different library versions need not agree."""
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        for p in self.all_params:
            dist.broadcast(p.data, src=src, group=self.group)

    def _on_grad(self, p: torch.Tensor) -> None:
        b = self._plan.bucket_of.get(p)
        if b is None:
            raise RuntimeError(
                f"{self._name(p)} requires grad again but its bucket plan was made without it: call "
                "begin() before each step's forward"
            )
        if p.grad is None or p.grad.data_ptr() != self._plan.ptr[p]:
            raise RuntimeError(
                f"the gradient of {self._name(p)} no longer lives in its bucket: was .grad "
                "replaced or set to None (zero_grad(set_to_none=True))? Zero it in place"
            )
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
        if self.trace is not None:
            self.trace.append(("finish", None))
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
        """Zero every bucket (one fill per bucket; the views and their storage stay), and the
        gradients of frozen parameters."""
        for b in self.buckets:
            b.flat.zero_()
        for p, g in self._loose.items():
            if p not in self._plan.views:
                g.zero_()

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
