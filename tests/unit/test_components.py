"""What the trainer calls, when: the components of a run (run.component) relative to the clock and
to graph capture, pinned on the CPU so a move of the code cannot move a hook across the clock.

The clock starts and stops at the trainer's two ``synchronize`` calls around an epoch's steps; the
capture is ``TrainStep.warm_up_and_capture``. A recording component joins the run's list."""

from __future__ import annotations

import pytest
from cli import FAST_SHORT
from conftest import write_official

from fastcifar import train
from fastcifar.core.options import parse_args
from fastcifar.parallel import distributed
from fastcifar.run import components
from fastcifar.run.component import Component, Components
from fastcifar.run.graphs import TrainStep


class Recorder(Component):
    def __init__(self, events):
        self.events = events

    def start(self, result):
        self.events.append("start")

    def epoch_start(self, epoch):
        self.events.append(f"epoch_start {epoch}")

    def after_step(self):
        self.events.append("step")

    def epoch_end(self, epoch):
        self.events.append(f"epoch_end {epoch}")

    def epoch_done(self, epoch, record):
        self.events.append(f"epoch_done {epoch} acc={record.test_acc is not None}")

    def finish(self, result):
        self.events.append(f"finish acc={result.test_acc == result.epochs[-1].test_acc}")


@pytest.fixture
def recorded(tmp_path, monkeypatch):
    data, _ = write_official(tmp_path / "data", per_batch=40, n_test=50)
    events, members = [], []
    real_for_run, real_capture = components.for_run, TrainStep.warm_up_and_capture

    def for_run(*args, **kwargs):
        run = real_for_run(*args, **kwargs)
        members.append([type(c).__name__ for c in run.members])
        return Components([*run.members, Recorder(events)])

    def capture(self, *args, **kwargs):
        events.append("capture")
        return real_capture(self, *args, **kwargs)

    watch = []  # (what the progress watchdog was told, how many events had happened by then)
    real_dog, real_beat = distributed.ProgressWatchdog.__init__, distributed.ProgressWatchdog.beat

    def new_dog(self, *args, **kwargs):
        watch.append(("new", len(events)))
        real_dog(self, *args, **kwargs)

    def beat(self):
        watch.append(("beat", len(events)))
        real_beat(self)

    monkeypatch.setattr(distributed.ProgressWatchdog, "__init__", new_dog)
    monkeypatch.setattr(distributed.ProgressWatchdog, "beat", beat)
    monkeypatch.setattr(components, "for_run", for_run)
    monkeypatch.setattr(TrainStep, "warm_up_and_capture", capture)
    monkeypatch.setattr(train, "synchronize", lambda device: events.append("clock"))
    argv = [
        *FAST_SHORT,
        "--epochs",
        "2",
        "--batch-size",
        "50",
        "--data",
        str(data),
        "--out-dir",
        str(tmp_path / "runs"),
        "--quiet",
        "--loader",
        "torch",
        "--checkpoint-every",
        "1",
    ]
    cfg = parse_args([str(a) for a in argv])
    ctx = distributed.setup("cpu", 60)
    try:
        (result,) = train.run(cfg, ctx)
    finally:
        distributed.teardown(ctx)
    return events, members, result, watch


def test_hooks_sit_where_the_clock_and_the_capture_put_them(recorded):
    events, _, result, _ = recorded
    steps = 4  # 200 training images, batch 50
    per_epoch = ["clock", "epoch_start {e}", *["step"] * steps, "epoch_end {e}", "clock", "epoch_done {e} acc=True"]
    # the trainer's capture, then the recipe's second variant (bias frozen), both before start
    want = ["capture", "capture", "start"] + [x.format(e=e) for e in range(2) for x in per_epoch] + ["finish acc=True"]
    assert events == want
    assert len(result.epochs) == 2


def test_the_run_components_and_their_order_with_the_watchdog_before_first_epoch(recorded):
    """... and one progress watchdog a run, started before the warm-up steps and beaten by them, so
    a peer lost in the model handshake, warm-up or capture ends the rank as one lost in training."""
    events, members, _, watch = recorded
    assert members == [
        [
            "Whitening",
            "RunHooks",
            "SparseRun",
            "StepWindow",
            "LossGuard",
            "Checkpoints",
            "SyncCleanup",
            "Watchdog",
            "ModelFile",
        ]
    ]
    assert [what for what, _ in watch].count("new") == 1 and watch[0] == ("new", 0), watch
    first_capture, start = events.index("capture"), events.index("start")
    warm_up_beats = [at for what, at in watch if what == "beat" and first_capture < at <= start]
    assert len(warm_up_beats) >= 2, f"the warm-up steps did not beat the watchdog: {watch}"


def test_components_call_only_overridden_after_step():
    class Quiet(Component):
        pass

    class Loud(Component):
        def __init__(self):
            self.n = 0

        def after_step(self):
            self.n += 1

    loud = Loud()
    group = Components([Quiet(), loud, Quiet()])
    group.after_step()
    assert loud.n == 1 and len(group._after_step) == 1
    assert group.start(None) == 0  # nobody resumes: epoch 0


def test_start_takes_a_resumes_epoch():
    class Resume(Component):
        def start(self, result):
            return 3

    assert Components([Component(), Resume(), Component()]).start(None) == 3


@pytest.mark.parametrize("timeout_s, before", [(10.0, 300.0), (900.0, 900.0)])
def test_watchdog_gives_start_up_its_grace_then_watches_at_dist_timeout(timeout_s, before):
    """Warm-up compiles kernels on every rank at once (minutes with cold caches): until the run's start
    the bound is at least START_UP_GRACE_S, so a small --dist-timeout-s ends no healthy rank there;
    from the run's start on, --dist-timeout-s as given."""
    import types

    import torch

    cfg = parse_args(["--dist-timeout-s", str(timeout_s)])
    ctx = distributed.DistContext(0, 1, 0, torch.device("cpu"), None)  # one rank: no thread to start
    with components.Watchdog(types.SimpleNamespace(cfg=cfg, ctx=ctx)) as watchdog:
        assert watchdog.dog.bound == before
        assert watchdog.start(None) is None  # no answer: the run's start epoch is the others'
        assert watchdog.dog.bound == timeout_s
