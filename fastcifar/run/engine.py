"""A run's engine kept for the next run of the same process: ``--runs N``, and a sweep worker's
runs back to back (``fastcifar.sweep.worker``).

The engine is what the trainer builds before a run's clock starts: the model, its gradient sync,
the optimizer, the device schedule, the training step and the evaluation step, their captured
CUDA graphs, and the timed step and evaluation batch of the run's estimate. A run whose settings
differ from the engine's only in ``PER_RUN`` (its seeds and streams, its subset, its outputs and
run folder) takes it over: its own initial weights are built as a fresh run builds them
(``torch.manual_seed`` of the init stream, then the same construction) and copied into the live
tensors, the optimizer state and the schedule's counter go back to where a fresh run starts, and the
warm-up steps, the capture and the estimate's timings are skipped. Steps per epoch (a subset of
another size), the test set's size, the class count, the device and every other setting are part
of the engine's ``key``: a run whose key differs builds its own.

What a replayed graph reads, and why each is still the same tensor on a kept engine (a graph holds
addresses, not Python objects):
- the model's parameters and buffers (weights, batchnorm statistics): ``restart`` copies the new
  run's values in with ``load_state_dict``, in place;
- the gradients (written by backward, read by the optimizer): left allocated and zeroed after each
  step, never set to None on a kept engine (the trainer frees them only on a run nobody takes over);
- the optimizer's momentum and rate multipliers, and its rate tensor: ``load_state_dict`` of the
  state it had when the first run's clock started (in place; the whitening-bias freeze's multiplier
  of 0 goes back to 1), the rate rewritten by the schedule before every step;
- the schedule's table and step counter: the table holds the same values (the key holds every
  setting it is computed from and the steps), the counter goes back to 0;
- the static batches the loader fills before each replay (a new run's loader is bound to them again:
  ``TrainLoader.bind_static``), and the steps' loss and hit sums, zeroed every epoch.
The training step replays its default variant again (the whitening bias's freeze selected the other).

Which runs take the fresh path instead (``key`` returns None), from what each component holds:
- several ranks: the gradient buckets' hooks are removed at a run's end and their compression draws
  are seeded by the run seed, DDP's reducer belongs to one model, and the step's watchdog beat is
  the first run's;
- ``--sparse-mask``: the masked optimizer wraps the engine's optimizer and took its weight decay;
  its masks are the run's;
- ``--resume``: a checkpoint's state goes into one run's objects.
What stays per run on a kept engine, as on a fresh one: the components (``run.components.for_run``:
the whitening init and bias freeze, the lookahead, sparse checkpoints' diffs, the model file, the
outputs), the loader and evaluation sets (a run's subset is its own), the logs. ``--compile``
keeps its compiled network: the same module is called on the same tensors, and torch.compile's
guards are checked on every call, so a change they cover recompiles instead of running stale code.

``Reuse`` is the holder the caller owns and passes in (the sweep worker keeps one for its life; a
``--runs N`` invocation makes its own): the data set as read, for the later runs on the same data
settings, and up to ``MAX_ENGINES`` engines by key (a study's arms interleave, so a worker's
consecutive runs are often of different arms). Nothing is kept in a global: a process that trains
once keeps nothing after it.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fastcifar.parallel.sync import GradientSync
from fastcifar.run.graphs import EvalStep, TrainStep
from fastcifar.run.optim import Optimizer
from fastcifar.run.schedule import DeviceSchedule

# Config fields nothing in an engine is built from: a run on a kept engine may change them. The
# subset fields change the loader, and maybe the steps per epoch, which the key holds.
PER_RUN = frozenset(
    {
        "seed",
        "seed_init",
        "seed_order",
        "seed_aug",
        "seed_subset",
        "subset",
        "subset_mask",
        "subset_fraction",
        "out_dir",
        "save_outputs",
        "save_model",
        "quiet",
        "runs",
        "target_acc",
        "tensorboard",
        "checkpoint_every",
    }
)
# Engines one holder keeps: each holds a model, its optimizer state and, on a GPU, its graphs'
# memory pools; a study of more arms than this that differ in built settings reuses the first ones.
MAX_ENGINES = 4


def fresh_reason(cfg, ctx) -> str:
    """Why a run with these settings builds its own engine and keeps none ("" when it may reuse)."""
    if ctx.distributed:
        return "several ranks"
    if cfg.sparse_mask != "none":
        return "--sparse-mask"
    if cfg.resume:
        return "--resume"
    return ""


def key(cfg, ctx, steps: int, test_rows: int, classes: int, use_graphs: bool) -> str | None:
    """What an engine is built from: every setting but ``PER_RUN``, the device, the steps per epoch,
    the test set's rows and the class count; None when the run takes the fresh path (``fresh_reason``)."""
    if fresh_reason(cfg, ctx):
        return None
    built = sorted((name, value) for name, value in dataclasses.asdict(cfg).items() if name not in PER_RUN)
    return repr((built, str(ctx.device), steps, test_rows, classes, use_graphs))


