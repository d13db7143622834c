"""Nesterov SGD whose learning rate lives in a device tensor, and the warm-up/decay schedule.

``torch.optim.SGD`` reads a float learning rate on the host (and a tensor one through ``.item()``
on its foreach path), which a captured CUDA graph cannot replay with a changing rate. This one
keeps the rate in a 0-dim tensor on the parameters' device and does the whole update with
``torch._foreach_*`` ops, grouped by dtype (fp16 weights, fp32 batchnorm) and by param group
(each with its own rate multiplier and weight decay, e.g. batchnorm biases at 64x the rate). It computes exactly what
``torch.optim.SGD(momentum, nesterov, weight_decay)`` computes; a test holds it to that.
"""

from __future__ import annotations

from collections import defaultdict

import torch


class NesterovSGD:
    """``params`` is an iterable of tensors, or of param groups: dicts with ``params``, and optionally
    ``name``, ``lr_scale`` (the group's rate is the global rate x this; default 1) and
    ``weight_decay`` (default: the argument). Parameters that do not require grad are left out, so
    frozen ones (batchnorm scales, a whitening conv) take no step and hold no momentum.
    """

    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                 nesterov: bool = True):
        specs = list(params)
        if not specs or not isinstance(specs[0], dict):
            specs = [{"params": specs}]
        self.momentum, self.weight_decay, self.nesterov = momentum, weight_decay, nesterov
        self.params, self.param_groups, seen = [], [], set()
        for i, spec in enumerate(specs):
            trainable = [p for p in spec["params"] if p.requires_grad]
            if any(id(p) in seen for p in trainable):
                raise ValueError(f"a parameter is in more than one group (group {spec.get('name', i)!r})")
            seen.update(id(p) for p in trainable)
            self.params += trainable
            self.param_groups.append({"name": spec.get("name", str(i)), "params": trainable,
                                      "lr_scale": float(spec.get("lr_scale", 1.0)),
                                      "weight_decay": float(spec.get("weight_decay", weight_decay))})
        if not self.params:
            raise ValueError("no trainable parameters")
        device = self.params[0].device
        self.lr = torch.tensor(float(lr), dtype=torch.float32, device=device)
        # Per group, the rate multiplier is a device tensor too: freezing a group mid-run
        # (set_lr_scale(name, 0)) is a device write that a captured graph replays correctly.
        self.lr_scales = {g["name"]: torch.tensor(g["lr_scale"], dtype=torch.float32, device=device)
                          for g in self.param_groups}
        buckets = defaultdict(list)  # foreach ops want one dtype per list: (group, device, dtype)
        for g in self.param_groups:
            for p in g["params"]:
                buckets[(g["name"], g["weight_decay"], p.device, p.dtype)].append(p)
        self.groups = list(buckets.values())
        self._group_meta = [(name, wd) for name, wd, _, _ in buckets]
        self.buffers = [[torch.zeros_like(p) for p in group] for group in self.groups]

    def set_lr(self, value: float) -> None:
        self.lr.fill_(value)  # a device write, no host sync

    def set_lr_scale(self, group: str, value: float) -> None:
        """The multiplier of one group's rate (0 freezes it: no step, no decay)."""
        self.lr_scales[group].fill_(value)

    def take_weight_decay(self) -> list[float]:
        """Hand over the weight decay of each foreach group (``self.groups`` order); from then on
        this optimizer decays nothing and the caller applies the decay itself (masked, in
        ``fastcifar.sparse.update``)."""
        decays = [wd for _, wd in self._group_meta]
        self._group_meta = [(name, 0.0) for name, _ in self._group_meta]
        return decays

    @torch.no_grad()
    def step(self) -> None:
        for params, bufs, (name, weight_decay) in zip(self.groups, self.buffers, self._group_meta):
            grads = [p.grad for p in params]
            if any(g is None for g in grads):
                raise RuntimeError("a parameter has no gradient; run backward before step()")
            d_p = torch._foreach_add(grads, params, alpha=weight_decay) if weight_decay \
                else [g.clone() for g in grads]
            torch._foreach_mul_(bufs, self.momentum)
            torch._foreach_add_(bufs, d_p)
            if self.nesterov:
                torch._foreach_add_(d_p, bufs, alpha=self.momentum)
            else:
                d_p = [b.clone() for b in bufs]
            torch._foreach_mul_(d_p, (self.lr * self.lr_scales[name]).to(params[0].dtype))
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

    def state_dict(self) -> dict:
        """Momentum buffers and per-group rate multipliers (on the CPU), for checkpoints."""
        return {"buffers": [[b.detach().cpu().clone() for b in bufs] for bufs in self.buffers],
                "lr_scales": {name: float(t.item()) for name, t in self.lr_scales.items()}}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """In place (a captured graph holds these tensors); refuses state of another shape."""
        shapes = [[tuple(b.shape) for b in bufs] for bufs in self.buffers]
        if [[tuple(b.shape) for b in bufs] for bufs in state["buffers"]] != shapes \
                or set(state["lr_scales"]) != set(self.lr_scales):
            raise ValueError("the optimizer state does not fit this model's parameter groups")
        for bufs, saved in zip(self.buffers, state["buffers"]):
            torch._foreach_copy_(bufs, [t.to(bufs[0].device) for t in saved])
        for name, value in state["lr_scales"].items():
            self.lr_scales[name].fill_(value)


def warmup_decay_lr(progress: float, epochs: float, warmup_epochs: float, peak: float,
                    start: float = 0.0, end: float = 0.0) -> float:
    """Piecewise linear: ``start x peak`` at epoch 0, ``peak`` at ``warmup_epochs``, ``end x peak``
    at ``epochs`` (the seed recipe: start = end = 0).

    ``progress`` is in epochs (fractional). With no warm-up the rate starts at the peak.
    """
    if progress < warmup_epochs:
        return peak * (start + (1.0 - start) * progress / warmup_epochs)
    if epochs <= warmup_epochs:
        return peak
    left = max(0.0, (epochs - progress) / (epochs - warmup_epochs))  # 1 at the peak, 0 at the end
    return peak * (end + (1.0 - end) * left)
