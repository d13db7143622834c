"""One rank of the compressed-communication tests; test_compress_dist.py starts 2 or 3 of these.

    python tests/helpers/compress_worker.py OUT_DIR [full|quick]   # quick: bucket scope only, no training

Every rank runs the same list of cases on its own data (rank-dependent gradients of SmallNet)
and saves, per case, the averaged buckets, the residuals and the byte counts to
OUT_DIR/rank{r}.pt; the test compares them with the uncompressed average and across ranks.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from comm_worker import make_model

from fastcifar.parallel import distributed
from fastcifar.parallel.comm import GradBuckets
from fastcifar.parallel.compress import SCOPES, Compression, make

BUCKET_MB = 0.004  # SmallNet's 9.4 KB of gradients in 3 buckets: more than one collective per step
# (name, method, options): K=1, V=0 and fp32 must give the uncompressed average bit for bit
EXACT = [
    ("fp32", "fp32", {}),
    ("topk1", "topk", {"ratio": 1.0}),
    ("threshold0", "threshold", {"threshold": 0.0}),
    ("randomk1", "randomk", {"ratio": 1.0}),
]
# sparse and dense transports must agree (the same RNG draws on both)
BOTH = [
    ("topk", "topk", {"ratio": 0.1}),
    ("randomk", "randomk", {"ratio": 0.1}),
    ("randomk_rank", "randomk", {"ratio": 0.1, "randomk_shared": False}),
    ("threshold", "threshold", {"threshold": 0.05}),
    ("terngrad", "terngrad", {}),
    ("qsgd", "qsgd", {"levels": 4}),
    ("fp16", "fp16", {}),
    ("bf16", "bf16", {}),
]
# (name, method, options, error feedback): EF with the biased methods; the unbiased ones without it
# (unbiased RandomK x 4 and QSGD with 8 levels diverged with EF here: their variance is > 1x |g|^2)
LEARN = [
    ("fp16", "fp16", {}, True),
    ("bf16", "bf16", {}, True),
    ("topk", "topk", {"ratio": 0.25}, True),
    ("randomk", "randomk", {"ratio": 0.25, "randomk_unbiased": False}, True),
    ("randomk_unbiased", "randomk", {"ratio": 0.25}, False),
    ("threshold", "threshold", {"threshold": 0.02}, True),
    ("terngrad", "terngrad", {}, False),
    ("qsgd", "qsgd", {"levels": 8}, False),
    ("powersgd", "powersgd", {"rank": 2}, True),
]


def rank_batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * rank + step)
    x = torch.randn(4, 3, 8, 8, generator=g).contiguous(memory_format=torch.channels_last)
    return x, torch.randint(0, 5, (4,), generator=g)


def averaged(method, options, scope, transport, rank, steps=2, ef=True):
    """Buckets after ``steps`` steps (the last step's average), residuals and stats."""
    model = make_model()
    compression = None
    if method != "none":
        compression = Compression(make(method, **options), scope=scope, error_feedback=ef, transport=transport, seed=7)
    buckets = GradBuckets(model.parameters(), bucket_mb=BUCKET_MB, compression=compression)
    for step in range(steps):
        buckets.zero_grad()
        x, y = rank_batch(rank, step)
        F.cross_entropy(model(x), y).backward()
        buckets.finish()
    out = {"grads": [p.grad.clone() for p in model.parameters()], "n_buckets": len(buckets)}
    if compression is not None:
        out["stats"] = compression.summary()
        out["residual"] = {
            k: v.clone() for k, v in (compression.memory.residual.items() if compression.memory is not None else [])
        }
        out["chunks"] = {i: [(c.start, c.length) for c in cs] for i, cs in compression._chunks.items()}
        out["bucket_numel"] = [b.numel for b in buckets.buckets]
    buckets.remove()
    return out


def learn(method, options, ef, rank, steps=60):
    """A linear classifier on separable data, trained with this method: the loss it ends with."""
    g = torch.Generator().manual_seed(5)
    centers = torch.randn(5, 20, generator=g) * 2
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))
    torch.manual_seed(0)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    compression = Compression(make(method, **options), scope="layer", error_feedback=ef, seed=3)
    buckets = GradBuckets(model.parameters(), bucket_mb=1.0, compression=compression)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gd = torch.Generator().manual_seed(1000 + rank)
    losses = []
    for _ in range(steps):
        y = torch.randint(0, 5, (32,), generator=gd)
        x = centers[y] + torch.randn(32, 20, generator=gd)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        buckets.finish()
        opt.step()
        opt.zero_grad(set_to_none=False)
        losses.append(loss.item())
    return sum(losses[:5]) / 5, sum(losses[-5:]) / 5


def main(out: Path, quick: bool) -> int:
    torch.set_num_threads(1)
    ctx = distributed.setup("cpu", timeout_s=60.0)
    r = ctx.rank
    try:
        results = {"reference": {s: averaged("none", {}, s, "sparse", r) for s in ("bucket",)}}
        for name, method, options in EXACT:
            for scope in SCOPES:
                results[("exact", name, scope)] = averaged(method, options, scope, "sparse", r)
        for name, method, options in BOTH:
            for scope in ("bucket",) if quick else SCOPES:
                for transport in ("sparse", "dense"):
                    results[(name, scope, transport)] = averaged(method, options, scope, transport, r)
        for scope in ("bucket",) if quick else SCOPES:
            results[("powersgd", scope)] = averaged("powersgd", {"rank": 1}, scope, "sparse", r, steps=3)
        # one step, so error feedback's residual is still 0: PowerSGD's result against the plain mean
        results["powersgd_1step"] = averaged("powersgd", {"rank": 2}, "layer", "sparse", r, steps=1)
        results["mean_1step"] = averaged("none", {}, "layer", "sparse", r, steps=1)
        # an empty selection on every rank, and on some ranks only (rank 0 selects nothing)
        results["empty"] = averaged("threshold", {"threshold": 1e9}, "layer", "sparse", r)
        results["empty_some"] = averaged("threshold", {"threshold": 1e9 if r == 0 else 0.05}, "bucket", "sparse", r)
        if not quick:
            results["learn"] = {name: learn(m, o, ef, r) for name, m, o, ef in LEARN}
        torch.save(results, out / f"rank{r}.pt")
        return 0
    finally:
        distributed.teardown(ctx)


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2:] == ["quick"]))
