"""The CUDA-graph module's logic that runs without a GPU: the decision, the device schedule, the
static buffers, eager train and eval steps over them, and the CPU refusal."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from cli import SHORT, run_dirs, run_train
from conftest import one_line_error

from fastcifar.core.config import Config, ConfigError, validate
from fastcifar.models.resnet9 import ResNet9
from fastcifar.ops.tta import tta_logits
from fastcifar.parallel.compress import why_not_capturable
from fastcifar.parallel.sync import capture_blocker
from fastcifar.run.graphs import EvalStep, StaticBatch, TrainStep, resolve
from fastcifar.run.schedule import DeviceSchedule

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


@pytest.mark.parametrize("level, share", [(0, 1.0), (1, 1.0), (2, 1.0), (1, 0.5), (2, 0.25), (0, 0.25)])
def test_passes_per_image_counts_the_images_tta_logits_runs_through_the_model(level, share):
    """The run's estimate scales a timed forward by ``passes_per_image``: it must be what
    ``tta_logits`` costs, counted here as the rows it sends through the model."""
    from fastcifar.ops.tta import passes_per_image

    rows = []
    model = tiny_model().eval()
    model.register_forward_pre_hook(lambda _, args: rows.append(args[0].shape[0]))
    with torch.no_grad():
        tta_logits(model, torch.randn(8, 3, 32, 32), level, share)  # share x 8 is whole: no rounding up
    assert sum(rows) == passes_per_image(level, share) * 8


def test_timed_eval_times_a_slice_on_the_cpu_and_the_whole_batch_elsewhere(monkeypatch):
    """On the CPU the estimate times the second forward of 64 of the batch's images, scaled to the
    batch and its TTA passes (a whole CPU batch cost a third of a short run); a captured step, or
    any evaluation on a GPU, is timed whole (``timed``): a slice there is launch-bound, and scaled
    up it would overstate the batch. Eager on a GPU, one batch runs untimed first: the first at its
    shape carries cuDNN's algorithm search and Triton's compiles."""
    from fastcifar.run import step as step_module

    seen = []
    model = tiny_model().eval()
    model.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[0]))
    ev = EvalStep(model, StaticBatch(200, torch.float32, CPU), tta=2, capture=False, tta_share=0.25)
    ev.batch.load(torch.randn(200, 3, 32, 32), torch.randint(0, 10, (200,)))
    clock = iter([10.0, 10.5])
    monkeypatch.setattr(step_module.time, "perf_counter", lambda: next(clock))
    assert step_module.timed_eval(ev, CPU) == pytest.approx(0.5 * 200 / 64 * (1 + 6 * 0.25))
    assert seen == [64, 64]  # one forward to set up, one timed; no TTA views run

    calls = []
    monkeypatch.setattr(step_module, "timed", lambda step, device: calls.append(("timed", step, device)) or 7.0)
    monkeypatch.setattr(ev, "replay", lambda: calls.append(("replay",)))
    seen.clear()
    assert step_module.timed_eval(ev, torch.device("cuda", 0)) == 7.0  # eager on a GPU: one untimed batch first
    ev.graph = object()  # captured: its capture warmed it up
    assert step_module.timed_eval(ev, CPU) == 7.0
    assert calls == [("replay",), ("timed", ev, torch.device("cuda", 0)), ("timed", ev, CPU)] and seen == []


@pytest.mark.slow
def test_cuda_graphs_on_is_refused_on_cpu(learnable_data, tmp_path):
    proc = run_train(["--data", learnable_data, "--out-dir", tmp_path / "runs", *SHORT, "--cuda-graphs", "on"])
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
