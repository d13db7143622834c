"""One rank of the bucketed all-reduce tests; test_comm.py starts two of these with RANK/WORLD_SIZE set.

    python tests/helpers/comm_worker.py train OUT_DIR BUCKET_MB [BUCKET_MB ...]   # K steps per bucket size
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

from fastcifar.dist import distributed
from fastcifar.dist.comm import GradBuckets
from fastcifar.core.config import ConfigError

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
            "trace": trace, "n_buckets": len(buckets),
            "bucket_params": [[names[p] for p in b.params] for b in buckets.buckets],
            "views_kept": all(p.grad.data_ptr() == ptrs[n] and p.grad.stride() == p.stride()
                              for n, p in model.named_parameters()),
        }
        buckets.remove()
    torch.save(results, out / f"rank{ctx.rank}.pt")


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    ctx = distributed.setup("cpu", timeout_s=20.0)
    try:
        if argv[0] == "train":
            train(Path(argv[1]), [float(v) for v in argv[2:]], ctx)
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
