"""fastcifar.ops.tta: test-time augmentation's shapes, flip and translation views, level-2 weights,
and the TTA share that gives the extra views to the least confident rows only;
the model fed channels-last under CUDA's pad layouts (``cuda_layouts``, tests/conftest.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fastcifar.ops.tta import least_sure, share_views, translations, tta_logits, views_logits

CL = torch.channels_last


class Symmetric(torch.nn.Module):
    """A model whose output is the same for an image and its mirror image."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 10, 3)

    def forward(self, x):
        return (self.conv(x) + self.conv(x.flip(3))).mean((2, 3))


def test_tta_shapes_and_flip_tta_of_a_symmetric_model_is_the_plain_output():
    torch.manual_seed(0)
    model = Symmetric().eval()
    x = torch.randn(5, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    plain = tta_logits(model, x, 0)
    assert plain.shape == (5, 10) and plain.dtype == torch.float32
    torch.testing.assert_close(tta_logits(model, x, 1), plain)
    assert tta_logits(model, x, 2).shape == (5, 10)
    asym = torch.nn.Sequential(torch.nn.Conv2d(3, 10, 3), torch.nn.Flatten(), torch.nn.LazyLinear(10)).eval()
    asym(x)
    assert not torch.allclose(tta_logits(asym, x, 1), tta_logits(asym, x, 0))
    with pytest.raises(ValueError, match="TTA level"):
        tta_logits(model, x, 3)


@pytest.mark.parametrize("level", [1, 2])
def test_a_tta_share_gives_the_views_to_the_least_confident_rows_only(level):
    """--tta-share: one plain pass, then the level's views for the ceil(share x B) rows whose top
    probability is lowest; every other row keeps its plain logits."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 10, 3), torch.nn.Flatten(), torch.nn.LazyLinear(10)).eval()
    x = torch.randn(10, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        plain, full = tta_logits(model, x, 0), tta_logits(model, x, level)
        shared = tta_logits(model, x, level, share=0.25)
    confidence = plain.softmax(1).amax(1)
    least = set(confidence.argsort()[:3].tolist())  # ceil(0.25 x 10) = 3
    for row in range(10):
        torch.testing.assert_close(shared[row], (full if row in least else plain)[row])
    assert not torch.allclose(full[sorted(least)], plain[sorted(least)])  # the views changed those rows
    with torch.no_grad():
        torch.testing.assert_close(tta_logits(model, x, level, share=1.0), full)
        torch.testing.assert_close(tta_logits(model, x, 0, share=0.25), plain)  # no views to give
        # padding rows (valid 0) are never chosen: the least sure of the 7 real ones are, ceil(0.25 x 7) = 2
        valid = torch.ones(10, dtype=torch.bool)
        valid[sorted(least)] = False
        masked = tta_logits(model, x, level, share=0.25, valid=valid)
    real_least = set(confidence.masked_fill(~valid, 2.0).argsort()[:2].tolist())
    assert real_least.isdisjoint(least)
    for row in range(10):
        torch.testing.assert_close(masked[row], (full if row in real_least else plain)[row])
    # a padded batch of 10 holding 4 real rows: the views go to ceil(0.25 x 4) = 1 of them, as they
    # would in a batch of those 4 alone, though the count computed is ceil(0.25 x 10) = 3
    valid = torch.zeros(10, dtype=torch.bool)
    valid[:4] = True
    with torch.no_grad():
        padded = tta_logits(model, x, level, share=0.25, valid=valid)
        alone = tta_logits(model, x[:4], level, share=0.25)
    torch.testing.assert_close(padded[:4], alone)
    assert sum(not torch.allclose(alone[r], plain[r]) for r in range(4)) == 1
    for share in (0.0, 1.5):
        with pytest.raises(ValueError, match="TTA share"):
            tta_logits(model, x, level, share=share)


def test_translations_shift_by_one_pixel_with_reflection():
    x = torch.arange(2 * 3 * 6 * 6, dtype=torch.float32).view(2, 3, 6, 6)
    down_right, up_left = translations(x)
    torch.testing.assert_close(down_right[:, :, 1:, 1:], x[:, :, :-1, :-1])
    torch.testing.assert_close(up_left[:, :, :-1, :-1], x[:, :, 1:, 1:])
    torch.testing.assert_close(down_right[:, :, 0, 1:], x[:, :, 1, :-1])  # row -1 reflects row 1


def test_tta_level2_weights():
    # A linear "model" (mean of the image): TTA is then the weighted mean over the 6 views.
    x = torch.randn(3, 3, 8, 8)
    model = lambda t: t.mean((1, 2, 3))[:, None].repeat(1, 10)  # noqa: E731
    a, b = translations(x)
    want = 0.5 * x.mean((1, 2, 3)) + 0.25 * a.mean((1, 2, 3)) + 0.25 * b.mean((1, 2, 3))
    torch.testing.assert_close(tta_logits(model, x, 2)[:, 0], want)


@pytest.mark.parametrize("level", [0, 1, 2])
def test_tta_feeds_the_model_channels_last_under_cuda_layouts(cuda_layouts, level):
    """TTA level 2 pads (reflect) for its shifted views: the model (Triton NormActPool checks
    channels-last) must still see a channels-last batch."""
    seen = []

    def model(x):
        seen.append(x.is_contiguous(memory_format=CL))
        return x.float().mean(dim=(2, 3))

    batch = torch.randn(4, 3, 8, 8).contiguous(memory_format=CL)
    tta_logits(model, batch, level)
    assert seen and all(seen)


def test_least_sure_picks_the_globally_least_confident_rows():
    """ceil(share x N) rows of lowest top probability over all N, least sure first, ties in row
    order, NaN (an overflow) least sure of all; against a plain argsort."""
    torch.manual_seed(3)
    logits = torch.randn(37, 10) * 3
    logits[5] = logits[9]  # a tie: row 5 before row 9 wherever they fall
    logits[20, 0] = float("nan")
    for share in (0.01, 0.25, 0.5, 1.0):
        picked = least_sure(logits, share)
        confidence = logits.softmax(1).amax(1).nan_to_num(nan=-1.0).numpy()
        want = np.argsort(confidence, kind="stable")[: math.ceil(share * 37)]
        assert picked.tolist() == want.tolist()
        assert picked[0].item() == 20
    assert least_sure(logits, 0.25).shape == (10,)


def test_share_views_replaces_the_least_sure_rows_of_the_whole_set_only():
    """--tta-scope test: the views' logits, asked for a batch of rows at a time, go to the least sure
    share of all rows, in place; every other row keeps its plain logits; a plain-PyTorch reference."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 10, 3), torch.nn.Flatten(), torch.nn.LazyLinear(10)).eval()
    x = torch.randn(23, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    asked = []
    with torch.no_grad():
        plain = model(x)
        full = views_logits(model, x, 2)

        def views(rows):
            asked.append(len(rows))
            return views_logits(model, x[rows], 2)

        shared = share_views(plain.clone(), 0.3, 4, views)
    least = plain.softmax(1).amax(1).argsort()[:7]  # ceil(0.3 x 23)
    want = plain.clone()
    want[least] = full[least]
    torch.testing.assert_close(shared, want)
    assert asked == [4, 3]
    assert not torch.allclose(full[least], plain[least])
