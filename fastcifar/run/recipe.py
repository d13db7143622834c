"""The recipe's levers that reach into a run, kept out of train.py's story.

- ``peak_rate``: the schedule's top rate for a rank's summed loss (the trainer's and bench_step's);
- ``param_groups``: the optimizer's groups: weights; batchnorm shifts at ``bias_lr_scale`` x the
  rate (and weight decay / that, so the decay per step stays); the head at ``head_lr_scale``; the
  whitening bias of a network that has one, which ``run.whitening`` freezes after
  ``whiten_bias_epochs`` by setting its group's rate to 0;
- ``OPTIMIZERS``: ``--optimizer``'s table, name -> builder of a ``run.optim.Optimizer`` over those
  groups (``make_optimizer`` looks it up);
- ``RunHooks``: lookahead, at epoch starts and ends and after each step.

The network is asked through its contract (``models.network.Network``: the head is ``fc``;
``WhiteningNetwork``: a whitening conv), never by its class.
"""

from __future__ import annotations

import functools
import itertools

from torch import nn

from fastcifar.core import gpu
from fastcifar.models.network import WhiteningNetwork, keeps, norm_layers
from fastcifar.run.averaging import Lookahead
from fastcifar.run.component import Component
from fastcifar.run.optim import Muon, MuonSGD, NesterovSGD, Optimizer
from fastcifar.run.schedule import epoch_lengths


def peak_rate(cfg, per_rank_batch: int) -> float:
    """The schedule's top rate per image of a rank's summed loss: ``lr`` scaled to the global batch
    (config.py's rule, ``lr * batch_size / 512``), divided by the per-rank batch the loss sums over."""
    return cfg.lr * cfg.batch_size / 512 / per_rank_batch


def param_groups(model: nn.Module, cfg, per_rank_batch: int) -> list[dict]:
    """NesterovSGD groups over every parameter of ``model`` (a ``models.network.Network``), weight
    decay per the summed loss (x per-rank batch, see config.py); "whiten_bias" is empty for a
    network without a whitening conv."""
    wd = cfg.weight_decay * per_rank_batch
    shifts = [m.bias for m in norm_layers(model)]
    whiten_bias = [model.whiten.bias] if keeps(model, WhiteningNetwork) else []
    head = [model.fc.weight]
    special = {id(p) for p in shifts + whiten_bias + head}
    weights = [p for p in model.parameters() if id(p) not in special]
    return [
        {"name": "weights", "params": weights, "weight_decay": wd},
        {"name": "head", "params": head, "lr_scale": cfg.head_lr_scale, "weight_decay": wd / cfg.head_lr_scale},
        {"name": "bn_shifts", "params": shifts, "lr_scale": cfg.bias_lr_scale, "weight_decay": wd / cfg.bias_lr_scale},
        {"name": "whiten_bias", "params": whiten_bias, "weight_decay": wd},
    ]


def sgd(groups: list[dict], cfg, peak: float, ctx=None) -> NesterovSGD:
    """``--optimizer sgd``: ``NesterovSGD`` over every group (each carries its own weight decay)."""
    return NesterovSGD(groups, lr=0.0, momentum=cfg.momentum, nesterov=cfg.nesterov)


def conv_filters(groups: list[dict]) -> tuple[list[dict], list[nn.Parameter]]:
    """The trainable conv filters (4-D) taken out of the "weights" group, in the model's order:
    (the groups without them, the filters)."""
    weights = next(g for g in groups if g["name"] == "weights")["params"]
    filters = [p for p in weights if p.dim() == 4 and p.requires_grad]
    taken = {id(p) for p in filters}
    rest = [{**g, "params": [p for p in g["params"] if id(p) not in taken]} for g in groups]
    return rest, filters


def muon(groups: list[dict], cfg, peak: float, ctx=None) -> Optimizer:
    """``--optimizer muon``: ``MuonSGD``, Muon on the trainable conv filters at ``muon_lr`` x (the
    scheduled rate / ``peak``), Newton-Schulz in the device's precision
    (``core.gpu.newton_schulz_dtype``: bfloat16 from capability 8.0, float16 below, fp32 on the
    CPU); ``sgd`` on the rest. ``--muon-shard`` with several ranks: each orthogonalizes every
    world-th filter and one all-reduce shares them."""
    rest, filters = conv_filters(groups)
    sgd_part = sgd(rest, cfg, peak, ctx)
    if not filters:  # every filter frozen: nothing for Muon
        return sgd_part
    shard, reduce = (0, 1), None
    if ctx is not None and ctx.distributed and cfg.muon_shard:
        import torch.distributed as dist

        shard, reduce = (ctx.rank, ctx.world_size), dist.all_reduce
    filters_part = Muon(
        filters,
        sgd_part.lr,
        cfg.muon_lr / peak,
        momentum=cfg.muon_momentum,
        ns_steps=cfg.muon_ns_steps,
        ns_dtype=gpu.newton_schulz_dtype(filters[0].device),
        shard=shard,
        reduce=reduce,
        layout=cfg.newton_schulz,
    )
    return MuonSGD(sgd_part, filters_part)


# --optimizer -> builder(param_groups' groups, cfg, peak, ctx) of an Optimizer: a new optimizer is
# its class (run.optim.Optimizer) and one entry
OPTIMIZERS = {"sgd": sgd, "muon": muon}


def make_optimizer(model: nn.Module, cfg, per_rank_batch: int, peak: float, ctx=None) -> Optimizer:
    """The ``--optimizer`` of ``cfg`` (``OPTIMIZERS``) over ``param_groups``; ``peak``: the
    schedule's top rate (``peak_rate``); ``ctx``: the ranks (None: one)."""
    return OPTIMIZERS[cfg.optimizer](param_groups(model, cfg, per_rank_batch), cfg, peak, ctx)


def first_steps(loader, n: int):
    """The loader's first ``n`` batches: the loader itself for a whole epoch, so its iterator runs
    to its end (DALI finishes its pass there; a pass left suspended is drained by the next one)."""
    return loader if n >= len(loader) else itertools.islice(loader, n)


class RunHooks(Component):
    """The recipe's lookahead, as the run's component: its slow copy taken at epoch 0's start
    (after the whitening init: ``run.whitening`` comes first), synced after each step, folded in
    or reset at epoch ends; its state is the checkpoint's "hooks" entry (``state_dict``)."""

    def __init__(self, cfg, model: nn.Module, train_loader):
        self.cfg, self.model, self.loader = cfg, model, train_loader
        self.lookahead: Lookahead | None = None

    def epoch_start(self, epoch: int) -> None:
        if epoch == 0 and self.cfg.lookahead_steps:  # after the data init: the slow copy starts from it
            self.lookahead = self._new_lookahead()

    def after_step(self) -> None:
        if self.lookahead is not None:
            self.lookahead.step()

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
