"""The steps captured as CUDA graphs never read a device value on the host (issue 11, item 3).

A CUDA graph replays device work only: a host read inside the captured region (``.item()``,
``bool(tensor)``, ``int(tensor)``, an op whose output shape depends on the data, or a fresh
``torch.tensor(...)`` of host values) either breaks the capture or is frozen into the graph with
the value it had at capture. ``SyncFree`` is a dispatch mode that fails on each of those; the real
training step (model, summed label-smoothed loss, backward, gradient buckets with a 1-rank gloo
all-reduce, Nesterov SGD or Muon with the device-side schedule) and the evaluation step with every TTA
level run under it on the CPU, so such a read fails CI instead of a capture on the GPU.

What this cannot see: host-to-device copies of CPU tensors (everything is on the CPU here), and
work inside Triton kernels or DALI (not dispatched through torch).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fastcifar.core.config import from_preset
from fastcifar.models.network import build_model
from fastcifar.parallel import comm
from fastcifar.run import recipe
from fastcifar.run.graphs import EvalStep, StaticBatch, TrainStep
from fastcifar.run.schedule import DeviceSchedule, lr_schedule
from fastcifar.run.step import make_step

aten = torch.ops.aten
CPU = torch.device("cpu")


class HostSyncError(AssertionError):
    pass


class SyncFree(TorchDispatchMode):
    """Fails on every op that reads device data on the host or sizes its output by the data."""

    FORBIDDEN = {
        aten._local_scalar_dense.default: "reads a tensor's value on the host (.item(), bool(), int(), float())",
        aten.lift_fresh.default: "torch.tensor(...) of host values: a host-to-device copy, frozen at capture",
        aten.lift_fresh_copy.default: "torch.tensor(...) of host values: a host-to-device copy, frozen at capture",
    }

    def __init__(self):
        super().__init__()
        self.seen = set()  # names of the ops checked: the tests show backward and comm were in view

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add(str(func.overloadpacket))
        why = self.FORBIDDEN.get(func)
        if why is None and torch.Tag.dynamic_output_shape in func.tags:
            why = "its output shape depends on the data (the host must read it)"
        if why is None and torch.Tag.data_dependent_output in func.tags:
            why = "its result is a host value computed from the data"
        if why is not None:
            raise HostSyncError(f"{func} inside a captured step: {why}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "name, body",
    [
        ("item", lambda t: t.sum().item()),
        ("bool", lambda t: bool(t.sum() > 0)),
        ("int", lambda t: int(t.argmax())),
        ("python if", lambda t: 1 if (t > 0).any() else 0),
        ("nonzero", lambda t: t.nonzero()),
        ("boolean mask", lambda t: t[t > 0]),
        ("fresh tensor", lambda t: t + torch.tensor([0.5, 1.0, 1.5])),
    ],
)
def test_the_mode_catches_each_kind_of_host_read(name, body):
    t = torch.randn(3)
    body(t)  # fine outside the mode
    with pytest.raises(HostSyncError), SyncFree():
        body(t)


def test_the_mode_lets_device_only_work_through():
    t = torch.randn(4, 3, requires_grad=True)
    with SyncFree():
        loss = torch.nn.functional.cross_entropy(t, torch.zeros(4, dtype=torch.int64), label_smoothing=0.2)
        loss.backward()
        hits = (t.argmax(1) == 0).sum()
    assert t.grad is not None and hits.shape == ()


def _setup(preset: str, widths, buckets: bool, batch: int = 16):
    cfg = from_preset(preset, widths=widths, epochs=2)
    torch.manual_seed(0)
    model = build_model(cfg, CPU, torch.float32)
    grad_buckets = comm.GradBuckets(model.parameters(), bucket_mb=0.01) if buckets else None
    schedule = DeviceSchedule(lr_schedule(cfg, steps=4, peak=0.01), CPU)  # the trainer's, 8 steps
    opt = recipe.make_optimizer(model, cfg, batch, peak=0.01)  # NesterovSGD, or Muon + SGD with fast-muon
    step = TrainStep(
        make_step(model, opt, schedule, cfg.label_smoothing, buckets=grad_buckets),
        StaticBatch(batch, torch.float32, CPU),
        capture=False,
    )
    g = torch.Generator().manual_seed(1)
    step.batch.load(
        torch.randn(batch, 3, 32, 32, generator=g).contiguous(memory_format=torch.channels_last),
        torch.randint(0, 10, (batch,), generator=g),
    )
    return cfg, model, step, schedule, grad_buckets


@pytest.mark.parametrize(
    "preset, widths", [("fast", (8, 16, 16)), ("fast-muon", (8, 16, 16)), ("resnet9", (8, 16, 16, 32))]
)
def test_training_step_is_sync_free(one_rank_group, preset, widths):
    cfg, model, step, schedule, buckets = _setup(preset, widths, buckets=True)
    model.train()
    step.warm_up_and_capture(2)  # eagerly, as before a capture: the first step allocates state
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with SyncFree() as mode:
        for _ in range(2):
            step._body()  # exactly what TrainStep captures
    assert int(schedule.counter) == 4
    for op in ("aten.convolution_backward", "aten.index_select", "c10d.allreduce_"):
        assert op in mode.seen, f"{op} never reached the check: {sorted(mode.seen)}"
    changed = [k for k, v in model.state_dict().items() if v.is_floating_point() and not torch.equal(v, before[k])]
    assert changed, "the checked steps changed nothing: did they run?"
    assert float(step.loss_sum) > 0 and buckets is not None


def test_a_host_read_slipped_into_the_step_fails(one_rank_group):
    """The check is live on the real step: the loss read with .item() inside it is caught."""
    cfg, model, step, _, _ = _setup("fast", (8, 16, 16), buckets=False)
    model.train()
    step.warm_up_and_capture(1)
    inner = step.step_fn

    def leaky(images, labels):
        loss, hits = inner(images, labels)
        if loss.item() > 1e9:  # e.g. a divergence check placed inside the step
            raise RuntimeError("diverged")
        return loss, hits

    step.step_fn = leaky
    with pytest.raises(HostSyncError, match="_local_scalar_dense"), SyncFree():
        step._body()


@pytest.mark.parametrize("tta, share", [(0, 1.0), (1, 1.0), (2, 1.0), (2, 0.25)])
def test_eval_step_is_sync_free(tta, share):
    cfg, model, step, _, _ = _setup("fast", (8, 16, 16), buckets=False)
    model.eval()
    ev = EvalStep(model, StaticBatch(12, torch.float32, CPU), tta, capture=False, tta_share=share)
    g = torch.Generator().manual_seed(2)
    images = torch.randn(7, 3, 32, 32, generator=g).contiguous(memory_format=torch.channels_last)
    ev.batch.load(images, torch.randint(0, 10, (7,), generator=g))  # a partial batch: 7 valid of 12
    with SyncFree():
        ev._body()
    assert int(ev.correct) <= 7 and float(ev.loss_sum) > 0
