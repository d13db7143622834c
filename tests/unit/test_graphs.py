"""fastcifar.run.graphs. Without a GPU: the decision, the device schedule, the static buffers, eager
train and eval steps over them, the CPU refusal, and the captured steps' freedom from host reads
(``SyncFree`` below). On a GPU (``cuda``-marked, skipped without CUDA): graphed and eager training
agree, replays do not grow memory, and the captured evaluation counts what eager evaluation counts."""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from cli import SHORT, run_dirs, train_here
from conftest import one_line_error
from torch.utils._python_dispatch import TorchDispatchMode

from fastcifar.core.config import Config, ConfigError, from_preset, validate
from fastcifar.data.loader import EvalSet
from fastcifar.models.network import build_model
from fastcifar.models.resnet9 import ResNet9
from fastcifar.ops.tta import tta_logits, views_logits
from fastcifar.parallel import comm
from fastcifar.parallel.compress import why_not_capturable
from fastcifar.parallel.distributed import DistContext
from fastcifar.parallel.sync import capture_blocker
from fastcifar.run import recipe
from fastcifar.run.graphs import EvalStep, StaticBatch, TrainStep, WholeTestEvalStep, make_eval_step, resolve
from fastcifar.run.optim import NesterovSGD
from fastcifar.run.schedule import DeviceSchedule, lr_schedule
from fastcifar.run.step import evaluate, make_step

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_resolve():
    assert resolve("auto", CPU) == (False, "") and resolve("off", CPU) == (False, "")
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        resolve("on", CPU)
    assert resolve("auto", CUDA) == (True, "") and resolve("on", CUDA) == (True, "")
    assert resolve("off", CUDA) == (False, "")
    ddp = capture_blocker(Config(comm="ddp"), world_size=2)
    assert resolve("auto", CUDA, ddp) == (False, "")
    with pytest.raises(ConfigError, match="--comm bucketed"):
        resolve("on", CUDA, ddp)
    assert capture_blocker(Config(comm="ddp"), world_size=1) == ("", "")
    # --dist-group always: one rank in a group runs DDP's reducer too, which cannot be captured
    assert capture_blocker(Config(comm="ddp"), world_size=1, grouped=True) == ddp
    assert capture_blocker(Config(comm="bucketed"), world_size=1, grouped=True) == ("", "")
    with pytest.raises(ConfigError, match="auto, on or off"):
        resolve("yes", CPU)


@pytest.mark.parametrize("overrides", [{"compress": "threshold"}, {"compress": "topk", "compress_warmup_steps": 5}])
def test_resolve_weighs_the_compressions_reason_on_several_ranks(overrides):
    """One decision for the compressor's veto: ``on`` refused with its reason, ``auto`` off with a
    note, and one rank (which compresses nothing) captures as usual."""
    why = why_not_capturable(Config(**overrides))
    assert why
    blocker = capture_blocker(Config(comm="bucketed", **overrides), world_size=2)
    with pytest.raises(ConfigError, match=r"--cuda-graphs on cannot capture this step: .*--cuda-graphs off"):
        resolve("on", CUDA, blocker)
    assert resolve("auto", CUDA, blocker) == (False, f"note: CUDA graphs off: {why}")
    assert resolve("off", CUDA, blocker) == (False, "")
    one_rank = capture_blocker(Config(comm="bucketed", **overrides), world_size=1)
    assert resolve("on", CUDA, one_rank) == (True, "")
    validate(Config(cuda_graphs="on", **overrides))  # the settings themselves are fine: resolve decides
    assert why_not_capturable(Config(compress="topk")) == ""  # fixed-size payloads can be captured


def test_device_schedule_steps_on_the_device():
    sched = DeviceSchedule([0.1, 0.2, 0.3], CPU)
    lr = torch.zeros(())
    seen = []
    for _ in range(4):
        sched.apply(lr)
        seen.append(lr.item())
    assert seen == pytest.approx([0.1, 0.2, 0.3, 0.3])  # past the end: the last value
    sched.reset()
    sched.apply(lr)
    assert lr.item() == pytest.approx(0.1) and sched.counter.item() == 1
    with pytest.raises(ValueError):
        DeviceSchedule([], CPU)


