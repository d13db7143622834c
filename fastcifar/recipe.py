"""The recipe's levers that reach into a run, kept out of train.py's story.

- ``make_network``: the ``--arch`` network from a ``norm`` block factory (``NormActPool`` or the
  Triton drop-in), batchnorm momentum and frozen scales, a frozen whitening conv;
- ``param_groups``: the optimizer's groups: weights; batchnorm shifts at ``bias_lr_scale`` x the
  rate (and weight decay / that, so the decay per step stays); the whitening bias, which
  ``RunHooks`` freezes after ``whiten_bias_epochs`` by setting its group's rate to 0;
- ``RunHooks``: what happens at epoch starts and ends and after each step: the data-dependent
  whitening init, the whitening-bias freeze, lookahead.

Timing (DAWNBench): the whitening init reads training images, so it is part of training and runs
on the clock, at the start of epoch 0 (as airbench counts it). It costs one pass over 5000 images'
2x2 patches, a 12x12 eigendecomposition and, with several ranks, one all-reduce and one broadcast.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from .alexnet import AlexNet
from .averaging import Lookahead
from .fastnet import FastNet, init_whitening
from .model import ResNet9


def norm_layers(model: nn.Module) -> list[nn.Module]:
    """The batchnorm-like blocks: anything with running statistics and a scale/shift (NormActPool,
    its Triton drop-in, plain BatchNorm)."""
    return [m for m in model.modules()
            if hasattr(m, "running_mean") and isinstance(getattr(m, "weight", None), nn.Parameter)]


def make_network(cfg, norm, num_classes: int = 10) -> nn.Module:
    norm = functools.partial(norm, momentum=cfg.bn_momentum)
    if cfg.arch == "resnet9":
        model = ResNet9(num_classes, widths=cfg.widths, norm=norm)
    elif cfg.arch == "alexnet":
        model = AlexNet(num_classes, widths=cfg.widths, norm=norm)
    elif cfg.arch == "fastnet":
        model = FastNet(num_classes, widths=cfg.widths, norm=norm, whiten_kernel=cfg.whiten_kernel)
        model.whiten.weight.requires_grad_(not cfg.whiten_frozen)
    else:
        raise ValueError(f"unknown arch {cfg.arch!r}")
    if cfg.bn_scale_frozen:
        for m in norm_layers(model):
            m.weight.requires_grad_(False)  # stays at its init, 1: the next conv's scale absorbs it
    return model


def param_groups(model: nn.Module, cfg, per_rank_batch: int) -> list[dict]:
    """NesterovSGD groups; weight decay per the summed loss (x per-rank batch, see config.py)."""
    wd = cfg.weight_decay * per_rank_batch
    shifts = [m.bias for m in norm_layers(model)]
    whiten_bias = [model.whiten.bias] if isinstance(model, FastNet) else []
    special = {id(p) for p in shifts + whiten_bias}
    weights = [p for p in model.parameters() if id(p) not in special]
    return [{"name": "weights", "params": weights, "weight_decay": wd},
            {"name": "bn_shifts", "params": shifts, "lr_scale": cfg.bias_lr_scale,
             "weight_decay": wd / cfg.bias_lr_scale},
            {"name": "whiten_bias", "params": whiten_bias, "weight_decay": wd}]


class RunHooks:
    """Per-run recipe steps the training loop calls: ``epoch_start`` (on the clock),
    ``after_step`` and ``epoch_end`` (before the clock stops)."""

    def __init__(self, cfg, model: nn.Module, opt, train_loader, ctx):
        self.cfg, self.model, self.opt, self.loader, self.ctx = cfg, model, opt, train_loader, ctx
        self.lookahead: Lookahead | None = None

    def epoch_start(self, epoch: int) -> None:
        cfg, model = self.cfg, self.model
        if epoch == 0 and isinstance(model, FastNet) and cfg.whiten_images:
            self.init_whitening()
        if isinstance(model, FastNet) and epoch == cfg.whiten_bias_epochs:
            self.opt.set_lr_scale("whiten_bias", 0.0)  # frozen from here: no step, no decay
        if epoch == 0 and cfg.lookahead_steps:  # after the data init: the slow copy starts from it
            self.lookahead = self._new_lookahead()

    def after_step(self) -> None:
        if self.lookahead is not None:
            self.lookahead.step()

    def epoch_end(self, epoch: int) -> None:
        if epoch == self.cfg.epochs - 1 and self.lookahead is not None:
            self.lookahead.finish()

    def _new_lookahead(self) -> Lookahead:
        cfg = self.cfg
        return Lookahead(self.model, cfg.lookahead_steps, cfg.lookahead_decay, cfg.epochs * len(self.loader))

    def state_dict(self) -> dict:
        """What the hooks carry between epochs (the lookahead's slow copy): for checkpoints."""
        return {"lookahead": None if self.lookahead is None else self.lookahead.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Resume after a checkpoint: the hooks of later epochs then act as in an unbroken run
        (the whitening conv's weights and the bias freeze live in the model and optimizer state)."""
        self.lookahead = None
        if state["lookahead"] is not None:
            self.lookahead = self._new_lookahead()
            self.lookahead.load_state_dict(state["lookahead"])

    def init_whitening(self) -> None:
        """Whitening weights from the first ``whiten_images`` training images (un-augmented), split
        over the ranks; the covariance sums are all-reduced and rank 0's weights broadcast, so every
        rank holds the same bits."""
        ctx = self.ctx
        per_rank = math.ceil(self.cfg.whiten_images / ctx.world_size)
        images = self.loader.plain_images(per_rank)
        reduce = None
        if ctx.distributed:
            import torch.distributed as dist
            reduce = dist.all_reduce
        init_whitening(self.model.whiten, images, reduce=reduce)
        if ctx.distributed:
            torch.distributed.broadcast(self.model.whiten.weight.data, src=0)
