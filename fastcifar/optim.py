"""Nesterov SGD whose learning rate lives in a device tensor, and the warm-up/decay schedule.

``torch.optim.SGD`` reads a float learning rate on the host (and a tensor one through ``.item()``
on its foreach path), which a captured CUDA graph cannot replay with a changing rate. This one
keeps the rate in a 0-dim tensor on the parameters' device and does the whole update with
``torch._foreach_*`` ops, grouped by dtype (fp16 weights, fp32 batchnorm). It computes exactly what
``torch.optim.SGD(momentum, nesterov, weight_decay)`` computes; a test holds it to that.
"""

from __future__ import annotations

from collections import defaultdict

import torch


class NesterovSGD:
    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                 nesterov: bool = True):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("no trainable parameters")
        device = self.params[0].device
        self.lr = torch.tensor(float(lr), dtype=torch.float32, device=device)
        self.momentum, self.weight_decay, self.nesterov = momentum, weight_decay, nesterov
        groups = defaultdict(list)
        for p in self.params:
            groups[(p.device, p.dtype)].append(p)
        self.groups = list(groups.values())
        self.buffers = [[torch.zeros_like(p) for p in group] for group in self.groups]

    def set_lr(self, value: float) -> None:
        self.lr.fill_(value)  # a device write, no host sync

    @torch.no_grad()
    def step(self) -> None:
        for params, bufs in zip(self.groups, self.buffers):
            grads = [p.grad for p in params]
            if any(g is None for g in grads):
                raise RuntimeError("a parameter has no gradient; run backward before step()")
            d_p = torch._foreach_add(grads, params, alpha=self.weight_decay) if self.weight_decay \
                else [g.clone() for g in grads]
            torch._foreach_mul_(bufs, self.momentum)
            torch._foreach_add_(bufs, d_p)
            if self.nesterov:
                torch._foreach_add_(d_p, bufs, alpha=self.momentum)
            else:
                d_p = [b.clone() for b in bufs]
            torch._foreach_mul_(d_p, self.lr.to(params[0].dtype))
            torch._foreach_sub_(params, d_p)

    @torch.no_grad()
    def zero_grad(self) -> None:
        """Zero gradients in place: their storage stays (the bucketed all-reduce owns it)."""
        for group in self.groups:
            grads = [p.grad for p in group if p.grad is not None]
            if grads:
                torch._foreach_zero_(grads)

    @torch.no_grad()
    def reset_state(self) -> None:
        for bufs in self.buffers:
            torch._foreach_zero_(bufs)


def warmup_decay_lr(progress: float, epochs: float, warmup_epochs: float, peak: float) -> float:
    """Piecewise linear: 0 at epoch 0, ``peak`` at ``warmup_epochs``, 0 at ``epochs``.

    ``progress`` is in epochs (fractional). With no warm-up the rate starts at the peak.
    """
    if progress < warmup_epochs:
        return peak * progress / warmup_epochs
    if epochs <= warmup_epochs:
        return peak
    return peak * max(0.0, (epochs - progress) / (epochs - warmup_epochs))
