"""The `fast` preset on two CPU ranks (gloo): the whitening init agrees across ranks, and it learns."""

from __future__ import annotations

import textwrap

import pytest
from cli import FAST_SHORT, run_dirs, run_train, summary_of, torchrun

pytestmark = pytest.mark.slow


CHECK = textwrap.dedent("""
    import sys
    import numpy as np
    import torch
    import torch.distributed as dist
    from fastcifar.parallel import distributed
    from fastcifar.core.config import from_preset
    from fastcifar.data import shard_indices
    from fastcifar.data.loader import TorchLoader
    from fastcifar.ops.augment import AugmentSpec
    from fastcifar.ops.norm_act_pool import NormActPool
    from fastcifar.run.optim import NesterovSGD
    from fastcifar.run.recipe import param_groups
    from fastcifar.run.whitening import Whitening
    from fastcifar.models.network import make_network

    ctx = distributed.setup("cpu")
    cfg = from_preset("fast", widths=(8, 16, 16), whiten_images=60)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (80, 32, 32, 3), dtype=np.uint8)
    images[ctx.rank::2] //= 2  # the ranks' shards differ: only the all-reduce makes them agree
    shard = shard_indices(80, ctx.rank, ctx.world_size)
    loader = TorchLoader(images, np.zeros(80, np.int64), shard, 10, 2,
                         augment=AugmentSpec(crop_pad=2, pad_mode="reflect", cutout=0, flip=True),
                         dtype=torch.float32, device=ctx.device, rank=ctx.rank)
    torch.manual_seed(0)
    model = make_network(cfg, NormActPool)
    opt = NesterovSGD(param_groups(model, cfg, 10), lr=0.0)
    alone = make_network(cfg, NormActPool)
    from fastcifar.models.fastnet import init_whitening
    init_whitening(alone.whiten, loader.plain_images(30))  # this rank's images only
    Whitening(cfg, model, opt, loader, ctx).epoch_start(0)
    mine = model.whiten.weight.detach().clone()
    both = [torch.empty_like(mine) for _ in range(2)]
    dist.all_gather(both, mine)
    assert torch.equal(both[0], both[1]), "ranks disagree"
    assert not torch.allclose(mine, alone.whiten.weight), "the weights must come from both ranks' images"
    print(f"rank {ctx.rank} ok")
    distributed.teardown(ctx)
""")


def test_whitening_weights_are_the_same_on_every_rank(tmp_path):
    script = tmp_path / "check.py"
    script.write_text(CHECK)
    proc = run_train([], launcher=torchrun(str(script)), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0 ok" in proc.stdout and "rank 1 ok" in proc.stdout


def test_two_ranks_fast_preset_learns(learnable_data, tmp_path):
    out = tmp_path / "runs"
    proc = run_train(
        ["--data", learnable_data, "--out-dir", out, *FAST_SHORT, "--epochs", "2", "--warmup-epochs", "0.5"],
        launcher=torchrun(),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(run_dirs(out)) == 1
    s = summary_of(out)
    assert s["device"]["world_size"] == 2 and s["per_rank_batch"] == 50 and s["config"]["preset"] == "fast"
    assert s["summary"]["acc_mean"] > 60.0