def test_static_batch_keeps_storage_and_masks_padding():
    batch = StaticBatch(4, torch.float32, CPU)
    ptr = batch.images.data_ptr()
    assert batch.images.is_contiguous(memory_format=torch.channels_last)
    x = torch.randn(4, 3, 32, 32)
    assert batch.load(x, torch.arange(4)) == 4 and torch.equal(batch.images, x) and batch.valid.all()
    assert batch.load(x[:3], torch.tensor([7, 8, 9])) == 3
    assert batch.valid.tolist() == [True, True, True, False]
    assert not batch.images[3].any() and batch.labels.tolist() == [7, 8, 9, 0]
    assert batch.load(x, torch.arange(4)) == 4 and batch.valid.all(), "a full batch after a partial one"
    assert batch.images.data_ptr() == ptr, "buffers must never be reallocated"
    with pytest.raises(ValueError, match="exceeds"):
        batch.load(torch.randn(5, 3, 32, 32), torch.zeros(5, dtype=torch.int64))
    with pytest.raises(ValueError, match="does not fit"):
        batch.load(torch.randn(2, 3, 16, 16), torch.zeros(2, dtype=torch.int64))


def tiny_model():
    torch.manual_seed(0)
    return ResNet9(widths=(4, 8, 8, 8)).to(memory_format=torch.channels_last)


@pytest.mark.slow  # over 2 s on 2 cores
def test_eager_train_step_accumulates_metrics():
    model = tiny_model()
    calls = []

    def step(images, labels):
        calls.append(images.data_ptr())
        logits = model(images)
        return F.cross_entropy(logits, labels, reduction="sum").detach(), (logits.argmax(1) == labels).sum()

    train = TrainStep(step, StaticBatch(3, torch.float32, CPU), capture=False)
    x, y = torch.randn(3, 3, 32, 32), torch.tensor([1, 2, 3])
    train.batch.load(x, y)
    train.warm_up_and_capture(2)
    assert len(calls) == 2 and train.loss_sum.item() == 0 and train.graph is None
    train(x, y)
    train(x, y)
    with torch.no_grad():
        want = 2 * F.cross_entropy(model(x), y, reduction="sum")
    assert train.loss_sum.item() == pytest.approx(want.item(), rel=1e-5)
    assert len(set(calls)) == 1, "the step must always read the static buffer"


class FakeGraph:
    """Stands in for a captured CUDA graph on the CPU: counts its replays."""

    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


def test_train_step_replays_the_selected_variant(monkeypatch):
    """Each captured variant is its own graph; the step replays the default until ``select``, the
    selected one after, and refuses a variant nobody captured (capturing on the clock would be
    the alternative). Eagerly, ``select`` records the name and the body runs."""
    import fastcifar.run.graphs as graphs

    made = []
    monkeypatch.setattr(graphs, "capture", lambda body, iters, stream=None: made.append(FakeGraph()) or made[-1])
    calls = []
    step = TrainStep(
        lambda x, y: calls.append(1) or (torch.zeros(()), torch.zeros((), dtype=torch.int64)),
        StaticBatch(2, torch.float32, CPU),
        capture=True,
    )
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([0, 1])
    step.warm_up_and_capture(2)
    step.warm_up_and_capture(2, "frozen")
    assert step.graph is made[0] and step.variant == TrainStep.DEFAULT
    step(x, y)
    step.select("frozen")
    step(x, y)
    step(x, y)
    assert [g.replays for g in made] == [1, 2] and not calls
    with pytest.raises(RuntimeError, match="no captured training step 'other'"):
        step.select("other")
    eager = TrainStep(
        lambda x, y: calls.append(1) or (torch.zeros(()), torch.zeros((), dtype=torch.int64)),
        StaticBatch(2, torch.float32, CPU),
        capture=False,
    )
    eager.select("anything")
    eager(x, y)
    assert eager.variant == "anything" and eager.graph is None and len(calls) == 1


def test_eval_step_with_padded_last_batch_equals_direct_evaluation():
    model = tiny_model().eval()
    x, y = torch.randn(11, 3, 32, 32), torch.randint(0, 10, (11,))
    ev = EvalStep(model, StaticBatch(4, torch.float32, CPU), tta=True, capture=False)
    ev.prepare()
    for start in range(0, 11, 4):  # 4 + 4 + 3: the last batch is padded and masked
        ev(x[start : start + 4], y[start : start + 4])
    with torch.no_grad():
        logits = 0.5 * (model(x) + model(x.flip(3)))
    assert ev.correct.item() == (logits.argmax(1) == y).sum().item()
    assert ev.loss_sum.item() == pytest.approx(F.cross_entropy(logits, y, reduction="sum").item(), rel=1e-5)


