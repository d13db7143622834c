"""FastNet's shapes and blocks, and the whitening conv initialized from data patches."""

import functools

import pytest
import torch
import torch.nn.functional as F
from conftest import make_images

from fastcifar.models.fastnet import FastNet, init_whitening, patch_covariance, patches, whitening_weights
from fastcifar.ops.augment import normalize
from fastcifar.ops.norm_act_pool import NormActPool


def data_images(n=300, seed=0):
    """Normalized NCHW images with strongly correlated neighbouring pixels (blocky templates)."""
    images, _ = make_images(n, seed=seed, noise=20.0)
    return normalize(torch.from_numpy(images)).contiguous()


def test_shapes_and_pool_before_norm():
    model = FastNet(widths=(8, 16, 32)).to(memory_format=torch.channels_last)
    x = torch.randn(3, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    assert model(x).shape == (3, 10)
    assert model.whiten.weight.shape == (24, 3, 2, 2) and model.whiten.bias is not None
    h = F.gelu(model.whiten(x))
    assert h.shape == (3, 24, 31, 31)  # 2x2 conv, no padding
    sizes = []
    for block in model.blocks:
        assert block.conv1.norm.pool == "before" and block.conv2.norm.pool is None
        assert block.conv1.norm.act == "gelu"
        h = block(h)
        sizes.append(tuple(h.shape[1:]))
    assert sizes == [(8, 15, 15), (16, 7, 7), (32, 3, 3)]
    assert model.fc.bias is None and model.fc.in_features == 32


def test_kernel3_and_default_widths():
    model = FastNet(whiten_kernel=3)
    assert model.whiten.weight.shape == (54, 3, 3, 3)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    full = FastNet()
    assert [b.conv1.conv.out_channels for b in full.blocks] == [64, 256, 256]


def test_logit_scale_and_global_max_pool():
    model = FastNet(widths=(8, 16, 32)).eval()
    x = torch.randn(2, 3, 32, 32)
    features = torch.amax(model.blocks(F.gelu(model.whiten(x))), dim=(2, 3))
    torch.testing.assert_close(model(x), model.fc(features) / 9)


def test_dirac_init_of_block_convs():
    model = FastNet(widths=(8, 16, 32))
    conv = model.blocks[1].conv1.conv  # 8 -> 16
    w = conv.weight.detach()
    for o in range(8):
        expected = torch.zeros(8, 3, 3)
        expected[o, 1, 1] = 1.0
        assert torch.equal(w[o], expected), o
    assert w[8:].abs().sum() > 0  # the other filters keep their random init


def test_norm_factory_is_used_with_its_options():
    calls = []

    def norm(c, act="relu", pool=None, **kw):
        calls.append((c, act, pool, kw))
        return NormActPool(c, act=act, pool=pool, **kw)

    FastNet(widths=(8, 16, 32), norm=functools.partial(norm, momentum=0.4))
    assert len(calls) == 6 and all(kw == {"momentum": 0.4} for *_, kw in calls)
    assert [pool for _, _, pool, _ in calls] == ["before", None] * 3


def test_patches_match_conv_weight_layout():
    x = torch.randn(2, 3, 5, 5)
    w = torch.randn(7, 3, 2, 2)
    via_conv = F.conv2d(x, w).permute(0, 2, 3, 1).reshape(-1, 7)
    via_patches = patches(x, 2) @ w.reshape(7, -1).T
    torch.testing.assert_close(via_conv, via_patches)


@pytest.mark.parametrize("kernel", [2, 3])
def test_whitened_patches_have_identity_covariance(kernel):
    images = data_images()
    conv = torch.nn.Conv2d(3, 2 * 3 * kernel * kernel, kernel, bias=False)
    init_whitening(conv, images, eps=1e-9, centred=True)  # the centred option (the second moment: test_recipe_parity)
    d = 3 * kernel * kernel
    out = F.conv2d(images.double(), conv.weight.double())[:, :d]  # the positive half
    flat = out.permute(0, 2, 3, 1).reshape(-1, d)
    cov = torch.cov(flat.T)
    n = flat.shape[0]
    torch.testing.assert_close(cov * (n - 1) / n, torch.eye(d, dtype=torch.float64), atol=1e-6, rtol=0)
    # and the data really were correlated: the raw patches are far from white
    raw = torch.cov(patches(images.double(), kernel).T)
    assert (raw - torch.diag(raw.diag())).abs().max() > 0.3
    # the second half is the first negated
    torch.testing.assert_close(conv.weight[d:], -conv.weight[:d])


def test_eps_shrinks_weak_directions_only():
    images = data_images()
    total, outer, count = patch_covariance(images, 2)
    w = whitening_weights(total, outer, count, 2, eps=5e-4, centred=True)[:12].reshape(12, 12)
    cov = outer / count - torch.outer(total / count, total / count)
    white = w @ cov @ w.T
    eigenvalues = torch.linalg.eigvalsh(cov).flip(0)
    torch.testing.assert_close(white.diag(), eigenvalues / (eigenvalues + 5e-4))
    assert (white.diag() <= 1).all() and white.diag()[0] > 0.999
    off = white - torch.diag(white.diag())
    assert off.abs().max() < 1e-9


def test_chunked_covariance_equals_one_pass():
    images = data_images(50)
    a = patch_covariance(images, 2, chunk=7)
    b = patch_covariance(images, 2, chunk=1000)
    torch.testing.assert_close(a[0], b[0])
    torch.testing.assert_close(a[1], b[1])
    assert a[2] == b[2] == 50 * 31 * 31


def test_reduce_sees_the_parts_and_weights_land_in_place_in_the_conv_dtype():
    images = data_images(40)
    conv = torch.nn.Conv2d(3, 24, 2).half()
    storage = conv.weight.data_ptr()
    seen = []

    def reduce(parts):  # two identical "ranks": sums double, weights do not change
        seen.append(parts.numel())
        parts.mul_(2)

    w = init_whitening(conv, images, reduce=reduce)
    assert seen == [12 + 144 + 1]
    assert conv.weight.dtype == torch.float16 and conv.weight.data_ptr() == storage
    alone = init_whitening(torch.nn.Conv2d(3, 24, 2), images)
    torch.testing.assert_close(w, alone)
