"""One rank of the bucketed all-reduce tests; test_comm.py starts two of these with RANK/WORLD_SIZE set.

    python tests/helpers/comm_worker.py train OUT_DIR BUCKET_MB [BUCKET_MB ...]   # K steps per bucket size,
                                      # then the fp16/fp32 averages near fp16's underflow (low{rank}.pt)
    python tests/helpers/comm_worker.py shapes                                     # rank r builds a wider model

The model and data are small and simple on purpose: no batchnorm (its batch statistics would differ
between a rank's half batch and the whole batch) and a mean loss, so the average over ranks of
each rank's gradient is exactly the single-process gradient of the concatenated batch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from fastcifar.core.config import ConfigError, from_preset
from fastcifar.core.presets import DEFAULT_PRESET
from fastcifar.models.network import build_model
from fastcifar.parallel import distributed
from fastcifar.parallel.comm import GradBuckets

STEPS = 4
GLOBAL_BATCH = 8
LR, MOMENTUM = 0.1, 0.9


class SmallNet(nn.Module):
    """Channels-last convs (strided grads), a linear head, and a parameter forward never uses."""

    def __init__(self, width: int = 6):
        super().__init__()
        self.unused = nn.Parameter(torch.ones(3))  # registered first: lands in the last bucket
        self.conv1 = nn.Conv2d(3, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.conv3 = nn.Conv2d(2 * width, 2 * width, 3, padding=1)
        self.head = nn.Linear(2 * width, 5)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(F.max_pool2d(x, 2)))
        x = F.relu(self.conv3(x))
        return self.head(torch.amax(x, dim=(2, 3)))


def make_model() -> SmallNet:
    torch.manual_seed(0)
    return SmallNet().to(memory_format=torch.channels_last)


def global_batches():
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = torch.randn(GLOBAL_BATCH, 3, 8, 8, generator=g).contiguous(memory_format=torch.channels_last)
        yield x, torch.randint(0, 5, (GLOBAL_BATCH,), generator=g)


def reference_params() -> dict:
    """One process over the whole global batch: what the ranks together must reproduce."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for x, y in global_batches():
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train(out: Path, bucket_sizes: list[float], ctx) -> None:
    results = {}
    for mb in bucket_sizes:
        model = make_model()
        names = {p: n for n, p in model.named_parameters()}
        trace: list = []
        buckets = GradBuckets(model.parameters(), bucket_mb=mb, names=names, trace=trace)
        ptrs = {n: p.grad.data_ptr() for n, p in model.named_parameters()}
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        per_rank = GLOBAL_BATCH // ctx.world_size
        for x, y in global_batches():
            part = slice(ctx.rank * per_rank, (ctx.rank + 1) * per_rank)
            F.cross_entropy(model(x[part]), y[part]).backward()
            buckets.finish()
            opt.step()
            opt.zero_grad(set_to_none=False)
        results[mb] = {
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "trace": trace,
            "n_buckets": len(buckets),
            "bucket_params": [[names[p] for p in b.params] for b in buckets.buckets],
            "views_kept": all(
                p.grad.data_ptr() == ptrs[n] and p.grad.stride() == p.stride() for n, p in model.named_parameters()
            ),
        }
        buckets.remove()
    results["default preset"] = default_preset_trace(ctx)
    torch.save(results, out / f"rank{ctx.rank}.pt")


def default_preset_model():
    """The default preset's config and network (seed 0) in the GPU's layout: fp16 weights, fp32
    batchnorm shifts."""
    cfg = from_preset(DEFAULT_PRESET)
    torch.manual_seed(0)
    return cfg, build_model(cfg, torch.device("cpu"), torch.float16)


def step_trace(model, buckets, trace, x) -> list:
    """One forward and backward of ``model`` on ``x`` through ``buckets``: the events ``trace``
    (the list GradBuckets was given) received, from begin() to finish()."""
    trace.clear()
    buckets.begin()
    model(x).float().sum().backward()
    buckets.finish()
    return [(kind, i) for kind, i in trace]


def default_preset_trace(ctx) -> dict:
    """The default preset's network, its own bucket plan, all-reduced on gloo: one step's trace
    with the whitening bias trainable, one with it frozen (issue 73: the last bucket small, the
    frozen bias in none)."""
    cfg, model = default_preset_model()
    names = {p: n for n, p in model.named_parameters()}
    trace: list = []
    buckets = GradBuckets(model.parameters(), cfg.bucket_mb, names=names, trace=trace)
    g = torch.Generator().manual_seed(ctx.rank)
    x = torch.randn(2, 3, 16, 16, generator=g).half().contiguous(memory_format=torch.channels_last)  # fp16 on 2 cores
    steps, plans = [], []
    for frozen in (False, True):
        model.whiten.bias.requires_grad_(not frozen)
        steps.append(step_trace(model, buckets, trace, x))
        buckets.zero_grad()
        plans.append([(b.numel * b.flat.element_size(), [names[p] for p in b.params]) for b in buckets.buckets])
    buckets.remove()
    return {"steps": steps, "plans": plans}


