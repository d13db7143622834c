"""fastcifar.run.step: the training step under --emulate-ranks N (N = 3, one process) against N ranks
simulated beside it: per-rank summed losses, gradients averaged as the all-reduce averages them,
each rank's optimizer. The whole trainer against real gloo ranks: tests/distributed/test_emulated_ranks.py."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from fastcifar.core.config import from_preset
from fastcifar.models.network import build_model, norm_layers
from fastcifar.ops.norm_act_pool import NormActPool
from fastcifar.run import recipe
from fastcifar.run.schedule import DeviceSchedule, lr_schedule
from fastcifar.run.step import make_step

CPU = torch.device("cpu")
CL = torch.channels_last


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


def _train(grads_to_none: bool, steps: int = 4, freeze_at: int = 2):
    """The default preset's step (FastNet, Muon + Nesterov SGD, weight decay) for ``steps`` steps,
    the whitening bias frozen from step ``freeze_at`` as ``run.whitening`` freezes it."""
    cfg = from_preset(widths=(8, 16, 16), batch_size=8, kernels="torch")
    torch.manual_seed(0)
    model = build_model(cfg, CPU, torch.float32)
    peak = recipe.peak_rate(cfg, cfg.batch_size)
    opt = recipe.make_optimizer(model, cfg, cfg.batch_size, peak)
    schedule = DeviceSchedule(lr_schedule(cfg, max(steps, 1), peak), CPU)
    step = make_step(model, opt, schedule, cfg.label_smoothing, grads_to_none=grads_to_none)
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        if i == freeze_at:
            opt.set_lr_scale("whiten_bias", 0.0)
            model.whiten.bias.requires_grad_(False)
        images = torch.randn(cfg.batch_size, 3, 32, 32, generator=g).contiguous(memory_format=CL)
        step(images, torch.randint(0, 10, (cfg.batch_size,), generator=g))
    return model, opt


def test_dropping_the_gradients_trains_the_same_weights_bit_for_bit():
    """--grads-to-none: backward's gradients handed over instead of added to zeroed ones (0 + g is
    g), across the whitening bias's freeze: every weight, buffer and momentum equal."""
    zeroed, opt_zeroed = _train(False)
    dropped, opt_dropped = _train(True)
    start = _train(False, steps=0)[0]
    for (name, p), q, p0 in zip(zeroed.named_parameters(), dropped.parameters(), start.parameters(), strict=True):
        assert torch.equal(p, q), name
        if p0.requires_grad:  # trained (the whitening weight and the norms' scales are frozen)
            assert not torch.equal(p, p0), f"{name} did not move: the comparison proves nothing"
    for (name, b), c in zip(zeroed.named_buffers(), dropped.buffers(), strict=True):
        assert torch.equal(b, c), name

    def tensors(opt):  # the optimizer's momentum buffers, in its state_dict's order
        return [t for t in torch.utils._pytree.tree_leaves(opt.state_dict()) if isinstance(t, torch.Tensor)]

    momenta = list(zip(tensors(opt_zeroed), tensors(opt_dropped), strict=True))
    assert momenta and all(torch.equal(a, b) for a, b in momenta)
    # dropped: the trained weights' gradients are gone, the frozen bias keeps a zero one
    assert dropped.blocks[0].conv1.conv.weight.grad is None and dropped.fc.weight.grad is None
    assert torch.equal(dropped.whiten.bias.grad, torch.zeros_like(dropped.whiten.bias))
    assert zeroed.fc.weight.grad is not None  # in place: kept, zeroed


def test_a_frozen_parameters_zero_gradient_is_made_once():
    """A graph captured while the bias is frozen reads its gradient at one address: dropped and
    frozen again, the bias gets the same tensor back."""
    from fastcifar.run.step import GradReset

    net = torch.nn.Linear(3, 2)
    reset = GradReset(net)
    net.bias.requires_grad_(False)
    reset.before()
    first = net.bias.grad
    net.bias.requires_grad_(True)
    reset.after()
    assert net.bias.grad is None
    net.bias.requires_grad_(False)
    reset.before()
    assert net.bias.grad is first and net.weight.grad is None
