"""The recipe's levers that reach into a run, kept out of train.py's story.

- ``peak_rate``: the schedule's top rate for a rank's summed loss (the trainer's and bench_step's);
- ``param_groups``: the optimizer's groups: weights; batchnorm shifts at ``bias_lr_scale`` x the
  rate (and weight decay / that, so the decay per step stays); the head at ``head_lr_scale``; the
  whitening bias, which ``RunHooks`` freezes after ``whiten_bias_epochs`` by setting its group's
  rate to 0; with ``--optimizer muon`` the conv filters, which ``make_optimizer`` gives to Muon;
- ``RunHooks``: what happens at epoch starts and ends and after each step: the data-dependent
  whitening init, the whitening-bias freeze (which also ends backward at the whitening conv, a
  second captured step), lookahead.

Timing (DAWNBench): the whitening init reads training images, so it is part of training and runs
on the clock, at the start of epoch 0 (as airbench counts it). It costs one pass over 5000 images'
2x2 patches, a 12x12 eigendecomposition and, with several ranks, one all-reduce and one broadcast.
"""

from __future__ import annotations

import copy
import functools
import itertools
import math

import torch
from torch import nn

from fastcifar.core import gpu
from fastcifar.models.fastnet import FastNet, init_whitening
from fastcifar.models.network import norm_layers
from fastcifar.run.averaging import Lookahead
from fastcifar.run.component import Component
from fastcifar.run.optim import Muon, MuonSGD, NesterovSGD
from fastcifar.run.schedule import epoch_lengths


def peak_rate(cfg, per_rank_batch: int) -> float:
    """The schedule's top rate per image of a rank's summed loss: ``lr`` scaled to the global batch
    (config.py's rule, ``lr * batch_size / 512``), divided by the per-rank batch the loss sums over."""
    return cfg.lr * cfg.batch_size / 512 / per_rank_batch


def param_groups(model: nn.Module, cfg, per_rank_batch: int) -> list[dict]:
    """NesterovSGD groups; weight decay per the summed loss (x per-rank batch, see config.py).
    With ``--optimizer muon`` the trainable conv filters form a last group, "filters", for Muon."""
    wd = cfg.weight_decay * per_rank_batch
    shifts = [m.bias for m in norm_layers(model)]
    whiten_bias = [model.whiten.bias] if isinstance(model, FastNet) else []
    head = [model.fc.weight]
    filters = [p for p in model.parameters() if p.dim() == 4 and p.requires_grad] if cfg.optimizer == "muon" else []
    special = {id(p) for p in shifts + whiten_bias + head + filters}
    weights = [p for p in model.parameters() if id(p) not in special]
    groups = [
        {"name": "weights", "params": weights, "weight_decay": wd},
        {"name": "head", "params": head, "lr_scale": cfg.head_lr_scale, "weight_decay": wd / cfg.head_lr_scale},
        {"name": "bn_shifts", "params": shifts, "lr_scale": cfg.bias_lr_scale, "weight_decay": wd / cfg.bias_lr_scale},
        {"name": "whiten_bias", "params": whiten_bias, "weight_decay": wd},
    ]
    if filters:
        groups.append({"name": "filters", "params": filters})
    return groups


def make_optimizer(model: nn.Module, cfg, per_rank_batch: int, peak: float, ctx=None):
    """``NesterovSGD`` over ``param_groups`` or, with ``--optimizer muon``, ``MuonSGD``: Muon on
    the filters at ``muon_lr`` x (the scheduled rate / ``peak``), Newton-Schulz in the device's
    precision (``core.gpu.newton_schulz_dtype``: bfloat16 from capability 8.0, float16 below, fp32
    on the CPU)."""
    groups = param_groups(model, cfg, per_rank_batch)
    filters = [g for g in groups if g["name"] == "filters"]
    # no weight_decay argument: every group of param_groups carries its own
    sgd = NesterovSGD(
        [g for g in groups if g["name"] != "filters"], lr=0.0, momentum=cfg.momentum, nesterov=cfg.nesterov
    )
    if not filters:
        return sgd
    device = filters[0]["params"][0].device
    shard, reduce = (0, 1), None
    if ctx is not None and ctx.distributed and cfg.muon_shard:
        import torch.distributed as dist

        shard, reduce = (ctx.rank, ctx.world_size), dist.all_reduce
    muon = Muon(
        filters[0]["params"],
        sgd.lr,
        cfg.muon_lr / peak,
        momentum=cfg.muon_momentum,
        ns_steps=cfg.muon_ns_steps,
        ns_dtype=gpu.newton_schulz_dtype(device),
        shard=shard,
        reduce=reduce,
    )
    return MuonSGD(sgd, muon)


def first_steps(loader, n: int):
    """The loader's first ``n`` batches: the loader itself for a whole epoch, so its iterator runs
    to its end (DALI finishes its pass there; a pass left suspended is drained by the next one)."""
    return loader if n >= len(loader) else itertools.islice(loader, n)