TINY16 = 2.0**-24  # fp16's smallest subnormal, and the spacing of every value below 2^-14


def low_precision_inputs(rank: int) -> dict:
    """Each rank's gradients for ``low``, set by hand as if backward had produced them (so the
    test knows every rank's values): fp16 ones on fp16's subnormal grid and above it, one fp32
    tensor. The same generator on every rank: each rank keeps its own column."""
    g = torch.Generator().manual_seed(7)
    both = lambda t: t[:, rank]  # noqa: E731  (a value per element and rank: the rank's own)
    ks = torch.randint(-40, 41, (64, 2), generator=g).double()
    odd = torch.arange(3, 35, 2, dtype=torch.float64)
    normal = torch.randn(64, 2, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-4, 2, (64, 2), generator=g)
    return {
        # 2^-24 on both ranks: dividing first rounds each half (2^-25, a tie) to the even 0
        "flush": torch.full((16,), TINY16, dtype=torch.float16),
        # odd multiples of 2^-24 (1.8e-7 .. 2.0e-6) on both ranks: each half is a tie, rounded to even
        "odd": (odd * TINY16).to(torch.float16),
        "small": (both(ks) * TINY16).to(torch.float16),  # -2.4e-6 .. 2.4e-6, each rank its own
        "normal": both(normal).to(torch.float16),
        "large": torch.full((8,), 30000.0 * (1 + rank / 8), dtype=torch.float16),  # sums to 63750 < 65504
        "fp32": (both(torch.randn(64, 2, generator=g, dtype=torch.float64)) * 1e-3).float(),
    }


def summed_loss_grad(w0, x, y, dtype, average: bool = False) -> torch.Tensor:
    """The weight gradient of a linear layer's cross-entropy summed over ``x``'s rows, in
    ``dtype``; ``average``: through a GradBuckets, averaged over the ranks."""
    w = w0.to(dtype).requires_grad_(True)
    buckets = GradBuckets([w], bucket_mb=1.0) if average else None
    F.cross_entropy(F.linear(x.to(dtype), w).float(), y, reduction="sum").backward()
    if buckets is not None:
        buckets.finish()
        buckets.remove()
    return w.grad.clone()


def low_precision(out: Path, ctx) -> None:
    """Two checks of the bucket's average where fp16 runs out of digits: (1) hand-set gradients
    (``low_precision_inputs``) through every bucket; (2) a linear layer in fp16 and in fp32 whose
    weight gradients lie near 1e-7, each rank on its half of a global batch, with the gradient of
    one process over the whole batch beside it (every rank computes it: the test compares)."""
    results = {}
    values = low_precision_inputs(ctx.rank)
    params = {name: torch.zeros_like(v, requires_grad=True) for name, v in values.items()}
    buckets = GradBuckets(list(params.values()), bucket_mb=1e-4)  # several buckets, one per dtype at least
    for name in reversed(list(params)):  # as backward hands them over: last registered first
        params[name].grad.copy_(values[name])
        buckets._on_grad(params[name])
    buckets.finish()
    results["set"] = {
        "inputs": values,
        "mean": {n: p.grad.clone() for n, p in params.items()},
        "n_buckets": len(buckets),
    }
    buckets.remove()

    g = torch.Generator().manual_seed(3)
    x_all = torch.randn(8, 16, generator=g) * 3e-6  # summed-loss weight gradients of ~1e-7 .. 1e-6
    y_all = torch.randint(0, 4, (8,), generator=g)
    w0 = torch.randn(4, 16, generator=g)
    part = slice(4 * ctx.rank, 4 * ctx.rank + 4)
    for dtype in (torch.float16, torch.float32):
        x, w = x_all.to(dtype).double(), w0.to(dtype).double()
        d_logits = torch.softmax(x @ w.T, dim=1) - F.one_hot(y_all, 4)  # each image's, as backward has them
        results[str(dtype)] = {
            "rank_grad": summed_loss_grad(w0, x_all[part], y_all[part], dtype),  # this rank's own
            "mean": summed_loss_grad(w0, x_all[part], y_all[part], dtype, average=True),
            "one_process": summed_loss_grad(w0, x_all, y_all, dtype),  # the loss summed over all 8
            # sum over the 8 images of |each image's term|: what a sum's rounding errors scale with
            "abs_terms": d_logits.abs().T @ x.abs(),
        }
    torch.save(results, out / f"low{ctx.rank}.pt")


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    ctx = distributed.setup("cpu", timeout_s=20.0)
    try:
        if argv[0] == "train":  # one launch for both: each launch costs two torch imports
            train(Path(argv[1]), [float(v) for v in argv[2:]], ctx)
            low_precision(Path(argv[1]), ctx)
        elif argv[0] == "shapes":
            torch.manual_seed(0)
            model = SmallNet(width=4 + ctx.rank)
            distributed.check_same(distributed.model_digest(model), "model's parameter shapes", ctx)
        return 0
    except ConfigError as exc:
        print(f"fastcifar: error: [rank {ctx.rank}] {exc}", file=sys.stderr)
        return 2
    finally:
        distributed.teardown(ctx)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
