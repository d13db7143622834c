"""A run's components (``component.Component``), chosen from the settings in one place.

``Session`` is what every run of one invocation shares; ``for_run`` lists the components of one
run, in the order the trainer calls them at each point. The order matters where two act at the
same point: at epoch 0's start the whitening init (``run.whitening``) runs before the lookahead's
slow copy is taken and the sparse masks are chosen; after a step the recipe's lookahead syncs
before local SGD merges, the profiler window counts the step, and the watchdog hears last; after
an epoch's evaluation a sparse diff is written, the epoch goes to TensorBoard (--tensorboard), the
guard may stop the run, a checkpoint is saved, then the watchdog hears.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastcifar.core.config import Config
from fastcifar.data.dataset import Dataset
from fastcifar.data.loader import EvalSet, TrainLoader
from fastcifar.models import files
from fastcifar.ops.augment import CIFAR10_MEAN, CIFAR10_STD
from fastcifar.parallel import compress, distributed
from fastcifar.parallel.sync import GradientSync
from fastcifar.run import outputs, profiling, report, tensorboard
from fastcifar.run.component import Component, Components
from fastcifar.run.engine import Reuse
from fastcifar.run.guard import LossGuard
from fastcifar.run.progress import Progress
from fastcifar.run.report import RunLog
from fastcifar.run.sparse.run import SparseRun
from fastcifar.run.state import Checkpoints
from fastcifar.run.step import evaluate


@dataclass
class Session:
    """What every run of one invocation shares: the settings, the ranks, the data and the logs."""

    cfg: Config
    ctx: distributed.DistContext
    dtype: torch.dtype
    train_loader: TrainLoader
    test_set: EvalSet
    log: RunLog
    progress: Progress
    use_graphs: bool
    classes: tuple[str, ...]
    resume: dict | None = None  # a checked training state (run.state.load_state), for run 1..N
    eval_set: EvalSet | None = None  # each epoch's evaluation: test_set, or --val-split's held-out images
    whole: Dataset | None = None  # the data set as read, before --subset and --val-split (--save-outputs train)
    reuse: Reuse | None = None  # engines kept between runs (run.engine); None: the session's own
    engine_key: str | None = None  # what this session's engines are built from; None: each run builds its own

    def __post_init__(self):
        if self.eval_set is None:
            self.eval_set = self.test_set
        if self.reuse is None:
            self.reuse = Reuse()


class Watchdog(Component):
    """Several ranks: a stalled peer ends this rank too, also inside graph replays (distributed.py).
    Started at the run's start (``with Watchdog(session) as dog``), so it covers the model
    handshake, the warm-up steps and graph capture as well: a peer lost there would otherwise be
    left to the handshake's 60 s or NCCL's timeout, whose aborted communicator then fails the next
    capture with a CUDA error (a traceback, exit 1), not exit 3 and one line. The warm-up steps beat
    it (``make_step``'s ``beat``), so only one step, or the gap between two beats, longer than
    --dist-timeout-s ends a rank, as it would end the step's own collective anyway. Until the run's
    start (after warm-up, capture and the timed step and evaluation batch) the bound is at least
    ``START_UP_GRACE_S``: the first steps compile kernels (Triton's first launches, --compile's
    inductor) on every rank at once, minutes with cold caches, while no rank waits on another; a small
    --dist-timeout-s (10 s in the kill test) would end healthy ranks there."""

    START_UP_GRACE_S = 300.0  # the default --dist-timeout-s: a larger one is kept as it is

    def __init__(self, session: Session):
        cfg, ctx = session.cfg, session.ctx
        # a stall ends the rank from the watchdog's thread: log.txt and summary.json say why first
        self.dog = distributed.ProgressWatchdog(
            cfg.dist_timeout_s,
            ctx,
            enabled=ctx.distributed,
            on_stall=lambda why: report.stop_open_logs("failed", why),
            grace_s=self.START_UP_GRACE_S,
        )

    def start(self, result) -> None:
        self.dog.settle()

    def after_step(self) -> None:
        self.dog.beat()

    def epoch_done(self, epoch: int, record) -> None:
        self.dog.beat()

    def finish(self, result) -> None:
        self.dog.close()

    def __enter__(self) -> Watchdog:
        return self

    def __exit__(self, *exc) -> None:
        self.dog.close()  # also when the run raises: an API caller's process is not ended later


class SyncCleanup(Component):
    """The gradient sync's compression statistics, and its hooks removed at the end (the run's
    model outlives the run)."""

    def __init__(self, sync: GradientSync, log: RunLog, run: int):
        self.sync, self.log, self.run = sync, log, run

    def finish(self, result) -> None:
        compress.log_stats(self.sync.compression, self.log, self.run)
        self.sync.remove()


class ModelFile(Component):
    """``--save-model``: the evaluated (lookahead-averaged) weights in the run folder, off the clock."""

    def __init__(self, session: Session, run: int):
        self.cfg, self.log, self.run, self.classes = session.cfg, session.log, run, session.classes

    def finish(self, result) -> None:
        path = files.model_path(self.log.dir, self.run, self.cfg.runs)
        result.model_path = str(
            files.save_model(path, result.model, self.cfg, self.classes, result.test_acc, CIFAR10_MEAN, CIFAR10_STD)
        )
        self.log.line(f"model: {result.model_path}")


class FinalTest(Component):
    """``--val-split``: the epochs were evaluated on held-out training images; the test set once,
    after the last epoch, gives the run's figure (``result.test_acc``; the last validation
    accuracy becomes ``result.val_acc``). Before the model file, which records the test figure."""

    def __init__(self, session: Session, model, eval_step, run: int):
        self.session, self.model, self.eval_step, self.run = session, model, eval_step, run

    def finish(self, result) -> None:
        s = self.session
        _, acc = evaluate(self.model, self.eval_step, s.test_set, s.ctx, s.progress, f"run {self.run} test set")
        result.val_acc, result.test_acc = result.test_acc, acc
        s.log.line(
            f"run {self.run}: the test set, evaluated once after the last epoch: test_acc {acc:.2f}% "
            f"(last val_acc {result.val_acc:.2f}%)"
        )


def check(cfg: Config) -> None:
    """The options whose library must import (--tensorboard), refused in one line before anything
    is read or written."""
    tensorboard.check(cfg)


def for_run(
    session: Session,
    run: int,
    network_parts: list[Component],
    parts: dict,
    sync: GradientSync,
    sparse: SparseRun,
    lengths: list[int],
    eval_step,
    watchdog: Watchdog,
) -> Components:
    """The components of run ``run`` (0: an unlogged warm-up run, which saves and resumes nothing).
    ``network_parts``: what the network's contracts ask of the run (``whitening.for_model``: a
    whitening conv's init and bias freeze), first at every point; ``parts``: the run's objects a
    training state covers (run.state); ``lengths``: steps per epoch; ``watchdog``: the run's,
    started before its warm-up."""
    cfg, log = session.cfg, session.log
    members: list[Component] = [*network_parts, parts["hooks"], sparse]  # after warm-up: the window may start at 0
    members.append(profiling.StepWindow(cfg.profile_steps if run == 1 else ""))  # nsys range, profiler steps
    if cfg.tensorboard and log.dir is not None and run:  # rank 0; before the guard: a diverged epoch is shown too
        images_per_step = session.train_loader.batch_size * session.ctx.world_size
        members.append(tensorboard.TensorBoard(cfg, log.dir, run, images_per_step, lengths, log.names, log.line))
    members.append(LossGuard(num_classes=len(session.classes)))  # NaN or exploded loss ends the run
    members.append(
        Checkpoints(cfg, log, parts, len(lengths), session.resume if run else None, cfg.checkpoint_every if run else 0)
    )
    members.append(SyncCleanup(sync, log, run))
    if session.eval_set is not session.test_set:  # --val-split
        members.append(FinalTest(session, parts["model"], eval_step, run))
    if cfg.save_outputs != "none" and run:  # after the test set's last evaluation; gathers over the ranks
        members.append(outputs.Outputs(session, parts["model"], eval_step, run, len(lengths), watchdog.dog.beat))
    members.append(watchdog)  # last to hear of each step; closed before the model file is written
    if cfg.save_model and log.dir is not None:  # rank 0 alone, no collective: a slow disk ends no rank
        members.append(ModelFile(session, run))
    return Components(members)