def test_eval_step_gives_its_tta_share_to_the_least_confident_valid_rows():
    """The trainer's evaluation with --tta-share: per padded batch, the views go to the least sure
    of its valid rows; the padding of the last batch is never among them."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 10, 3), torch.nn.Flatten(), torch.nn.LazyLinear(10)).eval()
    x, y = torch.randn(11, 3, 32, 32), torch.randint(0, 10, (11,))
    model(x[:1])
    ev = EvalStep(model, StaticBatch(4, torch.float32, CPU), tta=2, capture=False, tta_share=0.5)
    ev.prepare()
    for start in range(0, 11, 4):  # 4 + 4 + 3: the last batch is padded and masked
        ev(x[start : start + 4], y[start : start + 4])
    with torch.no_grad():  # the same share of each batch of 4, and of the last one's 3 real rows alone
        logits = torch.cat([tta_logits(model, x[s : s + 4], 2, share=0.5) for s in (0, 4, 8)])
        every = tta_logits(model, x, 2)
    assert not torch.allclose(logits, every)  # half the rows kept their plain view
    assert ev.correct.item() == (logits.argmax(1) == y).sum().item()
    assert ev.loss_sum.item() == pytest.approx(F.cross_entropy(logits, y, reduction="sum").item(), rel=1e-5)


def test_eval_step_keeps_the_logits_it_counted_only_when_asked():
    """--save-outputs: the kept rows are the very logits the correct count was summed from (TTA
    share and padded last batch included), one tensor per batch; reset starts over; unasked, no
    copy is made."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 10, 3), torch.nn.Flatten(), torch.nn.LazyLinear(10)).eval()
    x, y = torch.randn(11, 3, 32, 32), torch.randint(0, 10, (11,))
    model(x[:1])
    ev = EvalStep(model, StaticBatch(4, torch.float32, CPU), tta=2, capture=False, tta_share=0.5)
    ev.prepare()
    ev(x[:4], y[:4])
    assert ev.kept is None
    ev.keep_logits()
    for _ in range(2):  # a second evaluation replaces the first's rows
        ev.reset()
        for start in range(0, 11, 4):  # 4 + 4 + 3: the last batch is padded and masked
            ev(x[start : start + 4], y[start : start + 4])
        assert [len(k) for k in ev.kept] == [4, 4, 3]
    kept = torch.cat(ev.kept)
    with torch.no_grad():
        expected = torch.cat([tta_logits(model, x[s : s + 4], 2, share=0.5) for s in (0, 4, 8)])
    torch.testing.assert_close(kept, expected, rtol=1e-5, atol=1e-6)  # a padded batch of 4 rounds as it likes
    assert ev.correct.item() == (kept.argmax(1) == y).sum().item()
    ev(x[:4], y[:4])
    assert ev.kept[-1].data_ptr() != ev.logits.data_ptr()  # a copy: the next batch cannot overwrite it


def test_timed_eval_times_a_slice_on_the_cpu_and_the_whole_batch_elsewhere(monkeypatch):
    """On the CPU the estimate times the step's own TTA (its views, shifts and stacking) of 64 of the
    batch's images, the second of two times, scaled to the whole padded batch (a whole CPU batch
    cost a third of a short run); a captured step, or any evaluation on a GPU, is timed whole
    (``timed``): a slice there is launch-bound, and scaled up it would overstate the batch. Eager on
    a GPU, one batch runs untimed first: the first at its shape carries cuDNN's algorithm search and
    Triton's compiles."""
    from fastcifar.run import step as step_module

    seen, views = [], []
    model = tiny_model().eval()
    model.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[0]))
    real = step_module.tta_logits
    monkeypatch.setattr(step_module, "tta_logits", lambda *a: views.append(a[2:4]) or real(*a))
    ev = EvalStep(model, StaticBatch(200, torch.float32, CPU), tta=2, capture=False, tta_share=0.25)
    ev.batch.load(torch.randn(150, 3, 32, 32), torch.randint(0, 10, (150,)))  # 50 rows of padding
    clock = iter([10.0, 10.5])
    monkeypatch.setattr(step_module.time, "perf_counter", lambda: next(clock))
    assert step_module.timed_eval(ev, CPU) == pytest.approx(0.5 * 200 / 64)
    assert views == [(2, 0.25), (2, 0.25)]  # the step's level and share, twice: one to set up, one timed
    assert seen[0] == 64 and sum(seen) == 2 * (64 + 6 * 16)  # the plain view, then the 16 least sure's six

    calls = []
    monkeypatch.setattr(step_module, "timed", lambda step, device: calls.append(("timed", step, device)) or 7.0)
    monkeypatch.setattr(ev, "replay", lambda: calls.append(("replay",)))
    seen.clear()
    assert step_module.timed_eval(ev, torch.device("cuda", 0)) == 7.0  # eager on a GPU: one untimed batch first
    ev.graph = object()  # captured: its capture warmed it up
    assert step_module.timed_eval(ev, CPU) == 7.0
    assert calls == [("replay",), ("timed", ev, torch.device("cuda", 0)), ("timed", ev, CPU)] and seen == []


