"""``--emulate-ranks N`` in one process, piece by piece against N ranks simulated beside it: the
loader (each rank's shard and draws), the batchnorm (each rank's statistics), and a few training
steps of the default preset (per-rank summed losses, gradients averaged as the all-reduce averages
them, each rank's optimizer). N = 3: unequal shards, and a rank count whose 1/N is not exact in
binary. The whole trainer against real gloo ranks: tests/distributed/test_emulated_ranks.py."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import one_line_error

from fastcifar.core.config import ConfigError, from_preset, validate
from fastcifar.data import shard_indices
from fastcifar.data.dali import dali_available
from fastcifar.data.loader import EmulatedRanks
from fastcifar.data.train_loader import make_train_loader
from fastcifar.models.network import build_model, norm_layers
from fastcifar.ops.augment import AugmentSpec
from fastcifar.ops.norm_act_pool import NormActPool, PerRankStatistics, per_rank
from fastcifar.run import recipe
from fastcifar.run.schedule import DeviceSchedule, lr_schedule
from fastcifar.run.step import make_step

CPU = torch.device("cpu")
CL = torch.channels_last
AUGMENT = dict(
    augment=AugmentSpec(crop_pad=2, pad_mode="reflect", cutout=4, flip=True, flip_mode="alternate"),
    dtype=torch.float32,
    device=CPU,
)


def _data(n=101, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8), rng.integers(0, 10, n).astype(np.int64)


@pytest.mark.parametrize(
    "name",
    [
        "torch",
        pytest.param("dali", marks=pytest.mark.skipif(not dali_available()[0], reason="DALI does not import here")),
    ],
)
def test_emulated_ranks_loader_is_each_ranks_loader_side_by_side(name):
    """101 images over 3 ranks: shards of 34, 34 and 33; each step's batch is rank 0's, 1's and 2's
    as their own loaders (own shard, own seed per rank and epoch) give them, bit for bit."""
    images, labels = _data()
    ranks, per_rank_batch, steps = 3, 10, 3
    emulated = make_train_loader(
        name,
        images,
        labels,
        shard_indices(101, 0, 1),
        ranks * per_rank_batch,
        steps,
        kernels="torch",
        emulate_ranks=ranks,
        rank=0,
        **AUGMENT,
    )
    alone = [
        make_train_loader(
            name,
            images,
            labels,
            shard_indices(101, r, ranks),
            per_rank_batch,
            steps,
            kernels="torch",
            rank=r,
            **AUGMENT,
        )
        for r in range(ranks)
    ]
    assert all(type(loader) is type(alone[0]) for loader in emulated.loaders)
    assert isinstance(emulated, EmulatedRanks) and emulated.batch_size == 30 and len(emulated) == steps
    for epoch in (0, 1):  # the alternating flip mirrors every other epoch
        emulated.set_epoch(7, epoch)
        for loader in alone:
            loader.set_epoch(7, epoch)
        if epoch:
            emulated.prepare(7, epoch)  # drawn ahead, as the trainer does
        batches = list(emulated)
        assert len(batches) == steps
        for step, (images_e, labels_e), *parts in zip(range(steps), batches, *alone, strict=False):
            assert torch.equal(images_e, torch.cat([p[0] for p in parts])), f"epoch {epoch} step {step}"
            assert torch.equal(labels_e, torch.cat([p[1] for p in parts]))
    emulated.set_epoch(7, 0)
    assert len(list(emulated.first(2))) == 2  # a fractional last epoch stops every rank after 2 steps
    # the whitening init: each rank's first ceil(50 / 3) = 17 images, as each rank reads them
    want = torch.cat([loader.plain_images(17) for loader in alone])
    assert torch.equal(emulated.plain_images(50), want)
    assert not torch.equal(want, alone[0].plain_images(51)), "the test needs the ranks' images to differ"


def _per_rank_reference(norms, x, dy):
    """Each rank's block on its chunk: outputs and gradients side by side."""
    outs, grads = [], []
    for norm, chunk, d in zip(norms, x.chunk(len(norms)), dy.chunk(len(norms)), strict=True):
        chunk = chunk.detach().clone().requires_grad_()
        y = norm(chunk)
        y.backward(d)
        outs.append(y.detach())
        grads.append(chunk.grad)
    return torch.cat(outs), torch.cat(grads)


