"""The training step and the evaluation pass the trainer runs: the step is the function that runs
eagerly or is captured as a CUDA graph (``graphs.TrainStep``); ``bench/bench_step.py`` times the
same one."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from fastcifar.data.loader import EvalSet
from fastcifar.ops.tta import tta_logits
from fastcifar.parallel import distributed
from fastcifar.run import profiling
from fastcifar.run.graphs import EvalStep, TrainStep
from fastcifar.run.optim import Optimizer
from fastcifar.run.schedule import DeviceSchedule

NO_MARKERS = profiling.markers(False)  # (push, pop) that do nothing: a step without NVTX ranges


def make_step(
    net,
    opt: Optimizer,
    schedule: DeviceSchedule,
    label_smoothing: float,
    markers=NO_MARKERS,
    buckets=None,
    beat=None,
    grads_to_none: bool = False,
):
    """One training step on a batch: the function that runs eagerly or is captured. ``buckets``
    (several ranks, --comm bucketed: ``parallel.comm.GradBuckets``) average the gradients during
    backward; ``markers`` (push, pop) put NVTX ranges around its phases for nsys (no-ops unless
    --nvtx on CUDA). ``beat``: called as each eager step starts (the warm-up steps; a captured step's
    replays run no Python): the progress watchdog's, so warm-up and capture are watched too.
    ``grads_to_none`` (``Config.grads_to_none``; ignored with ``buckets``, which own the gradients):
    ``GradReset``'s drop instead of the optimizer's in-place zeroing."""
    push, pop = markers
    reset = GradReset(net) if grads_to_none and buckets is None else None

    def step(images, labels):
        if beat is not None:
            beat()
        if buckets is not None:
            buckets.begin()  # a parameter frozen since the last step leaves its bucket (host-only, eager)
        if reset is not None:
            reset.before()
        schedule.apply(opt.lr)  # device-side: the captured graph reads each step's rate
        push("forward")
        logits = net(images)
        loss = F.cross_entropy(logits.float(), labels, reduction="sum", label_smoothing=label_smoothing)
        pop()
        push("backward")  # with --comm ddp the gradient all-reduce runs inside backward, on its own stream
        loss.backward()
        pop()
        if buckets is not None:
            push("comm")
            buckets.finish()  # the optimizer waits (a stream wait on GPU) for every bucket's average
            pop()
        push("optimizer")
        opt.step()
        if reset is None:
            opt.zero_grad()  # in place, so bucketed gradients stay views into their buckets
        else:
            reset.after()
        pop()
        return loss.detach(), (logits.argmax(1) == labels).sum()

    return step


class GradReset:
    """Gradients dropped after each step instead of zeroed in place. A parameter whose ``.grad`` is
    None takes backward's gradient tensor as it is (autograd's AccumulateGrad), where a zeroed one
    costs a memset and an add (0 + g: the same value, so the same weights). The parameters trained
    when the step is built (``requires_grad``) are the optimizer's; one frozen later (the whitening
    bias after its epochs) gets no gradient from backward, while the optimizer still reads one (its
    rate scaled to 0): it keeps a zero gradient, zeroed in place as before. That tensor is made once
    per parameter and held here for the step's life: a graph captured while the parameter was frozen
    reads it at its address, and a later eager step (another graph's warm-up) drops ``.grad`` again."""

    def __init__(self, net: torch.nn.Module):
        self.params = [p for p in net.parameters() if p.requires_grad]
        self.zeros: dict[int, torch.Tensor] = {}  # by index into params: a frozen one's gradient

    def before(self) -> None:
        """Before backward: the zero gradient of each parameter frozen since it was dropped."""
        for i, p in enumerate(self.params):
            if p.grad is None and not p.requires_grad:
                if i not in self.zeros:
                    self.zeros[i] = torch.zeros_like(p)
                p.grad = self.zeros[i]

    def after(self) -> None:
        """After the optimizer's step: drop the trained parameters' gradients, zero the frozen ones'."""
        for p in self.params:
            if p.requires_grad:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()


def evaluate(model, eval_step: EvalStep, test_set: EvalSet, ctx, progress=None, desc="") -> tuple[float, float]:
    """Test loss and accuracy (%) over all ranks' slices of the test set; under a bar of ``progress``
    (``run.progress.Progress``, drawn on rank 0's terminal only) when given."""
    model.eval()
    eval_step.reset()
    batches = progress.steps(test_set, len(test_set), desc, unit="batch") if progress is not None else test_set
    eval_step.run(batches, test_set)
    total_loss, total_correct, count = distributed.all_sum(
        [eval_step.loss_sum.item(), float(eval_step.correct.item()), float(len(test_set.labels))], ctx, ctx.device
    )
    return total_loss / count, 100.0 * total_correct / count


def timed(step: TrainStep | EvalStep, device: torch.device) -> float:
    """Seconds ``step`` takes once more on the batch it holds (after its warm-up or capture: what
    the run's estimate starts from). Off the clock; the caller restores what the step changed (a
    training step's weights, statistics, momentum and schedule: the warm-up's restore), and the
    step's sums are reset here."""
    synchronize(device)
    start = time.perf_counter()
    step.replay()
    synchronize(device)
    seconds = time.perf_counter() - start
    step.reset()
    return seconds


# Images of an evaluation batch that a CPU evaluation's estimate times: a whole batch cost a third of a
# short CPU run (1000 images, six TTA views: 5 s of a 15 s run), a slice of 64 a few ms.
EVAL_SLICE = 64


def timed_eval(step: EvalStep, device: torch.device) -> float:
    """Seconds an evaluation batch takes, for the run's estimate: on a GPU the batch itself, captured
    or eager (milliseconds; a slice there would be launch-bound, and scaled up it would overstate
    the batch many times); on the CPU the step's own test-time augmentation (``tta_logits``: the
    views, their shifts and stacking, not a plain forward times the views, which read 0.6x of the
    batch's time on 2 cores) of ``EVAL_SLICE`` of its images, timed the second of two times (the
    first sets up the kernels for that shape) and scaled to the batch's images, padding included:
    the step runs the whole padded batch."""
    if step.graph is not None:  # its capture ran two warm-up batches
        return timed(step, device)
    if device.type != "cpu":  # eager: the first batch at this shape, in eval mode, carries cuDNN's
        step.replay()  # algorithm search, Triton's compiles and first allocations; off the clock
        return timed(step, device)  # (which resets the sums this batch added)
    images, valid = step.batch.images[:EVAL_SLICE], step.batch.valid[:EVAL_SLICE]
    with torch.no_grad():  # the CPU's work is done when the call returns: nothing to synchronize
        tta_logits(step.model, images, step.tta, step.tta_share, valid)
        start = time.perf_counter()
        tta_logits(step.model, images, step.tta, step.tta_share, valid)
        seconds = time.perf_counter() - start
    return seconds * step.batch.images.shape[0] / images.shape[0]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
