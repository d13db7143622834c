"""fastcifar.ops.norm_act_pool: the NormActPool block's orders and options, the kernel blocks turned
back into the torch reference, and --emulate-ranks' batchnorm, which keeps each rank's statistics
(N = 3 ranks simulated beside it: unequal shards, a 1/N not exact in binary)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastcifar.models.resnet9 import ResNet9
from fastcifar.ops.norm_act_pool import NormActPool, PerRankStatistics, per_rank


@pytest.mark.parametrize("pool", [None, "before", "after"])
def test_norm_act_pool_order(pool):
    torch.manual_seed(0)
    block = NormActPool(5, act="relu", pool=pool).train()
    with torch.no_grad():
        block.weight.uniform_(-1, 1)  # negative scales: pooling before and after BN differ
        block.bias.uniform_(-1, 1)
    x = torch.randn(3, 5, 7, 7)
    bn = torch.nn.BatchNorm2d(5).train()
    bn.load_state_dict({k: v for k, v in block.state_dict().items()})
    if pool == "before":
        want = F.relu(bn(F.max_pool2d(x, 2)))
    elif pool == "after":
        want = F.max_pool2d(F.relu(bn(x)), 2)
    else:
        want = F.relu(bn(x))
    torch.testing.assert_close(block(x), want)
    torch.testing.assert_close(block.running_mean, bn.running_mean)


CL = torch.channels_last


def test_norm_act_pool_rejects_unknown_options():
    with pytest.raises(ValueError, match="unknown activation"):
        NormActPool(4, act="swish")
    with pytest.raises(ValueError, match="pool must be one of"):
        NormActPool(4, pool="middle")


def test_as_plain_torch_turns_kernel_blocks_back_into_the_torch_reference():
    """A run trained with Triton blocks must evaluate on CPU tensors where Triton is compiled (a GPU
    machine): the blocks become the plain NormActPool, in place, with the same state and output."""
    from fastcifar.kernels.bn_act_pool import TritonNormActPool
    from fastcifar.models.blocks import norm_factory
    from fastcifar.ops.norm_act_pool import as_plain_torch

    torch.manual_seed(0)
    model = ResNet9(widths=(4, 8, 8, 8), norm=norm_factory("triton")).eval()
    x = torch.randn(2, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels run where Triton can run them
    before = model.to(device)(x.to(device)).cpu()
    model.cpu()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert as_plain_torch(model) is model
    norms = [m for m in model.modules() if isinstance(m, NormActPool)]
    assert norms and all(type(m) is NormActPool for m in norms)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    torch.testing.assert_close(model(x), before, rtol=1e-4, atol=1e-5)
    assert not any(isinstance(m, TritonNormActPool) for m in model.modules())


def _per_rank_reference(norms, x, dy):
    """Each rank's block on its chunk: outputs and gradients side by side."""
    outs, grads = [], []
    for norm, chunk, d in zip(norms, x.chunk(len(norms)), dy.chunk(len(norms)), strict=True):
        chunk = chunk.detach().clone().requires_grad_()
        y = norm(chunk)
        y.backward(d)
        outs.append(y.detach())
        grads.append(chunk.grad)
    return torch.cat(outs), torch.cat(grads)


@pytest.mark.parametrize("momentum", [0.4, None], ids=["momentum", "cumulative"])
def test_emulated_ranks_batchnorm_keeps_each_ranks_statistics(momentum):
    """The per-rank block normalizes each rank's chunk alone (output and input gradient exactly
    the rank's own block's: the same kernel on the same chunk), and its running statistics after
    several steps are the average of the ranks' own, which is what average_buffers leaves after an
    epoch; in eval mode it is the plain block."""
    torch.manual_seed(0)
    ranks = 3
    block = per_rank(NormActPool, ranks)(6, act="gelu", pool="before", momentum=momentum)
    assert isinstance(block, PerRankStatistics) and isinstance(block, NormActPool) and block.ranks == ranks
    assert per_rank(NormActPool, 1) is NormActPool
    alone = [NormActPool(6, act="gelu", pool="before", momentum=momentum) for _ in range(ranks)]
    for norm in [block, *alone]:
        with torch.no_grad():
            norm.weight.copy_(torch.linspace(0.5, 1.5, 6))
            norm.bias.copy_(torch.linspace(-0.2, 0.3, 6))
    for step in range(3):
        x = (torch.randn(3 * 4, 6, 8, 8) * (1 + step) + torch.arange(12.0).view(12, 1, 1, 1)).contiguous(
            memory_format=CL
        )
        dy = torch.randn(12, 6, 4, 4).contiguous(memory_format=CL)
        want_y, want_dx = _per_rank_reference(alone, x, dy)
        xx = x.clone().requires_grad_()
        y = block(xx)
        y.backward(dy)
        assert torch.equal(y, want_y) and torch.equal(xx.grad, want_dx), f"step {step}"
        assert not torch.allclose(y, NormActPool(6, act="gelu", pool="before")(x), atol=1e-3), (
            "the ranks' chunks must differ from the whole batch (the test would prove nothing)"
        )
        for name in ("running_mean", "running_var"):
            mean = torch.stack([getattr(n, name) for n in alone]).mean(0)
            torch.testing.assert_close(getattr(block, name), mean, rtol=1e-6, atol=1e-7, msg=name)
    assert int(block.num_batches_tracked) == 3 == int(alone[0].num_batches_tracked)
    block.eval()
    plain = NormActPool(6, act="gelu", pool="before", momentum=momentum).eval()
    plain.load_state_dict(block.state_dict())
    x = torch.randn(6, 6, 8, 8).contiguous(memory_format=CL)
    assert torch.equal(block(x), plain(x))
    with pytest.raises(ValueError, match="does not split over 3 emulated ranks"):
        block.train()(torch.randn(4, 6, 8, 8))
