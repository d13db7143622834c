"""Nesterov SGD whose learning rate lives in a device tensor, the schedules, and Muon-style
orthogonalized momentum for conv filters (``Muon``, ``MuonSGD``: the `fast-muon` preset).

``torch.optim.SGD`` reads a float learning rate on the host (and a tensor one through ``.item()``
on its foreach path), which a captured CUDA graph cannot replay with a changing rate. This one
keeps the rate in a 0-dim tensor on the parameters' device and does the whole update with
``torch._foreach_*`` ops, grouped by dtype (fp16 weights, fp32 batchnorm) and by param group
(each with its own rate multiplier and weight decay, e.g. batchnorm biases at 64x the rate). It computes exactly what
``torch.optim.SGD(momentum, nesterov, weight_decay)`` computes; a test holds it to that.

``Optimizer`` is what the trainer, resume and sparse training ask of an optimizer; every optimizer
here declares it (a test checks each defines every member itself), and ``run.recipe.OPTIMIZERS``
names them for ``--optimizer``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Optimizer(Protocol):
    """What a run asks of its optimizer, and who asks:

    - ``lr``: the global rate, a 0-dim float32 tensor on the parameters' device, written in place
      each step by the schedule (``schedule.DeviceSchedule.apply`` inside the step: a captured
      graph replays it);
    - ``set_lr(value)``: the same rate set from the host (tests and tools outside a schedule);
    - ``set_lr_scale(group, value)``: one named param group's rate multiplier, a device write too
      (the whitening-bias freeze sets "whiten_bias" to 0: ``run.whitening``);
    - ``step()`` and ``zero_grad()``: the training step's (``run.step.make_step``); ``zero_grad``
      zeroes in place, as the gradient buckets own the gradients' storage;
    - ``reset_state()``: momentum to zero, in place (the trainer after the warm-up steps; local
      SGD's merge with ``--local-momentum reset``);
    - ``state_dict()`` / ``load_state_dict(state)``: momentum and rate multipliers for
      checkpoints (``run.state``'s "optimizer" entry), plain tensors on the CPU; loading writes in
      place (a captured graph holds the tensors) and raises ValueError for state that does not
      fit, leaving the optimizer as it was.
    """

    lr: torch.Tensor

    def set_lr(self, value: float) -> None: ...

    def set_lr_scale(self, group: str, value: float) -> None: ...

    def step(self) -> None: ...

    def zero_grad(self) -> None: ...

    def reset_state(self) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@runtime_checkable
class Maskable(Optimizer, Protocol):
    """An optimizer whose update sparse training masks (``run.sparse.update.MaskedOptimizer``):
    its parameters in foreach groups it steps one group at a time, and their momentum.

    - ``params``: the trainable parameters, in group order;
    - ``groups``: the parameters as the update's groups (each one group, device and dtype);
    - ``buffers``: the momentum of each, in the same nesting;
    - ``take_weight_decay()``: each group's decay, handed over (the optimizer decays nothing after;
      the caller decays under its mask)."""

    params: list[torch.Tensor]
    groups: list[list[torch.Tensor]]
    buffers: list[list[torch.Tensor]]

    def take_weight_decay(self) -> list[float]: ...


class NesterovSGD(Maskable):
    """``params`` is an iterable of tensors, or of param groups: dicts with ``params``, and optionally
    ``name``, ``lr_scale`` (the group's rate is the global rate x this; default 1) and
    ``weight_decay`` (default: the argument). Parameters that do not require grad are left out, so
    frozen ones (batchnorm scales, a whitening conv) take no step and hold no momentum.
    """

    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0, nesterov: bool = True):
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
            self.param_groups.append(
                {
                    "name": spec.get("name", str(i)),
                    "params": trainable,
                    "lr_scale": float(spec.get("lr_scale", 1.0)),
                    "weight_decay": float(spec.get("weight_decay", weight_decay)),
                }
            )
        if not self.params:
            raise ValueError("no trainable parameters")
        device = self.params[0].device
        self.lr = torch.tensor(float(lr), dtype=torch.float32, device=device)
        # Per group, the rate multiplier is a device tensor too: freezing a group mid-run
        # (set_lr_scale(name, 0)) is a device write that a captured graph replays correctly.
        self.lr_scales = {
            g["name"]: torch.tensor(g["lr_scale"], dtype=torch.float32, device=device) for g in self.param_groups
        }
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
        ``fastcifar.run.sparse.update``)."""
        decays = [wd for _, wd in self._group_meta]
        self._group_meta = [(name, 0.0) for name, _ in self._group_meta]
        return decays

    @torch.no_grad()
    def step(self) -> None:
        for params, bufs, (name, weight_decay) in zip(self.groups, self.buffers, self._group_meta, strict=True):
            grads = [p.grad for p in params]
            if any(g is None for g in grads):
                raise RuntimeError("a parameter has no gradient; run backward before step()")
            d_p = torch._foreach_add(grads, params, alpha=weight_decay) if weight_decay else [g.clone() for g in grads]
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
        return {
            "buffers": [[b.detach().cpu().clone() for b in bufs] for bufs in self.buffers],
            "lr_scales": {name: float(t.item()) for name, t in self.lr_scales.items()},
        }

    def check_state(self, state: dict) -> None:
        """Raises ValueError unless ``state`` fits this model's parameter groups."""
        shapes = [[tuple(b.shape) for b in bufs] for bufs in self.buffers]
        if [[tuple(b.shape) for b in bufs] for bufs in state["buffers"]] != shapes or set(state["lr_scales"]) != set(
            self.lr_scales
        ):
            raise ValueError("the optimizer state does not fit this model's parameter groups")

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """In place (a captured graph holds these tensors); refuses state of another shape."""
        self.check_state(state)
        for bufs, saved in zip(self.buffers, state["buffers"], strict=True):
            torch._foreach_copy_(bufs, [t.to(bufs[0].device) for t in saved])
        for name, value in state["lr_scales"].items():
            self.lr_scales[name].fill_(value)


# --- orthogonalized momentum (Muon-style) ------------------------------------------------------

# Quintic Newton-Schulz coefficients of the public Muon optimizer (Jordan et al., 2024): chosen for
# a steep slope at 0, so 3-5 iterations lift every singular value of a normalized matrix into a
# band around 1 (roughly 0.5-1.5: not exactly 1, which the authors report does not hurt).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(g: torch.Tensor, steps: int = 3, eps: float = 1e-7, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An approximate orthogonalization of the 2-D ``g``: U S' V^T for g = U S V^T, S' near 1; or
    of each matrix of a 3-D stack ``g`` (batch, rows, cols), all in the same kernels.

    ``g`` is first scaled to unit Frobenius norm, so every singular value starts in (0, 1]; each
    iteration maps x -> a x + b x^3 + c x^5 on the singular values (as X X^T products on the
    shorter side). ``dtype``: the iteration's precision (``core.gpu.newton_schulz_dtype``: bfloat16
    from capability 8.0, matmuls at tensor-core rate, the result an update direction that 3
    significant digits suffice for; float16 below); default ``g``'s. bfloat16 has fp32's range, so
    ``g`` is cast first and scaled in it (what Ampere and Hopper run); float16's range ends at 65504,
    which the norm of a 256 x 576 update of mean |entry| 1000 passes (256 x 2304: from 100), and the
    cast-first fp16 result was then all zeros (tests/unit/test_gpu.py), so for it the scaling
    comes first, with the norm taken in fp32.

    Each iteration is three products, the scalar terms riding in two of them as ``baddbmm``'s
    beta x input (one rounding each instead of separate multiplies and adds): the default's 6
    filters took 168 kernels a step with those written out, 0.35 ms of its 5.7 ms graphed step on
    an H100 (bench/results/visits/visit-12.md, 12d)."""
    a, b, c = NS_COEFFICIENTS
    stack = g.dim() == 3
    x = g if stack else g.unsqueeze(0)
    if (dtype or g.dtype) == torch.float16:
        x = (x / (torch.linalg.vector_norm(x, dim=(1, 2), keepdim=True, dtype=torch.float32) + eps)).half()
    else:
        x = x.to(dtype or g.dtype)
        x = x / (torch.linalg.vector_norm(x, dim=(1, 2), keepdim=True) + eps)
    wide = x.shape[1] <= x.shape[2]
    if not wide:
        x = x.mT  # X X^T on the shorter side: the cheaper product
    for _ in range(steps):
        gram = torch.bmm(x, x.mT)
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    x = x if wide else x.mT
    return x if stack else x[0]


class PaddedStack:
    """Matrices of several shapes as one zero-padded stack, so Newton-Schulz runs on all of them in
    one set of kernels: each is laid in the top-left corner of a (rows, cols) slot, the larger
    shape over all, taken on its shorter side first (a tall matrix transposed), as ``newton_schulz``
    takes it alone.

    Zero padding is exact for Newton-Schulz: with X = [[A, 0], [0, 0]], X X^T = [[A A^T, 0], [0, 0]],
    so every product of an iteration keeps A's block where A's own iteration puts it and zeros
    elsewhere; the Frobenius norm that scales each slot is A's (the zeros add nothing), and the
    norm is taken per slot. Only the rounding differs (longer sums of the same terms and zeros).
    The default's six filters (64 x 216, 64 x 576, 256 x 576, three 256 x 2304) take four stacks
    when grouped by shape and one here: 6 x 256 x 2304, 1.7x the arithmetic of the four, which an
    H100 runs in a few microseconds against a step's 168 Newton-Schulz kernels."""

    def __init__(self, shapes: list[tuple[int, int]], dtype: torch.dtype, device: torch.device):
        self.shapes = list(shapes)
        self.tall = [r > c for r, c in self.shapes]
        sides = [(c, r) if t else (r, c) for (r, c), t in zip(self.shapes, self.tall, strict=True)]
        rows, cols = max(r for r, _ in sides), max(c for _, c in sides)
        self.buffer = torch.zeros(len(sides), rows, cols, dtype=dtype, device=device)  # padding stays 0
        self.slots = [self.buffer[i, :r, :c] for i, (r, c) in enumerate(sides)]

    def fill(self, matrices: list[torch.Tensor]) -> torch.Tensor:
        """The stack holding ``matrices`` (of ``shapes``, in order), written into its slots."""
        torch._foreach_copy_(self.slots, [m.mT if t else m for m, t in zip(matrices, self.tall, strict=True)])
        return self.buffer

    def unpack(self, stack: torch.Tensor) -> list[torch.Tensor]:
        """Each matrix's block of a stack of this layout, as a view in its own shape."""
        blocks = [stack[i, : s.shape[0], : s.shape[1]] for i, s in enumerate(self.slots)]
        return [b.mT if t else b for b, t in zip(blocks, self.tall, strict=True)]


# --newton-schulz: how Muon lays its filters out for the orthogonalization
NEWTON_SCHULZ = ("loop", "stacked")


class Muon:
    """Orthogonalized Nesterov momentum for conv filters (each flattened to out x in*k*k):

        buf <- momentum x buf + g;   u <- g + momentum x buf (Nesterov)
        w <- w x sqrt(out) / |w|     (the filter's norm held fixed: no weight decay needed)
        w <- w - lr x newton_schulz(u)

    The rate is ``lr_source x lr_ratio``: a device tensor (the trainer's scheduled SGD rate) times
    a constant, so the filters follow the same schedule and a captured CUDA graph replays it.

    Data-parallel: call ``step`` after the gradients are averaged; every rank then holds the same
    ``u``. By default every rank orthogonalizes every filter (no communication, identical results);
    with ``shard=(rank, world_size)`` rank r orthogonalizes filters r, r + world, ... into a zeroed
    flat buffer and one all-reduce (``reduce``, a sum in place) shares the updates.

    ``layout``: "loop" orthogonalizes one stack per filter shape; "stacked" all of the rank's
    filters as one zero-padded stack (``PaddedStack``: the same map to rounding, one set of kernels).
    """

    def __init__(
        self,
        params,
        lr_source: torch.Tensor,
        lr_ratio: float,
        momentum: float = 0.6,
        nesterov: bool = True,
        ns_steps: int = 3,
        ns_dtype: torch.dtype | None = None,
        shard: tuple[int, int] = (0, 1),
        reduce=None,
        layout: str = "loop",
    ):
        self.params = [p for p in params if p.requires_grad]
        if not self.params or any(p.dim() < 2 for p in self.params):
            raise ValueError("Muon takes one or more trainable matrices or conv filters")
        self.lr_source, self.lr_ratio = lr_source, float(lr_ratio)
        self.momentum, self.nesterov, self.ns_steps = momentum, nesterov, ns_steps
        self.ns_dtype = ns_dtype
        self.rank, self.world = shard
        if self.world > 1 and reduce is None:
            raise ValueError("a sharded Muon needs a reduce (an in-place all-reduce sum)")
        self.reduce = reduce
        self.buffers = [torch.zeros_like(p) for p in self.params]
        self.scales = [float(p.shape[0]) ** 0.5 for p in self.params]
        if self.world > 1:
            sizes = [p.numel() for p in self.params]
            dtype = ns_dtype or self.params[0].dtype
            self.flat = torch.zeros(sum(sizes), dtype=dtype, device=self.params[0].device)
            self.views = list(self.flat.split(sizes))
        # this rank's filters (r, r + world, ...), grouped by flattened shape once: one stack each
        self.groups: dict[tuple[int, int], list[int]] = {}
        for i in range(self.rank, len(self.params), self.world):
            p = self.params[i]
            self.groups.setdefault((len(p), p[0].numel()), []).append(i)
        if layout not in NEWTON_SCHULZ:
            raise ValueError(f"the Newton-Schulz layout must be one of {', '.join(NEWTON_SCHULZ)}, not {layout!r}")
        self.stack = None
        if layout == "stacked" and self.groups:  # a rank past the last filter has none to stack
            if len({p.dtype for p in self.params}) > 1:
                raise ValueError("a stacked Newton-Schulz needs filters of one dtype")
            self.mine = list(range(self.rank, len(self.params), self.world))
            shapes = [(len(self.params[i]), self.params[i][0].numel()) for i in self.mine]
            self.stack = PaddedStack(shapes, self.params[0].dtype, self.params[0].device)
            self.stacked_params = [self.params[i] for i in self.mine]

    @torch.no_grad()
    def step(self) -> None:
        grads = [p.grad for p in self.params]
        if any(g is None for g in grads):
            raise RuntimeError("a filter has no gradient; run backward before step()")
        torch._foreach_mul_(self.buffers, self.momentum)
        torch._foreach_add_(self.buffers, grads)
        updates = torch._foreach_add(grads, self.buffers, alpha=self.momentum) if self.nesterov else self.buffers
        # w <- w x sqrt(out) / |w| as list ops: no per-filter Python arithmetic or temporaries
        factors = torch._foreach_norm(self.params)
        torch._foreach_reciprocal_(factors)
        torch._foreach_mul_(factors, self.scales)
        torch._foreach_mul_(self.params, factors)
        rate = self.lr_source * self.lr_ratio
        if self.stack is not None and self.world == 1:
            self._step_stacked(updates, rate)
            return
        orthogonal = self._orthogonalize(updates)
        lr = {dtype: rate.to(dtype) for dtype in {p.dtype for p in self.params}}  # once per step, not per filter
        for p, o in zip(self.params, orthogonal, strict=True):
            p.sub_(o.reshape(p.shape).to(p.dtype).mul_(lr[p.dtype]))  # o is this step's scratch: scaled in place

    def _step_stacked(self, updates: list[torch.Tensor], rate: torch.Tensor) -> None:
        """w <- w - rate x newton_schulz(u) for every filter at once: the stack cast to the filters'
        dtype and scaled in it (as the loop casts and scales each filter's result), then one list
        subtraction of each filter's block, viewed in the filter's shape (a channels-last filter
        takes it through strides: no copy): 3 ops where the loop takes 4 a filter."""
        stack = self.stack.fill([u.reshape(shape) for u, shape in zip(updates, self.stack.shapes, strict=True)])
        out = newton_schulz(stack, self.ns_steps, dtype=self.ns_dtype).to(self.params[0].dtype)
        out.mul_(rate.to(out.dtype))
        blocks = self.stack.unpack(out)
        torch._foreach_sub_(
            self.stacked_params, [b.view(p.shape) for b, p in zip(blocks, self.stacked_params, strict=True)]
        )

    def _orthogonalize(self, updates: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each update flattened to out x in*k*k and orthogonalized; filters of one shape as one
        stack (the default's three 256 x 2304 filters: one set of kernels, not three). Sharded, rank
        r does filters r, r + world, ... and the all-reduce fills in the rest."""
        out: list[torch.Tensor | None] = [None] * len(updates)
        if self.stack is not None:  # --newton-schulz stacked: the rank's filters in one padded stack
            stack = self.stack.fill(
                [updates[i].reshape(shape) for i, shape in zip(self.mine, self.stack.shapes, strict=True)]
            )
            orthogonal = self.stack.unpack(newton_schulz(stack, self.ns_steps, dtype=self.ns_dtype))
            for i, o in zip(self.mine, orthogonal, strict=True):
                out[i] = o
        else:
            for shape, idx in self.groups.items():
                parts = [updates[i].reshape(shape) for i in idx]
                stack = torch.stack(parts) if len(parts) > 1 else parts[0].unsqueeze(0)  # one alone: no copy
                for i, o in zip(idx, newton_schulz(stack, self.ns_steps, dtype=self.ns_dtype), strict=True):
                    out[i] = o
        if self.world == 1:
            return out
        self.flat.zero_()
        for view, o in zip(self.views, out, strict=True):
            if o is not None:  # this rank's filters
                view.copy_(o.flatten())
        self.reduce(self.flat)  # each slice is one rank's and zeros elsewhere: the sum is exact
        return self.views

    @torch.no_grad()
    def zero_grad(self) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads:
            torch._foreach_zero_(grads)

    @torch.no_grad()
    def reset_state(self) -> None:
        torch._foreach_zero_(self.buffers)

    def state_dict(self) -> dict:
        """The filters' momentum buffers (on the CPU), for checkpoints; the sharded flat buffer is
        scratch, rewritten every step."""
        return {"buffers": [b.detach().cpu().clone() for b in self.buffers]}

    def check_state(self, state: dict) -> None:
        """Raises ValueError unless ``state`` holds one buffer per filter, of its shape."""
        if [tuple(b.shape) for b in state["buffers"]] != [tuple(b.shape) for b in self.buffers]:
            raise ValueError("the Muon state does not fit this model's conv filters")

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """In place (a captured graph holds these tensors); refuses buffers of other shapes."""
        self.check_state(state)
        torch._foreach_copy_(self.buffers, [t.to(self.buffers[0].device) for t in state["buffers"]])


class MuonSGD(Optimizer):
    """Muon on the conv filters and ``NesterovSGD`` on everything else, as one ``Optimizer``.
    The filters' rate is the SGD rate tensor x a constant (``Muon.lr_ratio``). Not ``Maskable``:
    sparse masks wrap Nesterov SGD alone (the config refuses ``--optimizer muon`` with them)."""

    def __init__(self, sgd: NesterovSGD, muon: Muon):
        if muon.lr_source is not sgd.lr:
            raise ValueError("Muon must read the SGD optimizer's rate tensor")
        self.sgd, self.muon = sgd, muon
        self.lr = sgd.lr

    def set_lr(self, value: float) -> None:
        self.sgd.set_lr(value)

    def set_lr_scale(self, group: str, value: float) -> None:
        self.sgd.set_lr_scale(group, value)

    def step(self) -> None:
        self.sgd.step()
        self.muon.step()

    def zero_grad(self) -> None:
        self.sgd.zero_grad()
        self.muon.zero_grad()

    def reset_state(self) -> None:
        self.sgd.reset_state()
        self.muon.reset_state()

    def state_dict(self) -> dict:
        """``NesterovSGD``'s state with the filters' Muon momentum beside it."""
        return {**self.sgd.state_dict(), "muon": self.muon.state_dict()}

    def check_state(self, state: dict) -> None:
        if "muon" not in state:  # an SGD checkpoint; config_from_dict's match normally refuses it first
            raise ValueError("the optimizer state holds no Muon momentum (written by plain SGD)")
        self.muon.check_state(state["muon"])
        self.sgd.check_state(state)

    def load_state_dict(self, state: dict) -> None:
        """Both halves checked before either is written: a refused state leaves no half-loaded optimizer."""
        self.check_state(state)
        self.muon.load_state_dict(state["muon"])
        self.sgd.load_state_dict(state)
