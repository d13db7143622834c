"""ResNet-9's shapes, parameter count and the NormActPool block's orders."""

import pytest
import torch
import torch.nn.functional as F

from fastcifar.core.config import ConfigError
from fastcifar.models.resnet9 import ResNet9
from fastcifar.ops.norm_act_pool import NormActPool


def channels_last(x):
    return x.contiguous(memory_format=torch.channels_last)


def test_resnet9_output_and_size():
    model = ResNet9().to(memory_format=torch.channels_last)
    out = model(channels_last(torch.randn(3, 3, 32, 32)))
    assert out.shape == (3, 10)
    # conv weights 3*64*9 + 64*128*9 + 2*128*128*9 + 128*256*9 + 256*512*9 + 2*512*512*9,
    # batchnorm scale+shift 2*(64+128*3+256+512*3), linear 512*10 without bias
    expected = (
        9 * (3 * 64 + 64 * 128 + 2 * 128 * 128 + 128 * 256 + 256 * 512 + 2 * 512 * 512)
        + 2 * (64 + 3 * 128 + 256 + 3 * 512)
        + 512 * 10
    )
    assert sum(p.numel() for p in model.parameters()) == expected
    assert model.fc.bias is None


def test_feature_map_sizes():
    model = ResNet9(widths=(8, 16, 32, 64))
    x = torch.randn(2, 3, 32, 32)
    x = model.prep(x)
    assert x.shape == (2, 8, 32, 32)
    x = model.layer1(x)
    assert x.shape == (2, 16, 16, 16)
    x = model.layer2(x)
    assert x.shape == (2, 32, 8, 8)
    x = model.layer3(x)
    assert x.shape == (2, 64, 4, 4)


def test_logit_scale():
    model = ResNet9(widths=(8, 16, 32, 64)).eval()
    x = torch.randn(2, 3, 32, 32)
    features = torch.amax(model.layer3(model.layer2(model.layer1(model.prep(x)))), dim=(2, 3))
    torch.testing.assert_close(model(x), model.fc(features) * 0.125)


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


def test_norm_act_pool_rejects_unknown_options():
    with pytest.raises(ValueError, match="unknown activation"):
        NormActPool(4, act="swish")
    with pytest.raises(ValueError, match="pool must be one of"):
        NormActPool(4, pool="middle")


def test_kernel_paths_resolve_and_build(monkeypatch):
    from fastcifar.kernels.bn_act_pool import TritonNormActPool
    from fastcifar.models.blocks import norm_factory, resolve_kernels

    assert resolve_kernels("auto", torch.device("cpu")) == "torch"
    assert resolve_kernels("auto", torch.device("cuda")) == "triton"
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: False)
        m.delenv("FASTCIFAR_ALLOW_INTERPRETER", raising=False)  # minutes per epoch: refused unless asked for
        with pytest.raises(ConfigError, match="FASTCIFAR_ALLOW_INTERPRETER=1"):
            resolve_kernels("triton", torch.device("cpu"))
        m.setenv("FASTCIFAR_ALLOW_INTERPRETER", "1")
        assert resolve_kernels("triton", torch.device("cpu")) == "triton"  # Triton's interpreter
        m.setattr(torch.cuda, "is_available", lambda: True)  # Triton compiles: CPU tensors would fail at launch
        with pytest.raises(ConfigError, match="--kernels triton on the CPU"):
            resolve_kernels("triton", torch.device("cpu"))
        assert resolve_kernels("triton", torch.device("cuda")) == "triton"
    model = ResNet9(widths=(4, 8, 8, 8), norm=norm_factory("triton"))
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert norms and all(isinstance(m, TritonNormActPool) for m in norms)
    assert set(model.state_dict()) == set(ResNet9(widths=(4, 8, 8, 8)).state_dict())
    with pytest.raises(ValueError):
        resolve_kernels("cuda", torch.device("cpu"))


@pytest.mark.parametrize("arch", ["resnet9", "fastnet"])
def test_auto_on_cuda_fuses_every_block(arch):
    """``--kernels auto`` on CUDA builds every block from the fused Triton kernel (it beat cuDNN's
    batchnorm on every block measured, resolve_kernels), on the CPU from the plain-torch one, with the
    same state either way (checkpoints move between them); under --compile the block is the custom op."""
    from fastcifar.core.config import from_preset
    from fastcifar.kernels.bn_act_pool import TritonNormActPool
    from fastcifar.models import compiled
    from fastcifar.models.blocks import norm_blocks
    from fastcifar.models.network import make_network

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    fast = arch == "fastnet"
    cfg = from_preset("fast" if fast else "resnet9", widths=(8, 16, 16) if fast else (4, 8, 8, 8))
    fused = make_network(cfg, norm_blocks("auto", cuda))
    norms = [m for m in fused.modules() if isinstance(m, NormActPool)]
    assert {m.pool for m in norms} >= {None} and len({m.pool for m in norms}) == 2  # pooled and unpooled
    assert all(isinstance(m, TritonNormActPool) for m in norms)
    assert norm_blocks("triton", cuda) is TritonNormActPool and norm_blocks("auto", cpu) is NormActPool
    assert norm_blocks("torch", cuda) is NormActPool
    assert set(fused.state_dict()) == set(make_network(cfg, NormActPool).state_dict())
    assert compiled.norm_for(norm_blocks("auto", cuda), True).__name__ == "CompiledNormActPool"


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