@pytest.mark.parametrize("momentum", [0.4, None], ids=["momentum", "cumulative"])
def test_emulated_ranks_batchnorm_keeps_each_ranks_statistics(momentum):
    """The per-rank block normalizes each rank's chunk alone (output and input gradient exactly
    the rank's own block's: the same kernel on the same chunk), and its running statistics after
    several steps are the average of the ranks' own, which is what average_buffers leaves after an
    epoch; in eval mode it is the plain block."""
    torch.manual_seed(0)
    ranks = 3
    block = per_rank(NormActPool, ranks)(6, act="gelu", pool="before", momentum=momentum)
    assert isinstance(block, PerRankStatistics) and isinstance(block, NormActPool) and block.ranks == ranks
    assert per_rank(NormActPool, 1) is NormActPool
    alone = [NormActPool(6, act="gelu", pool="before", momentum=momentum) for _ in range(ranks)]
    for norm in [block, *alone]:
        with torch.no_grad():
            norm.weight.copy_(torch.linspace(0.5, 1.5, 6))
            norm.bias.copy_(torch.linspace(-0.2, 0.3, 6))
    for step in range(3):
        x = (torch.randn(3 * 4, 6, 8, 8) * (1 + step) + torch.arange(12.0).view(12, 1, 1, 1)).contiguous(
            memory_format=CL
        )
        dy = torch.randn(12, 6, 4, 4).contiguous(memory_format=CL)
        want_y, want_dx = _per_rank_reference(alone, x, dy)
        xx = x.clone().requires_grad_()
        y = block(xx)
        y.backward(dy)
        assert torch.equal(y, want_y) and torch.equal(xx.grad, want_dx), f"step {step}"
        assert not torch.allclose(y, NormActPool(6, act="gelu", pool="before")(x), atol=1e-3), (
            "the ranks' chunks must differ from the whole batch (the test would prove nothing)"
        )
        for name in ("running_mean", "running_var"):
            mean = torch.stack([getattr(n, name) for n in alone]).mean(0)
            torch.testing.assert_close(getattr(block, name), mean, rtol=1e-6, atol=1e-7, msg=name)
    assert int(block.num_batches_tracked) == 3 == int(alone[0].num_batches_tracked)
    block.eval()
    plain = NormActPool(6, act="gelu", pool="before", momentum=momentum).eval()
    plain.load_state_dict(block.state_dict())
    x = torch.randn(6, 6, 8, 8).contiguous(memory_format=CL)
    assert torch.equal(block(x), plain(x))
    with pytest.raises(ValueError, match="does not split over 3 emulated ranks"):
        block.train()(torch.randn(4, 6, 8, 8))


