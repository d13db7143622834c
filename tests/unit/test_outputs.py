"""--save-outputs' parts: margins, the fp16 logits whose argmax stays the counted one, the files
(whole, memory-mappable) and their folders, and the rows of several ranks put back in the set's
order. The trainer writing them: tests/cli/test_api.py (one process) and
tests/distributed/test_outputs_ranks.py (two gloo ranks)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastcifar.parallel import distributed
from fastcifar.parallel.distributed import DistContext
from fastcifar.run import outputs


def test_margin_is_the_labels_logit_minus_the_largest_other():
    logits = torch.tensor([[1.0, 3.0, 2.0], [1.0, 3.0, 2.0], [4.0, 4.0, -1.0]])
    labels = torch.tensor([1, 2, 0])
    got = outputs.margins(logits, labels)
    assert got.dtype == torch.float32
    assert got.tolist() == [1.0, -1.0, 0.0]  # right by 1, wrong by 1, an exact tie


def test_fp16_logits_keep_the_argmax_the_accuracy_counted():
    # 10.0 and 10.001 are one fp16 value (its step is 2**-7 between 8 and 16): rounded plainly, the
    # row's argmax would move to class 0, which the fp32 evaluation did not count
    logits = torch.tensor([[10.0, 10.001, 3.0], [5.0, 5.0, 1.0], [-2.0, 0.5, 0.25]])
    assert np.asarray(logits.numpy().astype(np.float16)).argmax(1).tolist() == [0, 0, 1]
    half = outputs.as_fp16(logits)
    assert half.dtype == np.float16
    assert half.argmax(1).tolist() == logits.argmax(1).tolist() == [1, 0, 1]
    assert half[0, 1] == np.nextafter(np.float16(10.0), np.float16(np.inf))  # one step up, no more
    assert np.array_equal(half[1:], logits[1:].numpy().astype(np.float16))  # the other rows: plain rounding


def test_random_logits_keep_every_rows_argmax_within_one_fp16_step():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(20000, 10, generator=g) * 1e-3 + 9.0).float()  # dense near-ties, one fp16 step apart
    half = outputs.as_fp16(logits)
    assert (half.argmax(1) == logits.argmax(1).numpy()).all()
    step = np.spacing(np.float16(16.0)).astype(np.float32)
    assert np.abs(half.astype(np.float32) - logits.numpy()).max() <= step


def test_a_saved_array_maps_back_from_its_file_and_leaves_no_temporary(tmp_path):
    array = np.arange(60, dtype=np.float16).reshape(6, 10)
    outputs.save(tmp_path / "test_logits.npy", array)
    back = np.load(tmp_path / "test_logits.npy", mmap_mode="r")
    assert isinstance(back, np.memmap) and back.dtype == np.float16 and np.array_equal(back, array)
    assert [p.name for p in tmp_path.iterdir()] == ["test_logits.npy"]


def test_one_run_writes_outputs_and_several_one_folder_each(tmp_path):
    assert outputs.folder(tmp_path, 1, 1) == tmp_path / "outputs"
    assert outputs.folder(tmp_path, 2, 3) == tmp_path / "outputs-run2"


@pytest.mark.parametrize(
    "setting, test, train",
    [("none", False, False), ("test", True, False), ("train", False, True), ("both", True, True)],
)
def test_the_setting_names_what_is_kept(setting, test, train):
    assert outputs.wanted(setting) == (test, train)


@pytest.mark.parametrize("total", [7, 9, 10])
def test_rows_dealt_to_ranks_come_back_in_the_sets_order(monkeypatch, total):
    """Rank r of 3 holds items r, r + 3, ...: one all-gather of padded rows, padding dropped."""
    world = 3
    items = torch.arange(total * 2, dtype=torch.float32).view(total, 2)
    dealt = [items[r::world] for r in range(world)]

    def all_gather(parts, padded):  # every rank's padded rows, as gloo would hand them over
        for r, part in enumerate(parts):
            assert part.shape == padded.shape == (-(-total // world), 2)
            part.zero_()
            part[: len(dealt[r])] = dealt[r]

    monkeypatch.setattr(distributed.dist, "all_gather", all_gather)
    ctx = DistContext(1, world, 1, torch.device("cpu"), "gloo")
    assert torch.equal(distributed.all_gather_dealt(dealt[1], total, ctx), items)
    alone = DistContext(0, 1, 0, torch.device("cpu"), None)
    assert distributed.all_gather_dealt(items, total, alone) is items
