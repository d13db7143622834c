"""CUDA graphs on a GPU: graphed and eager training agree, replays do not grow memory, and the
captured evaluation counts what eager evaluation counts. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from fastcifar.core.config import Config
from fastcifar.models.network import build_model
from fastcifar.run.graphs import EvalStep, StaticBatch, TrainStep
from fastcifar.run.optim import NesterovSGD
from fastcifar.run.schedule import DeviceSchedule
from fastcifar.run.step import make_step

pytestmark = pytest.mark.cuda

STEPS, BATCH = 6, 64


def batches(n, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [
        (
            torch.randn(BATCH, 3, 32, 32, device="cuda", generator=g)
            .half()
            .contiguous(memory_format=torch.channels_last),
            torch.randint(0, 10, (BATCH,), device="cuda", generator=g),
        )
        for _ in range(n)
    ]


def trained(capture: bool, kernels: str = "torch"):
    torch.manual_seed(0)
    cfg = Config(widths=(32, 64, 128, 256), kernels=kernels)
    model = build_model(cfg, torch.device("cuda"), torch.float16)
    opt = NesterovSGD(model.parameters(), lr=0.0, momentum=0.9, weight_decay=5e-4 * BATCH)
    schedule = DeviceSchedule([0.4 / BATCH * (i + 1) / STEPS for i in range(STEPS)], torch.device("cuda"))
    step = TrainStep(
        make_step(model, opt, schedule, 0.2), StaticBatch(BATCH, torch.float16, torch.device("cuda")), capture=capture
    )
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    data = batches(STEPS)
    step.batch.load(*data[0])
    model.train()
    step.warm_up_and_capture(3)
    model.load_state_dict(initial)
    opt.reset_state()
    schedule.reset()
    for images, labels in data:
        step(images, labels)
    torch.cuda.synchronize()
    return model, step


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_graphed_training_matches_eager(kernels):
    eager, _ = trained(False, kernels)
    graphed, step = trained(True, kernels)
    assert step.graph is not None
    for (name, a), b in zip(eager.state_dict().items(), graphed.state_dict().values(), strict=True):
        if a.is_floating_point():
            torch.testing.assert_close(
                b.float(), a.float(), rtol=2e-2, atol=2e-3, msg=lambda m, name=name: f"{name}: {m}"
            )


def test_replays_do_not_grow_memory():
    _, step = trained(True)
    images, labels = batches(1, seed=1)[0]
    step(images, labels)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(50):
        step(images, labels)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


@pytest.mark.parametrize("tta, share", [(1, 1.0), (2, 0.25)])
def test_captured_eval_equals_eager_eval(tta, share):
    """--tta-share's choice of rows (a top-k of fixed size) replays from the graph as it ran eagerly."""
    model, _ = trained(False)
    model.eval()
    x, y = batches(3, seed=2)[0]
    images = torch.cat([x, x[:40]])  # 104 images: batches of 48 + 48 + 8 (padded)
    labels = torch.cat([y, y[:40]])
    counts = []
    for capture in (False, True):
        ev = EvalStep(
            model, StaticBatch(48, torch.float16, torch.device("cuda")), tta=tta, capture=capture, tta_share=share
        )
        ev.batch.load(images[:48], labels[:48])
        ev.prepare()
        for start in range(0, len(labels), 48):
            ev(images[start : start + 48], labels[start : start + 48])
        torch.cuda.synchronize()
        counts.append((ev.correct.item(), ev.loss_sum.item()))
    assert counts[0][0] == counts[1][0]
    assert counts[0][1] == pytest.approx(counts[1][1], rel=1e-3)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_eager_steps_make_no_host_sync(kernels):
    """The GPU half of tests/unit/test_sync_free.py: with CUDA's sync debug mode set to "error", one eager
    training step (after warm-up) and TTA-2 evaluation batches, of every image and of the least sure
    quarter (--tta-share 0.25: its sort, gathers and device-side count), raise on any synchronizing
    call, including the host-to-device copies the CPU test cannot see."""
    model, step = trained(False, kernels)
    images, labels = batches(1, seed=3)[0]
    step.batch.load(images, labels)
    evs = [
        EvalStep(model, StaticBatch(48, torch.float16, torch.device("cuda")), tta=2, capture=False, tta_share=share)
        for share in (1.0, 0.25)
    ]
    for ev in evs:
        ev.batch.load(images[:40], labels[:40])  # a partial batch: the valid mask is in play
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model.train()
        step._body()
        model.eval()
        for ev in evs:
            ev._body()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
    assert all(ev.loss_sum.item() > 0 for ev in evs)