@pytest.mark.slow  # over 2 s on 2 cores
def test_emulated_ranks_steps_equal_ranks_averaging_their_gradients():
    """Three steps of the default preset (FastNet, Muon on the filters, Nesterov SGD on the rest,
    weight decay) in the trainer's step, emulated over 3 ranks, against 3 ranks simulated here:
    each its own plain network and optimizer (at the per-rank batch: rate and decay scaled as
    on a rank), each summing the loss of its own 8 images, the gradients averaged as comm.py
    averages them (summed, then divided by 3 once). fp32: only the summation order differs."""
    ranks, per_rank_batch = 3, 8
    cfg = from_preset(widths=(8, 16, 16), batch_size=ranks * per_rank_batch, kernels="torch")
    steps = 3
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(cfg, emulate_ranks=ranks), CPU, torch.float32)
    replicas = [copy.deepcopy(model) for _ in range(ranks)]
    for replica in replicas:  # plain blocks: each rank normalizes only its own images anyway
        for m in norm_layers(replica):
            m.__class__ = NormActPool
    peak = recipe.peak_rate(cfg, cfg.batch_size)
    opt = recipe.make_optimizer(model, cfg, cfg.batch_size, peak)
    step = make_step(model, opt, DeviceSchedule(lr_schedule(cfg, steps, peak), CPU), cfg.label_smoothing)
    rank_peak = recipe.peak_rate(cfg, per_rank_batch)
    rank_opts = [recipe.make_optimizer(r, cfg, per_rank_batch, rank_peak) for r in replicas]
    rank_schedules = [DeviceSchedule(lr_schedule(cfg, steps, rank_peak), CPU) for _ in replicas]
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        images = torch.randn(cfg.batch_size, 3, 32, 32, generator=g).contiguous(memory_format=CL)
        labels = torch.randint(0, 10, (cfg.batch_size,), generator=g)
        step(images, labels)
        for replica, opt_r, sched, x, y in zip(
            replicas, rank_opts, rank_schedules, images.chunk(ranks), labels.chunk(ranks), strict=True
        ):
            sched.apply(opt_r.lr)
            F.cross_entropy(replica(x), y, reduction="sum", label_smoothing=cfg.label_smoothing).backward()
        for params in zip(*(r.parameters() for r in replicas), strict=True):
            if params[0].grad is not None:
                mean = sum(p.grad for p in params) / ranks
                for p in params:
                    p.grad.copy_(mean)
        for opt_r in rank_opts:
            opt_r.step()
            opt_r.zero_grad()
    moved = 0.0
    torch.manual_seed(0)
    start = build_model(cfg, CPU, torch.float32)  # the same seed's initial weights
    for (name, p), q, p0 in zip(model.named_parameters(), replicas[0].parameters(), start.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
        moved = max(moved, (p - p0).abs().max().item())
    assert moved > 1e-2, "the steps must move the weights (else the comparison proves nothing)"
    for name, buf in model.named_buffers():
        if buf.is_floating_point():  # what average_buffers leaves after the epoch
            mean = torch.stack([dict(r.named_buffers())[name] for r in replicas]).mean(0)
            torch.testing.assert_close(buf, mean, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "overrides, world_size, message",
    [
        ({"emulate_ranks": 2}, 2, "--emulate-ranks 2 emulates ranks in one process, but this run has 2 real ranks"),
        (
            {"emulate_ranks": 2, "compress": "topk"},
            1,
            "does not combine with --compress, --sparse-mask or --local-steps",
        ),
        ({"emulate_ranks": 2, "preset": "resnet9", "local_steps": 4}, 1, "does not combine with --compress"),
        ({"emulate_ranks": 3, "batch_size": 100}, 1, "--batch-size 100 does not divide over 3 ranks"),
        ({"emulate_ranks": 0}, 1, "--emulate-ranks must lie in 1..1024, not 0"),
    ],
)
def test_emulated_ranks_refusals(overrides, world_size, message):
    preset = overrides.pop("preset", "fast-muon320")
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        validate(from_preset(preset, **overrides), world_size)
    validate(from_preset(emulate_ranks=1), world_size=2)  # 1 is off: any launch


def test_emulated_ranks_refusal_on_the_command_line_is_one_line(tmp_path, capfd):
    from fastcifar.train import main

    code = main(
        [
            "--data",
            str(tmp_path / "absent"),
            "--out-dir",
            str(tmp_path / "runs"),
            "--device",
            "cpu",
            "--emulate-ranks",
            "3",
            "--batch-size",
            "100",
        ]
    )
    assert code == 2
    assert "does not divide over 3 ranks" in one_line_error(capfd.readouterr().err)
    assert not (tmp_path / "runs").exists()
