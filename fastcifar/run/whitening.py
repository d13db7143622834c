"""The whitening conv's part in a run: a component the trainer adds when the network has one
(``models.network.WhiteningNetwork``: FastNet's first layer).

- at epoch 0's start, the data-dependent init: the conv's weights from the first ``whiten_images``
  training images (``init_whitening``);
- at ``whiten_bias_epochs``, the bias freeze: its param group's rate goes to 0 and, where nothing
  else needs its gradient, backward ends at the conv (a second captured step, selected there). A
  whole number of epochs freezes it at that epoch's start; a fraction at step ceil(epochs x steps
  per epoch), the record script's count (0.19 of 25 steps: after 5 steps), mid-epoch;
- with ``whiten_bias_decay``, over that window the bias's rate multiplier falls linearly from 1
  (step 0) toward 0 (1 - step / window steps, as airbench94_muon and the record script decay it),
  written from the host before each step of the window (a device fill: a captured step reads it);
- before the clock, the first-time work of both (``warm_up``).

Timing (DAWNBench): the whitening init reads training images, so it is part of training and runs
on the clock, at the start of epoch 0 (as airbench counts it). It costs one pass over 5000 images'
2x2 patches, a 12x12 eigendecomposition and, with several ranks, one all-reduce and one broadcast.
It runs before the lookahead's slow copy is taken (``recipe.RunHooks``), sparse masks are chosen
and local SGD's anchor is set, which all start from the whitened weights: ``for_model``'s
components come first in a run's list (``components.for_run``).
"""

from __future__ import annotations

import copy
import math

import torch

from fastcifar.models.fastnet import init_whitening
from fastcifar.models.network import WhiteningNetwork, keeps
from fastcifar.run.component import Component
from fastcifar.run.optim import Optimizer


class Whitening(Component):
    """The whitening conv's init and bias freeze. ``step``: the run's ``graphs.TrainStep``, told
    when the bias freeze changes what backward does (None: no step to switch, e.g. in tests)."""

    BIAS_FROZEN = "whiten-bias-frozen"  # the TrainStep variant after the freeze

    def __init__(self, cfg, model: WhiteningNetwork, opt: Optimizer, train_loader, ctx, step=None):
        self.cfg, self.model, self.opt, self.loader, self.ctx, self.step = cfg, model, opt, train_loader, ctx, step
        self.bias_frozen = False

    @property
    def stops_backward(self) -> bool:
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
        return cfg.whiten_frozen and not ddp and cfg.sparse_mask == "none"

    def warm_up(self, warmup_iters: int) -> None:
        """Off the clock, before the caller restores the model's state, the first-time work of what
        this component does: whiten random images into a scratch copy of the whitening conv, so the
        first run's whitening init does not pay for loading cuSOLVER's eigensolver and the float64
        kernels (the first run's epoch 1 was markedly slower than later runs' without it:
        bench/results/visits/visit-2.md, 2c); and capture the step as it runs after the bias freeze
        (the freeze then switches graphs instead of capturing on the clock). The scratch whitening is
        CUDA's alone: on the CPU there is no solver to load, and whitening 5,000 random images took
        a tiny CPU run's set-up from 0.8 to 2.4 s."""
        if self.cfg.whiten_images and self.model.whiten.weight.device.type == "cuda":
            conv = copy.deepcopy(self.model.whiten)
            n, device = math.ceil(self.cfg.whiten_images / self.ctx.world_size), conv.weight.device
            noise = torch.Generator(device).manual_seed(0)  # its own: the run's random streams stay as they were
            init_whitening(
                conv,
                torch.randn(n, conv.in_channels, 32, 32, device=device, generator=noise),
                eps=self.cfg.whiten_eps,
                centred=self.cfg.whiten_centred,
            )
        if self.step is None or not self.stops_backward:
            return
        bias = self.model.whiten.bias
        bias.requires_grad_(False)
        try:
            self.step.warm_up_and_capture(warmup_iters, self.BIAS_FROZEN)
        finally:
            bias.requires_grad_(True)

    def epoch_start(self, epoch: int) -> None:
        if epoch == 0 and self.cfg.whiten_images:
            self.init_whitening()
        if epoch >= self.cfg.whiten_bias_epochs and not self.bias_frozen:
            self.freeze_bias()  # at that epoch, or at a resume past it

    def freeze_bias(self) -> None:
        self.opt.set_lr_scale("whiten_bias", 0.0)  # frozen from here: no step, no decay
        if self.stops_backward:
            self.model.whiten.bias.requires_grad_(False)
            if self.step is not None:
                self.step.select(self.BIAS_FROZEN)
        self.bias_frozen = True

    def finish(self, result=None) -> None:
        """At the run's end: the whitening bias requires grad again, as it does in the model file
        (a caller fine-tuning ``run.model`` or building optimizer groups over it sees it as saved)."""
        self.model.whiten.bias.requires_grad_(True)

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


class WhiteningWindow(Whitening):
    """The whitening component of a bias window that ends mid-epoch or decays: it counts steps
    (``after_step``, which a whole-epoch window without decay does not pay for on every step) and
    freezes the bias after step ``window_steps`` - 1, decaying its rate before each step of the
    window when ``whiten_bias_decay`` is set. ``steps_per_epoch``: the loader's batches an epoch
    (every epoch but a fractional last one is whole, so epoch e starts at step e x steps)."""

    def __init__(
        self, cfg, model: WhiteningNetwork, opt: Optimizer, train_loader, ctx, step=None, steps_per_epoch=None
    ):
        super().__init__(cfg, model, opt, train_loader, ctx, step)
        self.steps_per_epoch = len(train_loader) if steps_per_epoch is None else steps_per_epoch
        self.window_steps = bias_window_steps(cfg.whiten_bias_epochs, self.steps_per_epoch)
        self.step_index = 0

    def epoch_start(self, epoch: int) -> None:
        if epoch == 0 and self.cfg.whiten_images:
            self.init_whitening()
        self.step_index = epoch * self.steps_per_epoch  # a resume starts at an epoch's first step
        self._before_step()

    def after_step(self) -> None:
        if not self.bias_frozen:
            self.step_index += 1
            self._before_step()

    def _before_step(self) -> None:
        """The bias's state for the step at ``step_index``: frozen from the window's end on, else
        (with decay) its rate at 1 - step / window."""
        if self.bias_frozen:
            return
        if self.step_index >= self.window_steps:
            self.freeze_bias()
        elif self.cfg.whiten_bias_decay:
            self.opt.set_lr_scale("whiten_bias", 1.0 - self.step_index / self.window_steps)


def bias_window_steps(epochs: float, steps_per_epoch: int) -> int:
    """Steps the whitening bias trains: ceil(epochs x steps per epoch), as ``schedule.epoch_lengths``
    counts a fractional run (round first: 0.2 x 25 is 5.000000000000001 in floats)."""
    return math.ceil(round(epochs * steps_per_epoch, 9))


def for_model(cfg, model, opt: Optimizer, train_loader, ctx, step=None) -> list[Whitening]:
    """The run's whitening component when ``model`` has a whitening conv (the
    ``WhiteningNetwork`` contract), none otherwise: ``WhiteningWindow`` when its bias window ends
    mid-epoch or decays, else the whole-epoch ``Whitening``."""
    if not keeps(model, WhiteningNetwork):
        return []
    if cfg.whiten_bias_decay or cfg.whiten_bias_epochs != int(cfg.whiten_bias_epochs):
        return [WhiteningWindow(cfg, model, opt, train_loader, ctx, step)]
    return [Whitening(cfg, model, opt, train_loader, ctx, step)]
