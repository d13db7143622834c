"""Sparse updates: only the masked entries move, by masking what the optimizer is fed.

``MaskedOptimizer`` wraps ``NesterovSGD`` and, before each step, multiplies every gradient by its
parameter's mask (a 0/1 tensor in the parameter's dtype and memory layout, updated in place, so a
captured CUDA graph sees new masks). Two modes:

- ``full`` (default): the whole update is masked. The optimizer hands its weight decay over
  (``take_weight_decay``) and the decay is added here, masked: ``g <- m * g + wd * m * p``. An
  unmasked entry then feeds 0 into its momentum buffer, which stays 0, and its step is exactly
  ``p - lr * 0 = p``: it does not move at all. When the mask changes, momentum outside the new mask
  is zeroed, so the entries that leave it stop at once.
- ``grad``: only the gradient is masked (the seed's scheme). Weight decay still shrinks every
  entry and its momentum carries on, so unmasked weights drift toward 0.
"""

from __future__ import annotations

import torch

from fastcifar.core.config import CHOICES
from fastcifar.parallel import distributed
from fastcifar.run.optim import Maskable, Optimizer


class MaskedOptimizer(Optimizer):
    """``opt`` (a ``Maskable`` optimizer: ``NesterovSGD``) behind the same ``Optimizer`` contract,
    its update masked; the rate, rate multipliers, momentum reset and state are ``opt``'s own."""

    def __init__(self, opt: Maskable, named_params: dict[str, torch.Tensor], mode: str = "full"):
        if mode not in CHOICES["sparse_update"]:
            raise ValueError(f"sparse update mode must be one of {CHOICES['sparse_update']}, not {mode!r}")
        self.opt, self.mode = opt, mode
        self.lr = opt.lr
        name_of = {id(p): n for n, p in named_params.items()}
        # Start dense (all ones): warm-up steps before the first mask train like the dense run.
        self.masks = {name_of[id(p)]: torch.ones_like(p) for p in opt.params}
        self.group_masks = [[self.masks[name_of[id(p)]] for p in group] for group in opt.groups]
        self.buffer_names = [name_of[id(p)] for group in opt.groups for p in group]  # opt.buffers' order, flat
        self.decays = opt.take_weight_decay() if mode == "full" else [0.0] * len(opt.groups)

    def set_lr(self, value: float) -> None:
        self.opt.set_lr(value)

    def set_lr_scale(self, group: str, value: float) -> None:
        self.opt.set_lr_scale(group, value)

    def reset_state(self) -> None:
        self.opt.reset_state()

    def state_dict(self) -> dict:
        """``opt``'s: the masks are not in a checkpoint (the config refuses --resume with --sparse-mask)."""
        return self.opt.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.opt.load_state_dict(state)

    @torch.no_grad()
    def set_masks(self, masks: dict[str, torch.Tensor]) -> None:
        """Copy boolean masks in (names missing from ``masks`` stop training: mask 0)."""
        for name, m in self.masks.items():
            if name in masks:
                m.copy_(masks[name])
            else:
                m.zero_()
        if self.mode == "full":
            for bufs, group_masks in zip(self.opt.buffers, self.group_masks, strict=True):
                torch._foreach_mul_(bufs, group_masks)

    @torch.no_grad()
    def average_momentum_outside(self, covered: dict[str, torch.Tensor], world_size: int) -> None:
        """Average over ranks the momentum of the entries outside ``covered`` (a boolean mask per
        trainable parameter's name, as ``masks.deal`` gives). Entries inside keep this rank's own
        (``--local-momentum``'s rule)."""
        bufs = [b for group in self.opt.buffers for b in group]
        means = [b.clone() for b in bufs]
        distributed.average_buffers(means, world_size)
        for name, buf, mean in zip(self.buffer_names, bufs, means, strict=True):
            buf.copy_(torch.where(covered[name], buf, mean))

    @torch.no_grad()
    def step(self) -> None:
        for params, masks, wd in zip(self.opt.groups, self.group_masks, self.decays, strict=True):
            grads = [p.grad for p in params]
            if any(g is None for g in grads):
                raise RuntimeError("a parameter has no gradient; run backward before step()")
            if wd:  # m * (g + wd * p): the mask is 0 or 1, so one masking covers gradient and decay
                torch._foreach_add_(grads, params, alpha=wd)
            torch._foreach_mul_(grads, masks)
        self.opt.step()

    def zero_grad(self) -> None:
        self.opt.zero_grad()