@pytest.mark.slow
def test_cuda_graphs_on_is_refused_on_cpu(learnable_data, tmp_path, capsys):
    proc = train_here(["--data", learnable_data, "--out-dir", tmp_path / "runs", *SHORT, "--cuda-graphs", "on"], capsys)
    assert proc.returncode == 2
    assert "--cuda-graphs on needs a CUDA device" in one_line_error(proc.stderr)
    assert not run_dirs(tmp_path / "runs")


@pytest.mark.parametrize("backend, mode", [(None, "global"), ("gloo", "global"), ("nccl", "thread_local")])
def test_capture_tolerates_nccls_watchdog_only_beside_nccl(monkeypatch, backend, mode):
    """With an NCCL group, capture in thread-local mode: NCCL's watchdog thread polls the events of
    eager collectives whenever it likes, and in the global mode a poll during a capture fails it.
    Without one, the global mode's stricter check stays. Everything CUDA is faked: the decision
    and that capture() passes it to torch.cuda.graph are what runs here."""
    import fastcifar.run.graphs as graphs

    monkeypatch.setattr(graphs.dist, "is_initialized", lambda: backend is not None)
    monkeypatch.setattr(graphs.dist, "get_backend", lambda group=None: backend)
    assert graphs.capture_error_mode() == mode

    class Stream:
        def wait_stream(self, other):
            pass

    seen = {}

    @contextlib.contextmanager
    def graph(cuda_graph, pool=None, stream=None, capture_error_mode="global"):
        seen["mode"] = capture_error_mode
        yield

    for name, fake in {
        "Stream": Stream,
        "current_stream": lambda device=None: Stream(),
        "synchronize": lambda: None,
        "stream": lambda s: contextlib.nullcontext(),
        "CUDAGraph": object,
        "graph": graph,
    }.items():
        monkeypatch.setattr(torch.cuda, name, fake)
    calls = []
    graphs.capture(lambda: calls.append(1), warmup_iters=2)
    assert seen == {"mode": mode} and len(calls) == 3, (seen, calls)


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


@pytest.mark.cuda
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


@pytest.mark.cuda
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


@pytest.mark.cuda
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