@dataclass
class Engine:
    """One run's built objects, as the trainer hands them to the next run (see the module docstring)."""

    key: str | None
    model: torch.nn.Module
    sync: GradientSync
    opt: Optimizer
    schedule: DeviceSchedule
    train_step: TrainStep
    eval_step: EvalStep
    step_s: float = 0.0  # s, one training step, timed after the capture: the run's estimate
    eval_s: float = 0.0  # s, one evaluation batch, likewise
    start_state: dict = field(default_factory=dict)  # the optimizer's state as the first run's clock started
    runs: int = 1  # runs trained on it

    def started(self, step_s: float, eval_s: float) -> None:
        """The first run's clock is about to start: its timings, and the optimizer's state now (zero
        momentum, every rate multiplier as built), the state each later run starts from."""
        self.step_s, self.eval_s = step_s, eval_s
        if self.key is not None:
            self.start_state = self.opt.state_dict()

    @torch.no_grad()
    def restart(self, initial: torch.nn.Module) -> None:
        """The next run's start, in place: ``initial``'s weights and buffers (that run's init, built
        as a fresh run builds it) copied into the live model, the optimizer's state as the first run
        started, the schedule at step 0, the sync's residuals reset, the default step selected."""
        self.model.load_state_dict(initial.state_dict())
        self.opt.load_state_dict(self.start_state)
        self.schedule.reset()
        self.sync.reset()
        self.train_step.select(TrainStep.DEFAULT)
        self.train_step.reset()
        self.eval_step.kept = None  # --save-outputs of the run before: its logits are gone with it
        self.eval_step.reset()
        self.runs += 1

    def model_copy(self) -> torch.nn.Module:
        """The trained network for the run's result, apart from the live one the next run trains
        (each run's ``model`` stays its own): a copy without gradients."""
        copied = copy.deepcopy(self.model)
        copied.zero_grad(set_to_none=True)
        return copied


class Reuse:
    """What a process keeps between runs for its later ones: the data set as read (one, by its
    data settings) and up to ``MAX_ENGINES`` engines by key. The caller owns it and passes it to
    the trainer (``fastcifar.train.train``); an engine is taken out for a run and put back when the
    run has finished, so a run that fails leaves none behind half reset."""

    def __init__(self):
        self.data_key = None
        self.dataset = None
        self.engines: dict[str, Engine] = {}

    def read(self, data_key, load: Callable[[], object]):
        """The data set of ``data_key``: the one read before, or ``load()`` (which replaces it)."""
        if self.dataset is None or self.data_key != data_key:
            self.dataset, self.data_key = None, None  # the old set freed before the new one is read
            self.dataset, self.data_key = load(), data_key
        return self.dataset

    def take(self, engine_key: str | None) -> Engine | None:
        """The engine of ``engine_key``, now the caller's; None: build one."""
        return None if engine_key is None else self.engines.pop(engine_key, None)

    def keep(self, engine: Engine) -> bool:
        """Put ``engine`` back for a later run; False when it cannot be reused (no key) or the holder
        is full of others."""
        if engine.key is None or (engine.key not in self.engines and len(self.engines) >= MAX_ENGINES):
            return False
        self.engines[engine.key] = engine
        return True