class RunHooks(Component):
    """Per-run recipe steps the training loop calls: ``warm_up`` (off the clock), ``epoch_start`` (on
    the clock), ``after_step`` and ``epoch_end`` (before the clock stops), ``finish`` (after the run).
    ``step``: the run's ``graphs.TrainStep``, told when the bias freeze changes what backward does."""

    WHITEN_BIAS_FROZEN = "whiten-bias-frozen"  # the TrainStep variant after the freeze

    def __init__(self, cfg, model: nn.Module, opt, train_loader, ctx, step=None):
        self.cfg, self.model, self.opt, self.loader, self.ctx, self.step = cfg, model, opt, train_loader, ctx, step
        self.lookahead: Lookahead | None = None
        self.whiten_bias_frozen = False

    @property
    def stops_backward_at_whitening(self) -> bool:
        """Whether the bias freeze also ends backward at the whitening conv: with its weights
        frozen too, nothing below the first block then needs a gradient, so the first block's
        input-gradient conv (27 GFLOP per 1024 images in `fast`), the GELU's backward and the bias's
        reduction drop out of the step (332 of `fast`'s 476 steps); the weights come out the same,
        as the frozen bias took no step anyway. Not under DDP, which fails a step in which a
        parameter gets no gradient (the gradient buckets switch to a plan without the frozen bias), nor
        with ``--sparse-mask``, whose masks cover the parameters that trained at the start: a Fisher
        recompute after the freeze would score one parameter fewer."""
        cfg = self.cfg
        ddp = self.ctx.distributed and cfg.comm == "ddp" and not cfg.local_steps
        return isinstance(self.model, FastNet) and cfg.whiten_frozen and not ddp and cfg.sparse_mask == "none"

    def warm_up(self, warmup_iters: int) -> None:
        """Off the clock, before the caller restores the model's state, the first-time work of what
        the hooks do on it: capture the step as it runs after the bias freeze (the freeze then
        switches graphs instead of capturing on the clock), and whiten random images into a
        scratch copy of the whitening conv, so the first run's whitening init does not pay for
        loading cuSOLVER's eigensolver and the float64 kernels (the first run's epoch 1 was
        markedly slower than later runs' without it: bench/results/visits/visit-2.md, 2c)."""
        if isinstance(self.model, FastNet) and self.cfg.whiten_images:
            conv = copy.deepcopy(self.model.whiten)
            n, device = math.ceil(self.cfg.whiten_images / self.ctx.world_size), conv.weight.device
            noise = torch.Generator(device).manual_seed(0)  # its own: the run's random streams stay as they were
            init_whitening(
                conv,
                torch.randn(n, conv.in_channels, 32, 32, device=device, generator=noise),
                eps=self.cfg.whiten_eps,
                centred=self.cfg.whiten_centred,
            )
        if self.step is None or not self.stops_backward_at_whitening:
            return
        bias = self.model.whiten.bias
        bias.requires_grad_(False)
        try:
            self.step.warm_up_and_capture(warmup_iters, self.WHITEN_BIAS_FROZEN)
        finally:
            bias.requires_grad_(True)

    def epoch_start(self, epoch: int) -> None:
        cfg, model = self.cfg, self.model
        if epoch == 0 and isinstance(model, FastNet) and cfg.whiten_images:
            self.init_whitening()
        if isinstance(model, FastNet) and epoch >= cfg.whiten_bias_epochs and not self.whiten_bias_frozen:
            self.freeze_whiten_bias()  # at that epoch, or at a resume past it
        if epoch == 0 and cfg.lookahead_steps:  # after the data init: the slow copy starts from it
            self.lookahead = self._new_lookahead()

    def freeze_whiten_bias(self) -> None:
        self.opt.set_lr_scale("whiten_bias", 0.0)  # frozen from here: no step, no decay
        if self.stops_backward_at_whitening:
            self.model.whiten.bias.requires_grad_(False)
            if self.step is not None:
                self.step.select(self.WHITEN_BIAS_FROZEN)
        self.whiten_bias_frozen = True

    def after_step(self) -> None:
        if self.lookahead is not None:
            self.lookahead.step()

    def finish(self, result=None) -> None:
        """At the run's end: the whitening bias requires grad again, as it does in the model file
        (a caller fine-tuning ``run.model`` or building optimizer groups over it sees it as saved)."""
        if isinstance(self.model, FastNet):
            self.model.whiten.bias.requires_grad_(True)

    def epoch_end(self, epoch: int) -> None:
        if self.lookahead is None:
            return
        if self.cfg.lookahead_epoch_end == "reset":
            self.lookahead.reset()
        elif epoch == len(self.lengths) - 1:
            self.lookahead.finish()

    @functools.cached_property
    def lengths(self) -> list[int]:
        """The run's epoch lengths (as the trainer's), built once: epoch_end reads them every epoch."""
        return epoch_lengths(self.cfg.epochs, len(self.loader))

    def _new_lookahead(self) -> Lookahead:
        cfg = self.cfg
        every, per_epoch = cfg.lookahead_steps, len(self.loader)
        # the first sync step inside the start epoch (airbench: step 145 = epoch 3's first 5th step)
        begin = (cfg.lookahead_start_epoch * per_epoch // every + 1) * every if cfg.lookahead_start_epoch else 0
        return Lookahead(self.model, every, cfg.lookahead_decay, sum(self.lengths), begin)

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
        init_whitening(
            self.model.whiten, images, eps=self.cfg.whiten_eps, reduce=reduce, centred=self.cfg.whiten_centred
        )
        if ctx.distributed:
            torch.distributed.broadcast(self.model.whiten.weight.data, src=0)