@pytest.mark.cuda
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_eager_steps_make_no_host_sync(kernels):
    """The GPU half of the sync-free tests above: with CUDA's sync debug mode set to "error", one eager
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


aten = torch.ops.aten


# The steps captured as CUDA graphs never read a device value on the host. A CUDA graph replays
# device work only: a host read inside the captured region (``.item()``, ``bool(tensor)``,
# ``int(tensor)``, an op whose output shape depends on the data, or a fresh ``torch.tensor(...)`` of
# host values) either breaks the capture or is frozen into the graph with the value it had at
# capture. ``SyncFree`` is a dispatch mode that fails on each of those; the real training step
# (model, summed label-smoothed loss, backward, gradient buckets with a 1-rank gloo all-reduce,
# Nesterov SGD or Muon with the device-side schedule) and the evaluation step with every TTA level
# run under it on the CPU, so such a read fails CI instead of a capture on the GPU. What this cannot
# see: host-to-device copies of CPU tensors (everything is on the CPU here), and work inside Triton
# kernels or DALI (not dispatched through torch).
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


@pytest.mark.parametrize("share", [0.25, 1.0])
def test_tta_scope_test_gives_the_views_to_the_least_sure_of_the_whole_test_set(share):
    """--tta-scope test over 37 images in batches of 10 (the last padded): the views go to the
    ceil(share x 37) least sure of all 37, each image counted once, against a plain-PyTorch
    reference; the batch scope picks among each batch's and counts another loss. With share 1 both
    scopes are the same step: full TTA."""
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 10, 3), torch.nn.Flatten(), torch.nn.LazyLinear(10)).eval()
    rng = np.random.default_rng(0)
    test_set = EvalSet(
        rng.integers(0, 256, (37, 32, 32, 3), dtype=np.uint8),
        rng.integers(0, 10, 37),
        10,
        dtype=torch.float32,
        device=CPU,
    )
    x, y = test_set.images, test_set.labels
    with torch.no_grad():
        model(x[:1])
        plain, full = model(x), views_logits(model, x, 2)
    least = plain.softmax(1).amax(1).argsort()[: math.ceil(share * 37)]
    want = plain.clone()
    want[least] = full[least]
    ctx = DistContext(0, 1, 0, CPU, None)
    results = {}
    for scope in ("batch", "test"):
        ev = make_eval_step(model, StaticBatch(10, torch.float32, CPU), 2, False, tta_share=share, tta_scope=scope)
        assert isinstance(ev, WholeTestEvalStep) is (scope == "test" and share < 1)
        ev.prepare()
        results[scope] = evaluate(model, ev, test_set, ctx)
        results[scope] = evaluate(model, ev, test_set, ctx)  # a second evaluation starts from zero sums
    loss, acc = results["test"]
    assert loss == pytest.approx(F.cross_entropy(want, y).item(), rel=1e-5)
    assert acc == pytest.approx(100.0 * (want.argmax(1) == y).sum().item() / 37)
    if share == 1.0:
        assert results["batch"] == results["test"]
        assert loss == pytest.approx(F.cross_entropy(full, y).item(), rel=1e-5)
    else:
        assert results["batch"][0] != pytest.approx(loss, rel=1e-5), "the batch scope chose the same rows"


def test_tta_scope_test_sizes_its_views_batch_to_the_chosen_rows_and_keeps_no_autograd_graph():
    """The views pass takes the chosen ceil(share x rows) in as few batches as the evaluation's
    size allows, each as full as it can be (2,500 of 10,000 at 1000: three of 834, not 3,000 rows
    with 500 of padding through every view); the counts are the reference's all the same. Both
    passes run without autograd even when called in grad mode (captured, a graph's saved tensors
    would stay alive in its pool)."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 10, 3), torch.nn.Flatten(), torch.nn.LazyLinear(10))
    big = make_eval_step(model, StaticBatch(1000, torch.float32, CPU), 2, False, 0.25, "test", test_rows=10_000)
    assert big.views_batch.capacity == 834 and big.batch.capacity == 1000
    unsized = make_eval_step(model, StaticBatch(10, torch.float32, CPU), 2, False, 0.25, "test")
    assert unsized.views_batch is unsized.batch  # the rank's count unknown: the evaluation's own buffers
    torch.manual_seed(2)
    model.eval()
    rng = np.random.default_rng(0)
    test_set = EvalSet(
        rng.integers(0, 256, (37, 32, 32, 3), dtype=np.uint8),
        rng.integers(0, 10, 37),
        8,
        dtype=torch.float32,
        device=CPU,
    )
    x, y = test_set.images, test_set.labels
    with torch.no_grad():
        model(x[:1])
        plain, full = model(x), views_logits(model, x, 2)
    want = plain.clone()
    least = plain.softmax(1).amax(1).argsort()[:10]  # ceil(0.25 x 37)
    want[least] = full[least]
    ev = make_eval_step(model, StaticBatch(8, torch.float32, CPU), 2, False, 0.25, "test", test_rows=37)
    assert ev.views_batch.capacity == 5  # 10 chosen rows: two batches of 5, not two of 8
    ev.prepare()
    loss, acc = evaluate(model, ev, test_set, DistContext(0, 1, 0, CPU, None))
    assert loss == pytest.approx(F.cross_entropy(want, y).item(), rel=1e-5)
    assert acc == pytest.approx(100.0 * (want.argmax(1) == y).sum().item() / 37)
    ev.batch.load(x[:8], y[:8])
    ev.views_batch.load(x[:5], y[:5])
    with torch.enable_grad():
        ev._body()
        ev._views_body()
    assert not ev.plain.requires_grad and not ev.views.requires_grad


@pytest.mark.cuda
def test_captured_whole_test_set_eval_equals_eager_and_makes_no_host_sync():
    """--tta-scope test on the GPU: its two captured passes count what its eager passes count, and
    the eager ones (sort, gathers, chunks of a count known on the host) never synchronize."""
    model, _ = trained(False)
    model.eval()
    rng = np.random.default_rng(4)
    test_set = EvalSet(
        rng.integers(0, 256, (104, 32, 32, 3), dtype=np.uint8),  # batches of 48 + 48 + 8 (padded)
        rng.integers(0, 10, 104),
        48,
        dtype=torch.float16,
        device=CUDA,
    )
    counts = []
    for capture in (False, True):
        ev = make_eval_step(model, StaticBatch(48, torch.float16, CUDA), 2, capture, tta_share=0.25, tta_scope="test")
        ev.batch.load(*next(iter(test_set)))
        ev.prepare()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if not capture else "default")
        try:
            ev.run(test_set, test_set)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        counts.append((ev.correct.item(), ev.loss_sum.item()))
    assert counts[0][0] == counts[1][0]
    assert counts[0][1] == pytest.approx(counts[1][1], rel=1e-3)
