"""One rank of the local SGD tests; test_sparse_train.py starts two with torchrun (gloo, CPU).

    python tests/helpers/sparse_worker.py equivalence disjoint grad_mask_change grad_mask_change_disjoint
        equivalence: H=1, a full mask, mean merge == dense data parallel (bucketed gradient averaging)
        disjoint: disjoint masks, H=2, sum merge, momentum reset: what each merge must leave
        grad_mask_change: SparseRun as the trainer drives it, --sparse-update grad, a new mask every
            epoch, H=2, momentum kept: the ranks hold the same weights after each epoch's last merge
        grad_mask_change_disjoint: the same with each rank's own mask (disjoint layout)

The trainer's conventions: loss summed over the rank's batch, NesterovSGD with the recipe's groups.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fastcifar.core.config import from_preset
from fastcifar.models.network import make_network
from fastcifar.ops.norm_act_pool import NormActPool
from fastcifar.parallel import distributed
from fastcifar.parallel.comm import GradBuckets
from fastcifar.parallel.local_sgd import LocalSGD
from fastcifar.run.optim import NesterovSGD
from fastcifar.run.recipe import param_groups
from fastcifar.run.sparse import masks
from fastcifar.run.sparse.fisher import trainable
from fastcifar.run.sparse.run import SparseRun
from fastcifar.run.sparse.update import MaskedOptimizer

PER_RANK, STEPS = 4, 4


def setup():
    torch.manual_seed(0)
    cfg = from_preset("resnet9", widths=(4, 8, 8, 8))
    model = make_network(cfg, NormActPool).to(memory_format=torch.channels_last)
    opt = NesterovSGD(
        param_groups(model, cfg, PER_RANK), lr=0.02, momentum=0.9, weight_decay=cfg.weight_decay * PER_RANK
    )
    return model, opt


def batches(rank):
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    for _ in range(STEPS):
        x = torch.randn(PER_RANK, 3, 32, 32, generator=g).contiguous(memory_format=torch.channels_last)
        yield x, torch.randint(0, 10, (PER_RANK,), generator=g)


def step(model, opt, x, y, buckets=None):
    F.cross_entropy(model(x), y, reduction="sum").backward()
    if buckets is not None:
        buckets.finish()
    opt.step()
    opt.zero_grad()


def equivalence(ctx):
    dense, dense_opt = setup()
    buckets = GradBuckets(dense.parameters(), 2.0)
    for x, y in batches(ctx.rank):
        step(dense, dense_opt, x, y, buckets)
    model, opt = setup()
    params = trainable(model)
    opt = MaskedOptimizer(opt, params, "full")
    full = masks.top_k({n: torch.rand(p.shape) for n, p in params.items()}, 1.0, masks.forced_names(model, True))
    assert masks.count(full) == sum(p.numel() for p in params.values())
    opt.set_masks(full)
    local = LocalSGD(
        params,
        list(model.buffers()),
        opt,
        every=1,
        merge="mean",
        momentum="keep",
        world_size=ctx.world_size,
        rank=ctx.rank,
    )
    local.set_masks([full])
    for x, y in batches(ctx.rank):
        step(model, opt, x, y)
        local.after_step()
    assert local.merges == STEPS
    worst = 0.0
    for (n, a), b in zip(dense.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=f"rank {ctx.rank} {n}")
        worst = max(worst, float((a - b).detach().abs().max()))
    moved = sum(float((a - b).abs().sum()) for a, b in zip(dense.parameters(), setup()[0].parameters(), strict=True))
    assert moved > 1e-2, "training did not move the weights: the comparison would prove nothing"
    print(f"rank {ctx.rank} equivalence ok, max |dense - local| {worst:.2e}")


def disjoint(ctx):
    model, opt = setup()
    params = trainable(model)
    init = {n: p.detach().clone() for n, p in params.items()}
    opt = MaskedOptimizer(opt, params, "full")
    forced = masks.forced_names(model, True)
    scores = {n: torch.rand(p.shape, generator=torch.Generator().manual_seed(7)) for n, p in params.items()}
    dealt = masks.deal(scores, 0.05, forced, ctx.world_size)
    opt.set_masks(dealt[ctx.rank])
    local = LocalSGD(
        params,
        list(model.buffers()),
        opt,
        every=2,
        merge="sum",
        momentum="reset",
        world_size=ctx.world_size,
        rank=ctx.rank,
    )
    local.set_masks(dealt, shared=forced)
    for i, (x, y) in enumerate(batches(ctx.rank)):
        step(model, opt, x, y)
        if (i + 1) % 2 == 0:
            before = {n: p.detach().clone() for n, p in params.items()}
            everyone = [None] * ctx.world_size
            dist.all_gather_object(everyone, before)
        local.after_step()
        if (i + 1) % 2:
            continue
        for n, p in params.items():
            p = p.detach()
            mine = [torch.zeros_like(p) for _ in range(ctx.world_size)]
            dist.all_gather(mine, p.contiguous())
            assert all(torch.equal(mine[0], m) for m in mine), f"ranks differ after a merge: {n}"
            anywhere = torch.stack([m[n] for m in dealt]).any(0)
            assert torch.equal(p[~anywhere], init[n][~anywhere]), f"an entry outside every mask moved: {n}"
            if n in forced:
                continue
            for r in range(ctx.world_size):
                own = dealt[r][n]
                torch.testing.assert_close(p[own], everyone[r][n][own], rtol=1e-6, atol=1e-7)
        assert all(float(b.abs().sum()) == 0 for bufs in opt.opt.buffers for b in bufs), "momentum was not reset"
    print(f"rank {ctx.rank} disjoint ok, {local.describe()}")


def grad_mask_change(ctx, layout="shared"):
    """An entry that leaves the mask keeps moving under --sparse-update grad (decay and momentum)
    and the merges no longer cover it: it stays equal on every rank only if its momentum does.
    Entries some rank's new mask covers (any rank's, in the disjoint layout) keep their momentum."""
    model, opt = setup()
    cfg = from_preset(
        "resnet9",
        widths=(4, 8, 8, 8),
        sparse_mask="random",
        sparse_fraction=0.05,
        sparse_update="grad",
        mask_every=1,
        local_steps=2,
        merge="mean",
        local_momentum="keep",
        mask_layout=layout,
    )
    log = SimpleNamespace(dir=None, meta={}, line=lambda text: None)
    run = SparseRun(cfg, model, opt, None, ctx, log, run=1, seed=0)  # random masks: no loader read
    start = {n: p.detach().clone() for n, p in run.params.items()}
    for epoch in range(3):
        bufs = [b for group in run.optimizer.opt.buffers for b in group]
        before = [b.clone() for b in bufs]
        run.epoch_start(epoch)  # a new random mask every epoch (seed * 1000 + epoch)
        if epoch > 0:  # the mask changed: momentum is equal outside every mask, each rank's own inside
            inside = outside = 0.0
            others = 0  # entries another rank's mask covers and this rank's does not
            for name, b, b0 in zip(run.optimizer.buffer_names, bufs, before, strict=True):
                every = [torch.zeros_like(b) for _ in range(ctx.world_size)]
                dist.all_gather(every, b.contiguous())
                gap = (every[0] - every[1]).abs()
                m = run.optimizer.masks[name].bool()  # this rank's own mask
                masks_everywhere = [torch.zeros_like(m) for _ in range(ctx.world_size)]
                dist.all_gather(masks_everywhere, m.contiguous())
                covered = torch.stack(masks_everywhere).any(0)
                others += int((covered & ~m).sum())
                assert torch.equal(b[covered], b0[covered]), (
                    f"epoch {epoch}: momentum of {name} inside a rank's new mask changed at the mask change"
                )
                inside = max(inside, float(torch.where(m, gap, 0).max()))
                outside = max(outside, float(torch.where(covered, 0, gap).max()))
            if layout == "disjoint":
                assert others > 0, "the ranks' masks coincide: the layout would prove nothing"
            assert outside == 0, f"epoch {epoch}: momentum outside every mask differs by {outside:.3e}"
            assert inside > 0, f"epoch {epoch}: momentum inside the mask was averaged (--local-momentum keep)"
        for x, y in batches(ctx.rank):
            step(model, run.optimizer, x, y)
            run.after_step()
        run.epoch_end(epoch)
        for n, p in run.params.items():
            p = p.detach().contiguous()
            every = [torch.zeros_like(p) for _ in range(ctx.world_size)]
            dist.all_gather(every, p)
            worst = max(float((every[0] - q).abs().max()) for q in every)
            assert worst == 0, f"epoch {epoch}: ranks differ after the merge in {n} by up to {worst:.3e}"
    assert len(run.record["masks"]) == 3 and run.local.merges == 6  # 2 per epoch: after steps 2 and 4
    moved = sum(float((p.detach() - start[n]).abs().sum()) for n, p in run.params.items())
    assert moved > 1e-2, "training did not move the weights: the comparison would prove nothing"
    print(f"rank {ctx.rank} grad_mask_change {layout} ok")


def main(argv):
    torch.set_num_threads(1)
    ctx = distributed.setup("cpu", timeout_s=60.0)
    try:
        for mode in argv:
            {
                "equivalence": equivalence,
                "disjoint": disjoint,
                "grad_mask_change": grad_mask_change,
                "grad_mask_change_disjoint": lambda ctx: grad_mask_change(ctx, "disjoint"),
            }[mode](ctx)
        return 0
    finally:
        distributed.teardown(ctx)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
