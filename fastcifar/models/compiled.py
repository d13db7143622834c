"""``--compile``: the network through ``torch.compile``, the fused Triton kernel as a custom op.

``torch.compile`` cannot see inside ``kernels.bn_act_pool``'s launcher (host-side checks, block
choices, several kernels): tracing it breaks the graph at every NormActPool, 9 breaks in FastNet,
and the compiler then fuses nothing across them. Registered with ``torch.library.custom_op`` and a
fake implementation (shapes, dtypes and layouts only), the kernel is one opaque node: the graph
stays whole (``fullgraph=True`` holds in the tests), the compiler fuses the convs' neighbours, the
loss and the logit scaling around it, and AOTAutograd calls the kernel's own backward through
``register_autograd``.

The launchers are wrapped, not changed: ``fastcifar::bn_act_pool_fwd`` and ``_bwd`` call
``bn_act_pool_forward`` / ``bn_act_pool_backward`` as they are. An op with autograd must be
functional, so the forward updates copies of the running statistics and returns them (2 x C
floats; the module copies them back); and it may not return an alias of an input, so it returns
an empty tensor where the launcher's ``saved`` holds the input itself (pool None / "after") or
no index, and the backward is given the input back.

Eager runs keep ``BnActPoolFunction`` (an ``autograd.Function``) rather than this op: run eagerly it
costs more. One layer's forward+backward (8x16x8x8, pool after, Triton's interpreter, 2 shared CPU
cores, torch 2.14.1): 285 and 402 ms through the op against 200 and 272 ms through the Function
(two alternating rounds); with a trivial body the op's dispatch alone cost 100-180 us more per
forward+backward than a Function's (about 1 ms per eager FastNet step: 9 norm layers), and the op
copies the running statistics back, two more launches per layer.

With CUDA graphs (``--cuda-graphs``) the compiled model is called inside the captured step like
the eager one: compilation happens in the warm-up iterations before capture, and the default
compile mode adds no graphs of its own. The optimizer stays eager: it is a handful of foreach
launches per step.
"""

from __future__ import annotations

import torch

_NO_POOL = ""  # custom-op schemas take str, not Optional[str]: "" is pool=None


def _pool(pool: str) -> str | None:
    return pool or None


def _empty_nhwc(shape, dtype, device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device, memory_format=torch.channels_last)


def _channels_last(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last)  # no copy when it already is


@torch.library.custom_op("fastcifar::bn_act_pool_fwd", mutates_args=())
def bn_act_pool_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    training: bool,
    momentum: float,
    eps: float,
    act: str,
    pool: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, pooled input or empty, argmax or empty, mean, rstd, new running mean, new running var):
    the launcher's output, its saved tensors, and the statistics it would update in place."""
    from fastcifar.kernels.bn_act_pool import bn_act_pool_forward

    x = _channels_last(x)
    new_mean, new_var = running_mean.clone(), running_var.clone()
    y, (src, idx, mean, rstd) = bn_act_pool_forward(
        x, weight, bias, new_mean, new_var, training, momentum, eps, act, _pool(pool)
    )
    empty = x.new_empty(0)
    return (
        y,
        src if src is not x else empty,
        idx if idx is not None else empty.to(torch.int8),
        mean,
        rstd,
        new_mean,
        new_var,
    )


@bn_act_pool_fwd.register_fake
def _(x, weight, bias, running_mean, running_var, training, momentum, eps, act, pool):
    n, c, h, w = x.shape
    ho, wo = (h // 2, w // 2) if pool else (h, w)
    y = _empty_nhwc((n, c, ho, wo), x.dtype, x.device)
    before = pool == "before"
    src = _empty_nhwc((n, c, ho, wo), x.dtype, x.device) if before else x.new_empty(0)
    idx = _empty_nhwc((n, c, ho, wo), torch.int8, x.device) if before else x.new_empty(0, dtype=torch.int8)
    stats = x.new_empty((c,), dtype=torch.float32)
    return (y, src, idx, stats, torch.empty_like(stats), torch.empty_like(running_mean), torch.empty_like(running_var))


@torch.library.custom_op("fastcifar::bn_act_pool_bwd", mutates_args=())
def bn_act_pool_bwd(
    dy: torch.Tensor,
    src: torch.Tensor,
    idx: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    x_shape: list[int],
    training: bool,
    act: str,
    pool: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias) from the backward launcher."""
    from fastcifar.kernels.bn_act_pool import bn_act_pool_backward

    saved = (_channels_last(src), idx if idx.numel() else None, mean, rstd)
    return bn_act_pool_backward(_channels_last(dy), saved, weight, bias, tuple(x_shape), training, act, _pool(pool))


@bn_act_pool_bwd.register_fake
def _(dy, src, idx, mean, rstd, weight, bias, x_shape, training, act, pool):
    dx = _empty_nhwc(tuple(x_shape), dy.dtype, dy.device)
    return dx, mean.new_empty(mean.shape), mean.new_empty(mean.shape)


def _setup_context(ctx, inputs, output):
    x, weight, bias, _, _, training, _, _, act, pool = inputs
    _, src, idx, mean, rstd, new_mean, new_var = output
    ctx.mark_non_differentiable(src, idx, mean, rstd, new_mean, new_var)
    ctx.save_for_backward(src if pool == "before" else x, idx, mean, rstd, weight, bias)
    ctx.cfg = (list(x.shape), training, act, pool)


def _backward(ctx, dy, *_unused):
    src, idx, mean, rstd, weight, bias = ctx.saved_tensors
    x_shape, training, act, pool = ctx.cfg
    dx, dw, db = bn_act_pool_bwd(dy, src, idx, mean, rstd, weight, bias, x_shape, training, act, pool)
    return dx, dw, db, None, None, None, None, None, None, None


bn_act_pool_fwd.register_autograd(_backward, setup_context=_setup_context)


def _custom_op_norm():
    """The Triton NormActPool whose forward is the custom op (imported late, as model.norm_factory
    does: importing triton decides between compiler and interpreter)."""
    from fastcifar.kernels.bn_act_pool import TritonNormActPool

    class CompiledNormActPool(TritonNormActPool):
        def normalize(
            self, x: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor, momentum: float
        ) -> torch.Tensor:
            y, _, _, _, _, new_mean, new_var = torch.ops.fastcifar.bn_act_pool_fwd(
                x,
                self.weight,
                self.bias,
                running_mean,
                running_var,
                self.training,
                momentum,
                self.eps,
                self.act,
                self.pool or _NO_POOL,
            )
            if self.training:  # the op is functional (autograd needs that): the update lands here
                with torch.no_grad():  # statistics, not a path for gradients into the next step
                    running_mean.copy_(new_mean)
                    running_var.copy_(new_var)
            return y

    return CompiledNormActPool


def norm_for(norm, enabled: bool):
    """The norm block to build with: under ``--compile`` the Triton one becomes its custom-op form
    (same constructor and state); anything else is returned as is."""
    if not enabled or getattr(norm, "__name__", "") != "TritonNormActPool":
        return norm
    return _custom_op_norm()


def wrap(net: torch.nn.Module, enabled: bool, backend: str = "inductor", fullgraph: bool = False):
    """``torch.compile(net)`` when enabled (forward and, through AOTAutograd, backward), else ``net``.
    The parameters stay the module's: the optimizer, lookahead and checkpoints see the same tensors."""
    if not enabled:
        return net
    return torch.compile(net, backend=backend, fullgraph=fullgraph)
