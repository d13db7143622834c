"""fastcifar.models.resnet9: ResNet-9's shapes, parameter count and logit scale."""

import torch

from fastcifar.models.resnet9 import ResNet9


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
